"""vLLM's serve flags that change what the API answers, as a client sees them:
--enable-force-include-usage, --enable-request-id-headers,
--exclude-tools-when-tool-choice-none, --enable-server-load-tracking (``/load``) and
--enable-tokenizer-info-endpoint (``/tokenizer_info``), --stream-interval and
--sse-keep-alive-interval; and without each, the answer as before."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from _server_helpers import make_llm, model_name, start_app, stop_app

KEY, METRICS_KEY = "s3cret", "m3trics"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_model_len=512, num_gpu_blocks_override=64)


def _events(raw: bytes) -> list[dict]:
    lines = [line for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


async def _streamed(client, path: str, **body) -> list[dict]:
    body = {"model": model_name(client), "max_tokens": 3, "stream": True, **body}
    if path == "/v1/completions":
        body.setdefault("prompt", "Once upon a time")
    else:
        body.setdefault("messages", MESSAGES)
    response = await client.post(path, json=body)
    assert response.status == 200, await response.text()
    return _events(await response.read())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_forced_usage_is_on_every_chunk_and_in_a_last_one(aiohttp_client, llm, path):
    client = await start_app(aiohttp_client, llm, enable_force_include_usage=True)
    # as vLLM's: forced whatever stream_options ask
    for options in ({}, {"stream_options": {"include_usage": False}}):
        events = await _streamed(client, path, **options)
        assert all("usage" in event for event in events)
        last = events[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
        assert last["usage"]["total_tokens"] == (last["usage"]["prompt_tokens"] + 3)
    # a stream_options without a stream is still refused (vLLM's rule, before the flag)
    body = {"model": model_name(client), "max_tokens": 2, "stream_options": {}}
    body.update({"prompt": "Once"} if path == "/v1/completions" else {"messages": MESSAGES})
    assert (await client.post(path, json=body)).status == 400


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_without_forced_usage_a_stream_has_none_unless_asked(aiohttp_client, llm, path):
    client = await start_app(aiohttp_client, llm)
    assert not any("usage" in event for event in await _streamed(client, path))
    asked = await _streamed(client, path, stream_options={"include_usage": True})
    assert [("usage" in event) for event in asked][-1] and "usage" not in asked[0]


async def test_request_id_headers_echo_or_name_every_response(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, enable_request_id_headers=True,
                             api_keys=(KEY,))
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": model_name(client), "prompt": "Once", "max_tokens": 1}
    answer = await client.post("/v1/completions", json=body,
                               headers={**auth, "X-Request-Id": "trace-42"})
    assert answer.status == 200 and answer.headers["X-Request-Id"] == "trace-42"
    assert (await answer.json())["id"] == "cmpl-trace-42"
    stream = await client.post("/v1/completions", json={**body, "stream": True},
                               headers={**auth, "X-Request-Id": "trace-43"})
    assert stream.headers["X-Request-Id"] == "trace-43"
    await stream.read()
    # without one, a new id each time; errors and the probes too, as vLLM's middleware
    seen = set()
    for method, path, headers in (("GET", "/health", {}), ("GET", "/health", {}),
                                  ("POST", "/v1/completions", {}),  # 401: no key
                                  ("GET", "/no/such/path", {}),
                                  ("POST", "/v1/completions", auth)):  # 400: no body
        response = await client.request(method, path, headers=headers)
        assert re.fullmatch("[0-9a-f]{32}", response.headers["X-Request-Id"]), response.status
        seen.add(response.headers["X-Request-Id"])
    assert len(seen) == 5


async def test_a_request_id_that_is_not_utf8_gets_a_new_one(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, enable_request_id_headers=True)
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: \xff\xfeid\r\n"
                 b"Connection: close\r\n\r\n")
    head = (await reader.read()).split(b"\r\n\r\n")[0].decode("latin-1")
    writer.close()
    assert head.startswith("HTTP/1.1 200")
    assert re.search(r"(?im)^X-Request-Id: [0-9a-f]{32}$", head)


async def test_without_request_id_headers_responses_carry_none(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    response = await client.get("/health", headers={"X-Request-Id": "trace-42"})
    assert "X-Request-Id" not in response.headers


async def _prompt_tokens(client, path: str = "/v1/chat/completions", **body) -> int:
    body = {"model": model_name(client), "max_tokens": 1, **body}
    if path == "/v1/responses":
        body = {"model": model_name(client), "max_output_tokens": 1,
                "input": MESSAGES[0]["content"],
                **{key: value for key, value in body.items() if key == "tool_choice"},
                **({"tools": [{"type": "function", **TOOLS[0]["function"]}]}
                   if "tools" in body else {})}
    response = await client.post(path, json=body)
    assert response.status == 200, await response.text()
    usage = (await response.json())["usage"]
    return usage["input_tokens" if path == "/v1/responses" else "prompt_tokens"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
async def test_tool_choice_none_renders_without_the_tools(aiohttp_client, llm, path):
    client = await start_app(aiohttp_client, llm, exclude_tools_when_tool_choice_none=True)
    bare = await _prompt_tokens(client, path, messages=MESSAGES)
    assert await _prompt_tokens(client, path, messages=MESSAGES, tools=TOOLS,
                                tool_choice="none") == bare


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
async def test_without_the_flag_tool_choice_none_still_shows_the_tools(aiohttp_client, llm,
                                                                      path):
    client = await start_app(aiohttp_client, llm)
    bare = await _prompt_tokens(client, path, messages=MESSAGES)
    assert await _prompt_tokens(client, path, messages=MESSAGES, tools=TOOLS,
                                tool_choice="none") > bare


async def _load_while_streaming(client, headers=None) -> tuple[int, int]:
    """``/load``'s count while a chat streams (its first event read), and after it ended."""
    body = {"model": model_name(client), "messages": MESSAGES, "max_tokens": 40,
            "min_tokens": 40, "stream": True}
    response = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status == 200
    await response.content.readline()
    during = await (await client.get("/load", headers=headers)).json()
    await response.read()
    after = await (await client.get("/load", headers=headers)).json()
    return during["server_load"], after["server_load"]


