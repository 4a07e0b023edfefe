"""A streamed Responses answer with ``--reasoning-parser``, as vLLM 0.32 streams it for a
model without Harmony (``SimpleStreamingEventProcessor``): the reasoning item's events
(``output_item.added``, ``content_part.added``, ``reasoning_text.delta``...,
``reasoning_text.done``, ``content_part.done``, ``output_item.done``), then the message's,
adding up to the answer given whole. The tiny model's tokenizer holds Qwen's markers; a
``logit_bias`` on them makes its random weights write them, a seed at a time."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from _server_helpers import metric, model_name, start_app, start_sdk, stop_app, wait_for_metric
from test_reasoning_http import llm, think_dir  # noqa: F401 (fixtures)
from test_responses import _events

from kvledger.engine.server.state import STATE

# (bias on <think> and </think>, seed): reasoning then a message, a message alone (qwen3's
# seed 3 writes </think> first), reasoning alone (no </think> within the cap)
CASES = [(5, seed) for seed in range(6)] + [(3, 0)]
DELTAS = {"response.reasoning_text.delta", "response.output_text.delta"}
OPENED = {"reasoning": ["response.output_item.added", "response.content_part.added",
                        "response.reasoning_text.delta", "response.reasoning_text.done",
                        "response.content_part.done", "response.output_item.done"],
          "message": ["response.output_item.added", "response.content_part.added",
                      "response.output_text.delta", "response.output_text.done",
                      "response.content_part.done", "response.output_item.done"]}


def _body(client, tokenizer, bias: float, seed: int, **extra) -> dict:
    markers = {str(tokenizer.token_to_id(m)): bias for m in ("<think>", "</think>")}
    return {"model": model_name(client), "input": "Why is the sky blue?",
            "max_output_tokens": 16, "temperature": 1.0, "seed": seed, "logit_bias": markers,
            **extra}


async def _whole_and_streamed(client, body: dict) -> tuple[dict, list[tuple[str, dict]]]:
    response = await client.post("/v1/responses", json=body)
    assert response.status == 200, await response.text()
    whole = await response.json()
    response = await client.post("/v1/responses", json={**body, "stream": True})
    assert response.status == 200
    return whole, _events(await response.text())


def _unnamed(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


def _kinds(events) -> list[str]:
    """The events' types, a run of deltas as one (the split into steps is the engine's)."""
    return [kind for kind, _ in itertools.groupby(k for k, _ in events)]


def _item_events(events, index: int) -> list[tuple[str, dict]]:
    return [(k, d) for k, d in events if d.get("output_index") == index]


def _adds_up(whole: dict, events: list[tuple[str, dict]]) -> None:
    """The stream is vLLM's event sequence for ``whole``'s items, and its deltas and its
    last event add up to ``whole``."""
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    expected = ["response.created", "response.in_progress"]
    for item in whole["output"]:
        opened = OPENED[item["type"]]
        expected += [k for k in opened if item["content"] or k not in DELTAS]
    assert _kinds(events) == [*expected, "response.completed"]
    final = events[-1][1]["response"]
    for index, item in enumerate(whole["output"]):
        mine = _item_events(events, index)
        added = mine[0][1]["item"]
        assert all(d.get("item_id", added["id"]) == added["id"] for _, d in mine)
        assert all(d.get("content_index", 0) == 0 for _, d in mine)
        assert mine[-1][1]["item"] == final["output"][index]
        assert final["output"][index]["id"] == added["id"]
        text = "".join(d["delta"] for k, d in mine if k in DELTAS)
        assert text == (item["content"][0]["text"] if item["content"] else "")
        if item["type"] == "reasoning":
            assert added == {"id": added["id"], "type": "reasoning", "summary": [],
                             "content": None, "encrypted_content": None,
                             "status": "in_progress"}
            assert mine[1][1]["part"] == {"type": "reasoning_text", "text": ""}
            assert mine[-3][1]["text"] == text
            assert mine[-2][1]["part"] == {"type": "reasoning_text", "text": text}
    assert _unnamed(final["output"]) == _unnamed(whole["output"])
    assert (final["status"], final["usage"]) == (whole["status"], whole["usage"])


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
async def test_the_reasoning_streams_as_its_own_item_then_the_message(
        aiohttp_client, llm, parser):  # noqa: F811
    client = await start_app(aiohttp_client, llm, reasoning_parser=parser)
    shapes = set()
    for bias, seed in CASES:
        # with logprobs: the reasoning's go out with the message's first text (whole, they
        # are the message's too)
        body = _body(client, llm.tokenizer, bias, seed, top_logprobs=1,
                     include=["message.output_text.logprobs"])
        whole, events = await _whole_and_streamed(client, body)
        _adds_up(whole, events)
        for item in whole["output"]:
            if item["type"] == "message":
                [part] = item["content"]
                assert len(part["logprobs"]) == whole["usage"]["output_tokens"]
        shapes.add(tuple(item["type"] for item in whole["output"]))
        if whole["output"][0]["type"] == "reasoning" and parser == "qwen3":
            assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    assert {("reasoning", "message"), ("reasoning",)} <= shapes
    if parser == "qwen3":
        assert ("message",) in shapes
    await stop_app(client)


async def test_include_reasoning_false_streams_no_reasoning_and_no_logprobs(
        aiohttp_client, llm):  # noqa: F811
    """vLLM drops the reasoning and, as their tokens would show it, the logprobs, whole and
    streamed; the reasoning tokens are still counted."""
    client = await start_app(aiohttp_client, llm, reasoning_parser="qwen3")
    extra = {"include_reasoning": False, "include": ["message.output_text.logprobs"],
             "top_logprobs": 2}
    counted = 0
    for bias, seed in CASES:
        body = _body(client, llm.tokenizer, bias, seed, **extra)
        whole, events = await _whole_and_streamed(client, body)
        [message] = whole["output"]
        assert message["type"] == "message"
        assert all(part["logprobs"] is None for part in message["content"])
        assert not any("reasoning" in kind for kind, _ in events)
        assert all(d["logprobs"] == [] for k, d in events if k == "response.output_text.delta")
        _adds_up(whole, events)
        counted += whole["usage"]["output_tokens_details"]["reasoning_tokens"]
    assert counted > 0
    await stop_app(client)


async def test_the_sdk_parses_the_stream_into_the_whole_answer(aiohttp_server, llm):  # noqa: F811
    """``client.responses.stream``: typed reasoning events, and a final response that is
    the events' sum and the whole answer's (but for the items' ids)."""
    from openai.types.responses import ResponseReasoningItem, ResponseReasoningTextDeltaEvent

    clients: list = []
    name, client = await start_sdk(aiohttp_server, llm, clients, reasoning_parser="qwen3")
    tok = llm.tokenizer
    body = {"model": name, "input": "Why is the sky blue?", "max_output_tokens": 16,
            "temperature": 1.0, "extra_body": {"seed": 0, "logit_bias": {
                str(tok.token_to_id(m)): 5 for m in ("<think>", "</think>")}}}
    whole = await client.responses.create(**body)
    async with client.responses.stream(**body) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    thought = "".join(e.delta for e in events if isinstance(e, ResponseReasoningTextDeltaEvent))
    [reasoning, message] = final.output
    assert isinstance(reasoning, ResponseReasoningItem) and thought and message.type == "message"
    assert reasoning.content[0].text == thought == whole.output[0].content[0].text
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text == whole.output_text and text
    # (None fields left out: the stream's text parts have the SDK's ``parsed: None``)
    streamed, answered = (r.model_dump(exclude={"id", "created_at"}, exclude_none=True)
                          for r in (final, whole))
    assert _unnamed(streamed.pop("output")) == _unnamed(answered.pop("output"))
    assert streamed == answered
    for sdk in clients:
        await sdk.close()


async def test_a_client_gone_mid_reasoning_releases_its_reservation(
        aiohttp_client, llm, monkeypatch):  # noqa: F811
    execute = llm.runner.execute

    def slow(batch):
        import time
        time.sleep(0.01)
        return execute(batch)

    monkeypatch.setattr(llm.runner, "execute", slow)
    client = await start_app(aiohttp_client, llm, reasoning_parser="deepseek_r1")
    aborted = await metric(client, "kvledger_requests_finished_total", 'finish_reason="abort"')
    body = _body(client, llm.tokenizer, -100, 0, max_output_tokens=300, ignore_eos=True,
                 stream=True)
    response = await client.post("/v1/responses", json=body)  # no </think>: all reasoning
    assert response.status == 200
    await asyncio.wait_for(response.content.readuntil(b"response.reasoning_text.delta"), 30)
    assert client.app[STATE].door.engine.ledger.reserved_blocks > 0
    response.connection.transport.abort()
    response.close()
    assert await wait_for_metric(client, "kvledger_kv_blocks_reserved", 0) == 0
    assert await metric(client, "kvledger_requests_finished_total",
                        'finish_reason="abort"') == aborted + 1
    await stop_app(client)
