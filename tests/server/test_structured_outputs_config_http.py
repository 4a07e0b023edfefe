"""``--structured-outputs-config`` on served requests: ``disable_any_whitespace`` writes
JSON with no whitespace between its tokens even where the weights favour whitespace, and
``enable_in_reasoning`` under ``--reasoning-parser qwen3`` constrains the answer from its
first token (by default the constraint waits for ``</think>``). Tiny models with random
weights; a ``logit_bias`` steers them (the fixtures are test_reasoning_http's)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from _server_helpers import make_llm, model_name, start_app, stop_app
from test_reasoning_http import ASK, think_dir  # noqa: F401 (a fixture)
from test_reasoning_http import llm as think_llm  # noqa: F401 (a fixture)

from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig

SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["color", "ok", "tags"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
SEEDS = range(4)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_model_len=256)


def _whitespace_bias(tokenizer) -> dict[str, float]:
    """Every token that is whitespace alone, favoured: flexible JSON fills up with it."""
    ids = [i for i in range(tokenizer.vocab_size)
           if (text := tokenizer.decode([i])) and not text.strip()]
    return {str(i): 6.0 for i in ids}


async def _choices(client, llm, **extra) -> list[dict]:
    out = []
    for seed in SEEDS:
        body = {"model": model_name(client), "messages": ASK, "max_tokens": 60, "seed": seed,
                "temperature": 1.0, "logit_bias": _whitespace_bias(llm.tokenizer),
                "response_format": FORMAT, **extra}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status == 200, await response.text()
        out.append((await response.json())["choices"][0])
    return out


async def test_disable_any_whitespace_writes_compact_json(aiohttp_client, llm) -> None:
    plain = await start_app(aiohttp_client, llm)
    # Without the option the weights' favourite whitespace goes in between the tokens.
    assert all(any(c.isspace() for c in choice["message"]["content"])
               for choice in await _choices(plain, llm))
    await stop_app(plain)
    config = StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True)
    client = await start_app(aiohttp_client, llm, structured_outputs_config=config)
    for choice in await _choices(client, llm):
        assert choice["finish_reason"] == "stop", choice
        content = choice["message"]["content"]
        jsonschema.validate(json.loads(content), SCHEMA)
        assert content == json.dumps(json.loads(content), separators=(",", ":"))
    await stop_app(client)


async def _answers(client, engine, stream: bool) -> list[tuple[list[int], str, str, str]]:
    """Each seed's (token ids, reasoning, content, finish) with ``</think>`` favoured."""
    end = str(engine.tokenizer.token_to_id("</think>"))
    out = []
    for seed in SEEDS:
        body = {"model": model_name(client), "messages": ASK, "max_tokens": 60, "seed": seed,
                "temperature": 1.0, "logit_bias": {end: 100}, "response_format": FORMAT,
                "return_token_ids": True, "stream": stream}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status == 200, await response.text()
        if stream:
            events = [json.loads(line[6:]) for line in (await response.text()).splitlines()
                      if line.startswith("data: {")]
            choices = [e["choices"][0] for e in events if e["choices"]]
            out.append(([i for c in choices for i in c.get("token_ids") or []],
                        "".join(c["delta"].get("reasoning") or "" for c in choices),
                        "".join(c["delta"].get("content") or "" for c in choices),
                        choices[-1]["finish_reason"]))
        else:
            choice = (await response.json())["choices"][0]
            message = choice["message"]
            out.append((choice["token_ids"], message["reasoning"] or "",
                        message["content"] or "", choice["finish_reason"]))
    return out


@pytest.mark.parametrize("stream", [False, True])
async def test_enable_in_reasoning_constrains_from_the_first_token(
        aiohttp_client, think_llm, stream) -> None:  # noqa: F811
    tokenizer = think_llm.tokenizer
    end = tokenizer.token_to_id("</think>")
    gated = await start_app(aiohttp_client, think_llm, reasoning_parser="qwen3")
    for ids, reasoning, content, _ in await _answers(gated, think_llm, stream):
        # By default the reasoning is the model's own: the favoured </think> comes first,
        # and the constraint starts after it, in the content.
        assert ids[0] == end and not reasoning and content.startswith("{")
    await stop_app(gated)
    # (compact, so that the random weights finish the JSON within max_tokens)
    config = StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True,
                                     enable_in_reasoning=True)
    client = await start_app(aiohttp_client, think_llm, reasoning_parser="qwen3",
                             structured_outputs_config=config)
    for ids, reasoning, content, finish in await _answers(client, think_llm, stream):
        assert end not in ids  # the schema, from the first token, has no room for it
        assert tokenizer.decode(ids[:1]).startswith("{")
        assert finish == "stop"
        # qwen3 reads an answer with no </think> as reasoning, as vLLM's parser does
        assert not content
        jsonschema.validate(json.loads(reasoning), SCHEMA)
    await stop_app(client)