async def test_server_load_counts_the_requests_in_flight(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, enable_server_load_tracking=True,
                             api_keys=(KEY,))
    # as vLLM's: no API key asked (a router polls it); the count is every tenant's, one number
    assert await _load_while_streaming(client, {"Authorization": f"Bearer {KEY}"}) == (1, 0)
    refused = await client.post("/v1/completions", json={"prompt": 1},
                                headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status == 400
    assert await (await client.get("/load")).json() == {"server_load": 0}


async def test_without_tracking_load_stays_zero(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    assert await _load_while_streaming(client) == (0, 0)


async def test_the_metrics_key_guards_load_once_given(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, enable_server_load_tracking=True,
                             api_keys=(KEY,), metrics_api_key=METRICS_KEY)
    assert (await client.get("/load")).status == 401
    assert (await client.get("/load", headers={"Authorization": f"Bearer {KEY}"})).status == 401
    response = await client.get("/load", headers={"Authorization": f"Bearer {METRICS_KEY}"})
    assert response.status == 200 and await response.json() == {"server_load": 0}


async def test_tokenizer_info_behind_the_api_key(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, enable_tokenizer_info_endpoint=True,
                             api_keys=(KEY,))
    assert (await client.get("/tokenizer_info")).status == 401
    response = await client.get("/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status == 200
    info = await response.json()
    config = llm.tokenizer.tokenizer_config
    assert info["chat_template"] == llm.tokenizer.chat_template
    assert info["bos_token"] == "<s>" and info["eos_token"] == "</s>"
    assert info["tokenizer_class"] == config.get("tokenizer_class", "PreTrainedTokenizerFast")
    assert info["model_max_length"] == config["model_max_length"]
    await stop_app(client)  # one app drives the engine at a time
    open_client = await start_app(aiohttp_client, llm, enable_tokenizer_info_endpoint=True)
    assert (await open_client.get("/tokenizer_info")).status == 200  # no key: none asked


async def test_without_the_flag_tokenizer_info_is_not_served(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    response = await client.get("/tokenizer_info")
    assert response.status == 404


def test_tokenizer_info_reads_added_tokens_as_their_text():
    from kvledger.engine.server.tokenizer_info import tokenizer_info

    config = {"vocab_file": "/models/x/vocab.json", "merges_file": "merges.txt",
              "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
              "added_tokens_decoder": {"0": {"content": "<unk>", "special": True,
                                             "lstrip": False}},
              "add_bos_token": True, "chat_template": "{{ old }}"}
    info = tokenizer_info(config, "{{ served }}")
    assert info == {"bos_token": "<s>", "added_tokens_decoder": {"0": "<unk>"},
                    "add_bos_token": True, "chat_template": "{{ served }}",
                    "tokenizer_class": "PreTrainedTokenizerFast"}


async def _token_chunks(client, path: str = "/v1/completions", **body) -> list[int]:
    """How many token ids each chunk of a 7-token greedy stream carries (those with any; a
    token that writes no text rides with the next chunk's)."""
    events = await _streamed(client, path, max_tokens=7, min_tokens=7, temperature=0,
                             return_token_ids=True, **body)
    return [len(ids) for event in events for choice in event["choices"]
            if (ids := choice.get("token_ids"))]


def _paced(sizes: list[int], interval: int, tokens: int = 7) -> bool:
    """Whether a stream's chunk sizes are ``interval``'s: every token sent once, each chunk
    between the first and the last ``interval`` tokens or more, so at most
    ``2 + (tokens - 1) // interval`` chunks."""
    return (sum(sizes) == tokens and all(size >= interval for size in sizes[1:-1])
            and len(sizes) <= 2 + (tokens - 1) // interval)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stream_interval_sends_every_n_tokens(aiohttp_client, llm, path):
    client = await start_app(aiohttp_client, llm, stream_interval=3)
    assert _paced(await _token_chunks(client, path), 3)
    # a request's own interval raises the server's, never lowers it
    assert _paced(await _token_chunks(client, path, stream_interval=2), 3)
    assert _paced(await _token_chunks(client, path, stream_interval=6), 6)


async def test_stream_interval_paces_a_responses_stream(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, stream_interval=4)
    response = await client.post("/v1/responses", json={
        "model": model_name(client), "input": "Once upon a time", "max_output_tokens": 9,
        "stream": True, "temperature": 0})
    events = [json.loads(line.removeprefix("data: ")) for line in
              (await response.text()).split("\n") if line.startswith("data: ")]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    completed = next(e for e in events if e["type"] == "response.completed")
    assert completed["response"]["usage"]["output_tokens"] == 9
    assert 1 <= len(deltas) <= 2 + (9 - 1) // 4
    assert "".join(deltas) == completed["response"]["output"][-1]["content"][0]["text"]


async def test_without_stream_interval_every_token_is_sent(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    sizes = await _token_chunks(client)
    assert sum(sizes) == 7 and not _paced(sizes, 3)  # more chunks than 3's pace allows


@pytest.mark.parametrize(("path", "interval", "comments"), [
    ("/v1/completions", 0.03, True), ("/v1/chat/completions", 0.03, True),
    ("/v1/chat/completions", 0, False)])
async def test_keep_alive_comments_while_a_stream_is_idle(aiohttp_client, llm, monkeypatch, path,
                                                          interval, comments):
    """--sse-keep-alive-interval: steps of 0.15 s leave the stream idle; a comment goes out
    every interval meanwhile (none without the flag), and the events read the same."""
    runner = llm.runner  # make_llm's engine
    execute = runner.execute

    def slow(batch):
        time.sleep(0.15)
        return execute(batch)

    monkeypatch.setattr(runner, "execute", slow)
    client = await start_app(aiohttp_client, llm, sse_keep_alive_interval_s=interval)
    body = {"model": model_name(client), "max_tokens": 3, "stream": True, "temperature": 0}
    body.update({"prompt": "Once upon a time"} if path == "/v1/completions" else
                {"messages": MESSAGES})
    response = await client.post(path, json=body)
    raw = await response.read()
    assert (raw.count(b": keep-alive\n\n") >= 3) is comments
    events = _events(raw)  # an SSE reader skips the comments
    assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_keep_alive_reads_each_output_once_and_ends_its_pending_read():
    """The wrapper hands over every item in order, a comment per idle interval, and a
    stream that ends early cancels the read it left pending."""
    from kvledger.engine.server.keep_alive import KEEP_ALIVE, kept_alive

    written: list[bytes] = []
    cancelled = asyncio.Event()

    async def outputs():
        for item in range(3):
            await asyncio.sleep(0.12)
            yield item
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def write(data: bytes) -> None:
        written.append(data)

    items = kept_alive(outputs(), 0.05, write)
    got = [await anext(items) for _ in range(3)]
    assert got == [0, 1, 2] and len(written) >= 4 and set(written) == {KEEP_ALIVE}
    waiting = asyncio.ensure_future(anext(items))  # the 4th never comes
    await asyncio.sleep(0.1)
    waiting.cancel()  # the stream ends early (its client left)
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await items.aclose()
    await asyncio.wait_for(cancelled.wait(), 1)  # the read it left pending was ended
