"""An output constraint beside ``--reasoning-parser`` applies once the reasoning ends, as
vLLM 0.32 applies it: the reasoning is the model's own (token for token what the same
seeded request writes unconstrained), the content follows the constraint. On a tiny model
whose tokenizer holds Qwen3's markers; a ``logit_bias`` on a marker makes the random
weights end their reasoning within a few tokens (the fixtures are test_reasoning_http's)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from _server_helpers import model_name, start_app, stop_app
from test_reasoning_http import ASK, llm, qwen_llm, think_dir  # noqa: F401 (fixtures)

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}},
          "required": ["color"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}}]
SEEDS = range(4)


def _body(client, engine, seed: int, marker: str, bias: float = 4, **extra):
    return {"model": model_name(client), "messages": ASK, "max_tokens": 80, "seed": seed,
            "temperature": 1.0,
            "logit_bias": {str(engine.tokenizer.token_to_id(marker)): bias},
            "return_token_ids": True, **extra}


def _to_marker(ids: list[int], marker_id: int) -> list[int]:
    return ids[:ids.index(marker_id) + 1]


async def _raws(aiohttp_client, engine, marker: str,
                **extra) -> list[tuple[str, list[int]]]:
    """Each seed's text and ids from a server without the flag and the constraint."""
    plain = await start_app(aiohttp_client, engine)
    raws = []
    for seed in SEEDS:
        answer = await (await plain.post("/v1/chat/completions",
                                         json=_body(plain, engine, seed, marker, **extra))).json()
        choice = answer["choices"][0]
        raws.append((choice["message"]["content"], choice["token_ids"]))
    await stop_app(plain)
    return raws


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
async def test_the_schema_constrains_the_content_not_the_reasoning(
        aiohttp_client, llm, parser):  # noqa: F811
    raws = await _raws(aiohttp_client, llm, "</think>")
    end = llm.tokenizer.token_to_id("</think>")
    client = await start_app(aiohttp_client, llm, reasoning_parser=parser)
    ended = 0
    for seed, (raw, raw_ids) in zip(SEEDS, raws, strict=True):
        assert "</think>" in raw, raw  # the bias ends the reasoning within the cap
        for stream in (False, True):
            body = _body(client, llm, seed, "</think>", response_format=FORMAT, stream=stream)
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status == 200, await response.text()
            if stream:
                events = [json.loads(line[6:]) for line in (await response.text()).splitlines()
                          if line.startswith("data: {")]
                deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
                ids = [i for e in events if e["choices"] for i in e["choices"][0]["token_ids"]]
                reasoning = "".join(d.get("reasoning") or "" for d in deltas)
                content = "".join(d.get("content") or "" for d in deltas)
                finish = events[-1]["choices"][0]["finish_reason"]
            else:
                choice = (await response.json())["choices"][0]
                ids = choice["token_ids"]
                reasoning, content = (choice["message"]["reasoning"] or "",
                                      choice["message"]["content"] or "")
                finish = choice["finish_reason"]
            # the reasoning is what the model writes unconstrained, to the marker
            assert _to_marker(ids, end) == _to_marker(raw_ids, end)
            assert reasoning == raw.partition("</think>")[0].replace("<think>", "")
            if finish == "stop":
                jsonschema.validate(json.loads(content), SCHEMA)
                ended += 1
    assert ended >= 4  # most answers complete their JSON within the cap
    await stop_app(client)


async def test_a_required_tool_call_follows_qwen3s_reasoning(
        aiohttp_client, qwen_llm):  # noqa: F811
    """``<tool_call>`` ends Qwen3's reasoning and is the call grammar's first token (in
    Qwen3's layout: the system turn's ``<tool_call>`` example is not the answer's turn)."""
    raws = await _raws(aiohttp_client, qwen_llm, "<tool_call>", bias=6, tools=TOOLS,
                       tool_choice="none")
    opening = qwen_llm.tokenizer.token_to_id("<tool_call>")
    client = await start_app(aiohttp_client, qwen_llm, reasoning_parser="qwen3")
    for seed, (_, raw_ids) in zip(SEEDS, raws, strict=True):
        assert opening in raw_ids  # the bias ends the reasoning within the cap
        body = _body(client, qwen_llm, seed, "<tool_call>", bias=6, tools=TOOLS,
                     tool_choice="required", max_tokens=120)
        answer = await (await client.post("/v1/chat/completions", json=body)).json()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls", (seed, choice)
        assert _to_marker(choice["token_ids"], opening) == _to_marker(raw_ids, opening)
        (call,) = choice["message"]["tool_calls"][:1]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    await stop_app(client)


async def test_a_marker_the_constraint_refuses_ends_the_answer(
        aiohttp_client, llm):  # noqa: F811
    """Qwen3's ``<tool_call>`` ends the reasoning; a JSON schema cannot start with it, so
    the answer ends there, as at any dead end of a constraint (finish ``grammar``, no
    token outside the constraint written)."""
    client = await start_app(aiohttp_client, llm, reasoning_parser="qwen3")
    tool_call = str(llm.tokenizer.token_to_id("<tool_call>"))
    body = {"model": model_name(client), "messages": ASK, "max_tokens": 20, "seed": 0,
            "temperature": 0, "logit_bias": {tool_call: 100}, "response_format": FORMAT}
    answer = await (await client.post("/v1/chat/completions", json=body)).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "grammar", answer
    assert not choice["message"]["content"] and not choice["message"]["reasoning"]
    assert answer["usage"]["completion_tokens"] == 0
    await stop_app(client)


PREFILLED = [*ASK, {"role": "assistant", "content": "<think>\nblue light\n</think>\n\n"}]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
async def test_a_prompt_that_ends_the_reasoning_is_answered_in_content(
        aiohttp_client, llm, parser):  # noqa: F811
    """An assistant turn whose reasoning is written and closed, continued: the prompt ends
    the reasoning (vLLM's ``is_reasoning_end`` on the prompt), so the schema applies from
    the first token and the answer is content, whole and streamed, with no reasoning."""
    client = await start_app(aiohttp_client, llm, reasoning_parser=parser)
    valid = 0
    for seed in SEEDS:
        for stream in (False, True):
            body = {"model": model_name(client), "messages": PREFILLED, "max_tokens": 60,
                    "seed": seed, "temperature": 1.0, "response_format": FORMAT,
                    "continue_final_message": True, "add_generation_prompt": False,
                    "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status == 200, await response.text()
            if stream:
                events = [json.loads(line[6:]) for line in (await response.text()).splitlines()
                          if line.startswith("data: {")]
                deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
                reasoning = "".join(d.get("reasoning") or "" for d in deltas)
                content = "".join(d.get("content") or "" for d in deltas)
                finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
                usage = events[-1]["usage"]
            else:
                answer = await response.json()
                choice = answer["choices"][0]
                reasoning, content = (choice["message"]["reasoning"] or "",
                                      choice["message"]["content"] or "")
                finish, usage = choice["finish_reason"], answer["usage"]
            assert reasoning == "", (seed, stream, reasoning)
            assert usage["completion_tokens_details"]["reasoning_tokens"] == 0
            assert content.strip()
            if finish == "stop":
                jsonschema.validate(json.loads(content), SCHEMA)
                valid += 1
    assert valid >= 6  # most answers complete their JSON within the cap
    await stop_app(client)
