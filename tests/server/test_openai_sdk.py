"""The official ``openai`` SDK as a real client against the server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest
from _server_helpers import fill_pool, make_llm, metric_value
from aiohttp import web

from kvledger.engine.server.app import build_app
from kvledger.engine.server.state import STATE, ServeOptions


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


@pytest.fixture
async def serve(aiohttp_server, llm):
    """Start a real HTTP server; ``seen`` records (arrival, status, headers) per completion."""
    clients = []

    async def start(**options):
        app = build_app(ServeOptions(**options))
        seen: list[tuple[float, int, dict]] = []

        @web.middleware
        async def record(request, handler):
            arrived = time.monotonic()
            response = await handler(request)
            if request.path.startswith("/v1/completions"):
                seen.append((arrived, response.status, dict(response.headers)))
            return response

        app.middlewares.insert(0, record)
        server = await aiohttp_server(app, host="127.0.0.1")
        await app[STATE].attach(llm)
        client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="key",
                                    max_retries=0)
        clients.append(client)
        return app, client, seen

    yield start
    for client in clients:
        await client.close()


async def test_sdk_completion_chat_and_streams(serve):
    app, client, _ = await serve(api_keys=("key",))
    name = app[STATE].model_name
    models = await client.models.list()
    assert [m.id for m in models.data] == [name]

    completion = await client.completions.create(model=name, prompt="Once upon", max_tokens=7,
                                                 temperature=0, extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 7

    chat = await client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5,
        extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 5

    stream = await client.completions.create(model=name, prompt="Once upon", max_tokens=7,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == completion.choices[0].text
    assert chunks[-1].usage.completion_tokens == 7

    stream = await client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        extra_body={"ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_sdk_sees_openai_errors(serve):
    app, client, _ = await serve(api_keys=("key",))
    name = app[STATE].model_name
    with pytest.raises(openai.NotFoundError) as info:
        await client.completions.create(model="nope", prompt="x")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=name, prompt="x", best_of=2)
    assert info.value.code == "invalid_request"
    bad_key = client.with_options(api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        await bad_key.completions.create(model=name, prompt="x")


async def test_sdk_retries_a_429_after_the_advertised_delay(serve):
    app, client, seen = await serve(max_queue_len=0)  # no line: a full pool is a 429 at once
    ledger = app[STATE].door.engine.ledger
    held = fill_pool(ledger)  # the pool is full

    async def release_after_first_refusal() -> None:
        while not seen:
            await asyncio.sleep(0.01)
        ledger.release(held)

    releaser = asyncio.create_task(release_after_first_refusal())
    completion = await client.with_options(max_retries=3).completions.create(
        model=app[STATE].model_name, prompt="hello", max_tokens=3,
        extra_body={"ignore_eos": True})
    await releaser
    assert completion.usage.completion_tokens == 3
    assert [status for _, status, _ in seen] == [429, 200]
    (first_at, _, headers), (retry_at, _, _) = seen
    advertised_s = int(headers["retry-after-ms"]) / 1000
    assert int(headers["Retry-After"]) >= 1
    assert retry_at - first_at >= advertised_s * 0.95  # the SDK waited as told
    assert ledger.reserved_blocks == 0


async def test_sdk_responses_whole_streamed_and_not_stored(serve):
    """``client.responses``: the SDK parses the answer (``output_text``), assembles the
    stream into the same response, and raises NotFoundError for a stored id (none is)."""
    app, client, _ = await serve(api_keys=("key",))
    name = app[STATE].model_name
    body = {"model": name, "input": "Once upon", "max_output_tokens": 6, "temperature": 0}
    whole = await client.responses.create(**body)
    assert whole.status == "incomplete" and whole.output_text
    assert whole.usage.output_tokens == 6
    async with client.responses.stream(**body) as stream:
        async for _ in stream:
            pass
        streamed = await stream.get_final_response()
    assert streamed.output_text == whole.output_text
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(whole.id)


async def test_sdk_raises_not_found_at_once_for_an_endpoint_not_served(serve):
    """/v1/embeddings: a 4xx as vLLM answers a route its model does not serve, which the
    SDK raises at once as NotFoundError naming what is missing (a 5xx it retried twice,
    1.3-1.5 s, then raised InternalServerError)."""
    app, quiet, _ = await serve()
    name = app[STATE].model_name
    client = openai.AsyncOpenAI(base_url=str(quiet.base_url), api_key="key")  # retries on
    assert client.max_retries == 2
    calls = [("/v1/embeddings", lambda: client.embeddings.create(model=name, input="hi"))]
    for path, call in calls:
        started = time.monotonic()
        with pytest.raises(openai.NotFoundError) as raised:
            await call()
        # No retries' back-off (two took 1.3-1.5 s; a loaded full suite took 0.51 s for
        # one request): the count of requests below is the exact check.
        assert time.monotonic() - started < 1.2, path
        assert f"kvledger does not serve {path}" in raised.value.message
        assert "/v1/chat/completions" in raised.value.message
    async with aiohttp.ClientSession() as http, http.get(
            str(client.base_url).removesuffix("v1/") + "metrics") as response:
        metrics = await response.text()
    assert metric_value(metrics, "kvledger_requests_rejected_total",
                        'reason="not_served"') == 1  # one request: none retried
    await client.close()
