"""--reasoning-parser over HTTP as a hostile client uses it: several choices streamed with
a stop string (whose possible start the engine holds back), a client that leaves while
the model reasons, and include_reasoning false beside logprobs and token ids."""

from __future__ import annotations

import asyncio
import json

from _server_helpers import start_app, stop_app
from test_reasoning_http import _body, llm, think_dir  # noqa: F401 (fixtures)


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def test_three_streamed_choices_add_up_to_the_whole(aiohttp_client, llm):  # noqa: F811
    client = await start_app(aiohttp_client, llm, reasoning_parser="qwen3")
    for seed in range(4):
        extra = {"n": 3, "stop": ["zzz"], "seed": seed}
        whole = await (await client.post("/v1/chat/completions",
                                          json={**_body(client, llm, seed), **extra})).json()
        events = _events(await (await client.post("/v1/chat/completions", json={
            **_body(client, llm, seed), **extra, "stream": True,
            "stream_options": {"include_usage": True}})).text())
        for choice in whole["choices"]:
            deltas = [e["choices"][0]["delta"] for e in events
                      if e["choices"] and e["choices"][0]["index"] == choice["index"]]
            assert ("".join(d.get("reasoning") or "" for d in deltas),
                    "".join(d.get("content") or "" for d in deltas)) == (
                choice["message"]["reasoning"] or "", choice["message"]["content"] or "")
        assert events[-1]["usage"]["completion_tokens_details"] == \
            whole["usage"]["completion_tokens_details"]
    await stop_app(client)


async def test_a_client_leaving_mid_reasoning_frees_its_blocks(aiohttp_client, llm):  # noqa: F811
    client = await start_app(aiohttp_client, llm, reasoning_parser="deepseek_r1")
    body = {**_body(client, llm, 0), "max_tokens": 400, "stream": True, "n": 3,
            "allowed_token_ids": llm.tokenizer.encode(" sky", add_special_tokens=False)}
    response = await client.post("/v1/chat/completions", json=body)
    await response.content.readline()
    response.close()  # all reasoning so far (no </think> allowed): the client leaves
    for _ in range(100):
        if llm.ledger.reserved_blocks == 0:
            break
        await asyncio.sleep(0.05)
    assert llm.ledger.reserved_blocks == 0
    await stop_app(client)


async def test_no_reasoning_sent_drops_its_logprobs_not_its_ids(aiohttp_client, llm):  # noqa: F811
    client = await start_app(aiohttp_client, llm, reasoning_parser="qwen3")
    extra = {"include_reasoning": False, "logprobs": True, "return_token_ids": True}
    whole = await (await client.post("/v1/chat/completions",
                                      json={**_body(client, llm, 1), **extra})).json()
    choice = whole["choices"][0]
    assert choice["message"]["reasoning"] is None and choice["logprobs"] is None
    events = _events(await (await client.post("/v1/chat/completions", json={
        **_body(client, llm, 1), **extra, "stream": True})).text())
    deltas = [e["choices"][0] for e in events if e["choices"]]
    assert not any(d["delta"].get("reasoning") for d in deltas)
    assert "".join(d["delta"].get("content") or "" for d in deltas) == \
        (choice["message"]["content"] or "")
    assert [i for d in deltas for i in d.get("token_ids") or []] == choice["token_ids"]
    await stop_app(client)
