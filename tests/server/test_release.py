"""Every reservation comes back: client disconnects (streaming, non-streaming, queued),
engine errors, a burst of concurrent requests, and shutdown."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from _server_helpers import fill_pool, make_llm, metric, model_name, start_app, wait_for_metric
from aiohttp import web

from kvledger.engine.server.app import build_app
from kvledger.engine.server.state import STATE, ServeOptions

RESERVED = "kvledger_kv_blocks_reserved"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


@pytest.fixture
def slow_steps(llm, monkeypatch):
    """Each engine step takes >= 10 ms, so a ~250-token answer runs for seconds."""
    execute = llm.runner.execute

    def slow(batch):
        time.sleep(0.01)
        return execute(batch)

    monkeypatch.setattr(llm.runner, "execute", slow)


def _long(client, stream: bool, **extra) -> dict:
    # max_tokens null: the cap is the rest of the context (~250 tokens, seconds on a CPU);
    # unset, a completion's is 16, as vLLM's.
    return {"model": model_name(client), "prompt": "Tell me a long story", "stream": stream,
            "ignore_eos": True, "max_tokens": None, **extra}


async def test_disconnect_mid_stream_aborts_and_releases(aiohttp_client, llm, slow_steps):
    client = await start_app(aiohttp_client, llm)
    response = await client.post("/v1/completions", json=_long(client, True))
    assert response.status == 200
    await response.content.readuntil(b"\n\n")  # the first chunk: it is running
    assert await metric(client, RESERVED) > 0
    response.connection.transport.abort()  # the client vanishes without a goodbye
    response.close()
    assert await wait_for_metric(client, RESERVED, 0) == 0
    assert await wait_for_metric(client, "kvledger_kv_blocks_used", 0) == 0
    assert await metric(client, "kvledger_requests_finished_total", 'finish_reason="abort"') == 1


async def test_disconnect_before_the_stream_headers_is_quiet_and_releases(aiohttp_client, llm,
                                                                         caplog, monkeypatch):
    seen = []

    @web.middleware
    async def remember(request, handler):
        seen.append(request)
        return await handler(request)

    app = build_app(ServeOptions())
    app.middlewares.append(remember)
    client = await aiohttp_client(app)
    await app[STATE].attach(llm)
    tokenizer = client.app[STATE].door.engine.tokenizer
    encode = tokenizer.encode

    def encode_then_hang_up(*args, **kwargs):  # the client vanishes while we tokenize
        seen[-1].transport.abort()
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode_then_hang_up)
    with pytest.raises(aiohttp.ClientError):
        await client.post("/v1/completions", json=_long(client, True))
    monkeypatch.undo()
    assert await wait_for_metric(client, RESERVED, 0) == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_disconnect_while_waiting_for_a_whole_answer_releases(aiohttp_client, llm,
                                                                     slow_steps):
    client = await start_app(aiohttp_client, llm)
    with pytest.raises(asyncio.TimeoutError):
        await client.post("/v1/completions", json=_long(client, False),
                          timeout=aiohttp.ClientTimeout(total=0.5))
    assert await wait_for_metric(client, RESERVED, 0) == 0
    assert await metric(client, "kvledger_requests_finished_total", 'finish_reason="abort"') == 1


async def test_disconnect_while_queued_for_blocks_leaks_nothing(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, max_queue_wait_s=30.0)
    ledger = client.app[STATE].door.engine.ledger
    held = fill_pool(ledger)  # the pool is full
    try:
        with pytest.raises(asyncio.TimeoutError):
            await client.post("/v1/completions", json=_long(client, False, max_tokens=4),
                              timeout=aiohttp.ClientTimeout(total=0.3))
        assert await wait_for_metric(client, "kvledger_queue_length", 0) == 0
    finally:
        ledger.release(held)
    assert await metric(client, RESERVED) == 0
    # the queue still works after the departure
    response = await client.post("/v1/completions", json=_long(client, False, max_tokens=2))
    assert response.status == 200


async def test_burst_of_concurrent_requests_gets_200s_and_429s_and_returns_every_block(
        aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, max_queue_len=0)  # the 429s at once
    name = model_name(client)
    bodies = [{"model": name, "prompt": "word " * (1 + i % 5), "ignore_eos": True,
               "max_tokens": None if i % 3 == 0 else 4 + i % 7, "stream": i % 2 == 0}
              for i in range(24)]

    async def send(body):
        response = await client.post("/v1/completions", json=body)
        await response.read()
        return response

    responses = await asyncio.gather(*(send(b) for b in bodies))
    statuses = [r.status for r in responses]
    assert set(statuses) == {200, 429}, statuses
    for r in responses:
        if r.status == 429:
            assert int(r.headers["Retry-After"]) >= 1 and int(r.headers["retry-after-ms"]) >= 1
    assert await wait_for_metric(client, RESERVED, 0) == 0
    assert await metric(client, "kvledger_requests_admitted_total") == statuses.count(200)
    assert await metric(client, "kvledger_requests_rejected_total",
                        'reason="kv_cache_full"') == statuses.count(429)


async def test_an_engine_that_keeps_failing_answers_503_and_releases(aiohttp_client,
                                                                    tiny_llama_dir):
    """One failed forward pass fails its requests (500); only repeated failures in a row
    (MAX_CONSECUTIVE_FAILED_STEPS) kill the engine: 503 engine_dead, /health 503."""
    from kvledger.engine.core.engine import MAX_CONSECUTIVE_FAILED_STEPS

    llm = make_llm(tiny_llama_dir)  # this engine is broken on purpose: not shared
    client = await start_app(aiohttp_client, llm)
    original = llm.runner.execute
    calls = 0

    def failing(batch):
        nonlocal calls
        calls += 1
        if calls > 3:
            raise RuntimeError("device fell off the bus")
        return original(batch)

    llm.runner.execute = failing
    streamed, whole = await asyncio.gather(
        client.post("/v1/completions", json=_long(client, True)),
        client.post("/v1/completions", json=_long(client, False)))
    assert whole.status == 500
    assert (await whole.json())["error"]["code"] == "request_error"
    assert b'"request_error"' in await streamed.read()
    assert (await client.get("/health")).status == 200  # one failed step is not the end
    for _ in range(MAX_CONSECUTIVE_FAILED_STEPS - 1):
        await client.post("/v1/completions", json=_long(client, False))
    assert await metric(client, RESERVED) == 0
    assert (await client.get("/health")).status == 503
    answer = await client.post("/v1/completions", json=_long(client, False))
    assert answer.status == 503 and (await answer.json())["error"]["code"] == "engine_dead"


async def test_a_drain_within_the_grace_lets_in_flight_requests_finish(aiohttp_client, llm,
                                                                      slow_steps):
    """What a scale-down does to a pod (SIGTERM -> drain): requests already running end
    normally, with every token they asked for, while new ones are refused."""
    client = await start_app(aiohttp_client, llm, shutdown_grace_s=30.0)
    state = client.app[STATE]
    streamed = await client.post("/v1/completions", json=_long(client, True, max_tokens=40))
    await streamed.content.readuntil(b"\n\n")  # running
    whole = asyncio.create_task(client.post("/v1/completions",
                                            json=_long(client, False, max_tokens=40)))
    while state.door is None or state.door.running < 2:
        await asyncio.sleep(0.01)
    drain = asyncio.create_task(state.drain())
    await asyncio.sleep(0.05)
    refused = await client.post("/v1/completions", json=_long(client, False, max_tokens=2))
    assert refused.status == 503 and (await client.get("/ready")).status == 503
    body = await streamed.read()
    assert b'"finish_reason":"length"' in body and body.endswith(b"data: [DONE]\n\n")
    answer = await (await whole).json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 40
    await drain
    assert await metric(client, RESERVED) == 0


async def test_shutdown_refuses_new_requests_and_aborts_after_the_grace(aiohttp_client, llm,
                                                                       slow_steps):
    client = await start_app(aiohttp_client, llm, shutdown_grace_s=0.3)
    state = client.app[STATE]
    response = await client.post("/v1/completions", json=_long(client, True))
    await response.content.readuntil(b"\n\n")
    drain = asyncio.create_task(state.drain())
    await asyncio.sleep(0.05)
    refused = await client.post("/v1/completions", json=_long(client, False, max_tokens=2))
    assert refused.status == 503
    assert (await refused.json())["error"]["code"] == "shutting_down"
    assert (await client.get("/ready")).status == 503
    body = await response.read()  # the in-flight stream is ended, not cut off
    assert b'"finish_reason":"abort"' in body and body.endswith(b"data: [DONE]\n\n")
    await drain
    assert await metric(client, RESERVED) == 0
