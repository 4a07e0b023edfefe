"""Hostile requests: each is refused with a 4xx naming its limit, never a 500, and the
event loop keeps answering ``/health`` while it runs; slow clients are cut off; failures
are counted.

"The loop keeps answering" is measured so that a busy machine cannot fake a failure: the
CPU time the loop's thread spends between two ``/health`` answers (what a stall costs,
however slowly the machine runs it), and, while each heavy piece of the request's work
runs off the loop, ``/health`` answers arriving all along it (a stretch without one is
compared with the work's own duration, not with a fixed number of milliseconds)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from _guard_helpers import POLL_INTERVAL_S, error_of, read_response, request_bytes, serving
from _server_helpers import make_llm, metric, model_name, start_app, wait_for_metric

from kvledger.engine.cli import main
from kvledger.engine.core.async_engine import EngineDeadError
from kvledger.engine.model.template_bounds import RENDER_SECONDS
from kvledger.engine.server import limits, openai_api
from kvledger.engine.server.state import STATE

# The CPU time the event loop may spend between two /health answers, and the CPU time
# past which a piece of a request's work must run off the loop with /health answered
# all along it.
HEALTH_BUDGET_S = 0.1
CORPUS = Path(__file__).resolve().parents[2] / "engine" / "model" / "data" / "corpus.txt"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


def _words(n_chars: int) -> str:
    """Varied text (the tokenizer's cache does not shortcut it), ``n_chars`` long."""
    words, rng = CORPUS.read_text().split(), random.Random(0)
    return " ".join(rng.choice(words) for _ in range(n_chars // 3))[:n_chars]


@dataclass(frozen=True)
class _Run:
    """One piece of a request's work the server handed to ``off_loop``."""

    name: str
    started: float  # time.perf_counter()
    ended: float
    cpu_s: float    # the CPU time of the thread that ran it
    on_loop: bool   # it ran on the event loop's thread

    def answers_during(self, answers: list[float]) -> list[float]:
        return [at for at in answers if self.started < at < self.ended]

    def longest_silence_s(self, answers: list[float]) -> float:
        """The longest stretch of this run during which no /health answer arrived."""
        times = [self.started, *self.answers_during(answers), self.ended]
        return max(b - a for a, b in itertools.pairwise(times))


@dataclass
class _Polled:
    result: object = None
    answers: list[float] = field(default_factory=list)  # perf_counter of each /health answer
    slowest_loop_cpu_s: float = 0.0  # the most CPU the loop spent between two answers
    runs: list[_Run] = field(default_factory=list)

    def failure(self) -> str | None:
        """Why the loop was not kept answering, or None."""
        if not self.answers:
            return "/health never answered"
        if self.slowest_loop_cpu_s >= HEALTH_BUDGET_S:
            return (f"the event loop spent {self.slowest_loop_cpu_s * 1000:.0f} ms of CPU "
                    "between two /health answers")
        for run in self.runs:
            if run.cpu_s < HEALTH_BUDGET_S:
                continue  # too little work to hold the loop up for long, wherever it ran
            if run.on_loop:
                return f"{run.name} ran on the event loop for {run.cpu_s * 1000:.0f} ms of CPU"
            silence, duration = run.longest_silence_s(self.answers), run.ended - run.started
            if silence >= duration / 4:
                return (f"/health did not answer for {silence * 1000:.0f} ms of the "
                        f"{duration * 1000:.0f} ms {run.name} ran off the loop")
        return None

    def heaviest(self) -> _Run:
        return max(self.runs, key=lambda run: run.cpu_s)


async def _while_polling(get, work, state=None) -> _Polled:
    """Await ``work`` while ``get("/health")`` is polled, timing what the server's
    preparing threads (``state.offload``, the server's and the engine door's) run for it
    (given the server's state)."""
    polled = _Polled()
    loop_thread = threading.get_ident()
    off_loop = state.offload.run if state is not None else None

    async def timed_off_loop(body_bytes, fn, *args):
        def timed(*fn_args):
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*fn_args)
            finally:
                polled.runs.append(_Run(getattr(fn, "__name__", repr(fn)), started,
                                        time.perf_counter(), time.thread_time() - cpu,
                                        threading.get_ident() == loop_thread))
        return await off_loop(body_bytes, timed, *args)

    done = asyncio.Event()

    async def poll() -> None:
        cpu = time.thread_time()  # this thread's: the event loop's
        while True:
            last = done.is_set()  # one more answer after the work: a stall at its end counts
            async with get("/health") as response:
                assert response.status == 200
                await response.read()
            polled.answers.append(time.perf_counter())
            now = time.thread_time()
            polled.slowest_loop_cpu_s = max(polled.slowest_loop_cpu_s, now - cpu)
            cpu = now
            if last:
                return
            await asyncio.sleep(POLL_INTERVAL_S)

    if state is not None:
        state.offload.run = timed_off_loop  # this instance only, until the work is done
    poller = asyncio.create_task(poll())
    await asyncio.sleep(0.02)  # the first poll is out before the work starts
    try:
        polled.result = await work
    finally:
        done.set()
        await poller
        if state is not None:
            del state.offload.run
    return polled


async def _hostile_polled(client, path: str, body: bytes, headers: dict | None = None):
    """POST ``body`` while /health is polled; (status, error or answer, what was polled)."""
    async def post():
        response = await client.post(path, data=body, headers={
            "Content-Type": "application/json", **(headers or {})})
        return response.status, await response.read()

    # A stall the server causes happens on every try; a pause of this shared machine (other
    # processes, a garbage collection of the test process's heap) happens once: one retry.
    for _ in range(2):
        polled = await _while_polling(client.get, post(), client.app[STATE])
        if (failure := polled.failure()) is None:
            break
    assert failure is None, failure
    status, raw = polled.result
    assert b"Traceback" not in raw
    return status, (error_of(raw) if status >= 400 else json.loads(raw)), polled


async def _hostile(client, path: str, body: bytes, headers: dict | None = None):
    """POST ``body`` while /health is polled; (status, error or answer)."""
    status, answer, _ = await _hostile_polled(client, path, body, headers)
    return status, answer


def _with_model(client, template: bytes) -> bytes:
    return template.replace(b"MODEL", json.dumps(model_name(client)).encode())


# -- 1. nesting --------------------------------------------------------------------------
@pytest.mark.parametrize("nested", [
    b"[" * 2000 + b"]" * 2000,
    b"[" * 900 + b'"\\ud83d\\ude00"' + b"]" * 900,  # deep enough for the surrogate check
    b"[" * 65 + b"1" + b"]" * 65,
    b'{"a": ' * 65 + b"1" + b"}" * 65,
])
async def test_json_nested_past_the_limit_is_400_without_a_traceback(aiohttp_client, llm,
                                                                       caplog, nested):
    client = await start_app(aiohttp_client, llm)
    body = _with_model(client, b'{"model": MODEL, "prompt": "x", "user": ' + nested + b"}")
    with caplog.at_level(logging.INFO):
        status, error = await _hostile(client, "/v1/completions", body)
    assert status == 400 and error["code"] == "invalid_json"
    assert f"deeper than {limits.MAX_JSON_DEPTH} levels" in error["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_nesting_within_the_limit_and_brackets_in_strings_are_parsed(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    levels = limits.MAX_JSON_DEPTH - 1  # inside the body's own object
    deep = b"[" * levels + b"1" + b"]" * levels
    body = b'{"model": MODEL, "prompt": "x", "max_tokens": 1, "user": ' + deep + b"}"
    response = await client.post("/v1/completions", data=_with_model(client, body))
    assert response.status == 400  # parsed, then refused as a 'user' that is not a string
    assert (await response.json())["error"]["param"] == "user"
    brackets = json.dumps("[{" * 5000 + '\\"[[').encode()  # and an escaped quote
    body = b'{"model": MODEL, "prompt": "x", "max_tokens": 1, "user": ' + brackets + b"}"
    assert (await client.post("/v1/completions", data=_with_model(client, body))).status == 200


async def test_too_many_json_items_is_400_naming_the_limit(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    many = json.dumps([{"role": "user", "content": "hi"}] * 100_000).encode()
    body = _with_model(client, b'{"model": MODEL, "messages": ' + many + b"}")
    status, error = await _hostile(client, "/v1/chat/completions", body)
    assert status == 400 and str(limits.MAX_JSON_ITEMS) in error["message"]


# -- 2. huge numbers ---------------------------------------------------------------------
HUGE = b"1" + b"0" * 400


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "temperature", HUGE),
    ("/v1/completions", "top_p", HUGE),
    ("/v1/completions", "temperature", b"-" + HUGE),
    ("/v1/completions", "top_k", HUGE),
    ("/v1/completions", "max_tokens", HUGE),
    ("/v1/chat/completions", "max_completion_tokens", HUGE),
    ("/v1/completions", "seed", HUGE),
    ("/v1/completions", "n", HUGE),
    ("/v1/completions", "presence_penalty", HUGE),
    ("/v1/completions", "stop_token_ids[0]", b"[" + HUGE + b"]"),
    ("/v1/completions", "prompt", b"[" + HUGE + b"]"),
    ("/v1/completions", "temperature", b"1e400"),
])
async def test_huge_numbers_are_400_naming_the_field(aiohttp_client, llm, path, field, value):
    client = await start_app(aiohttp_client, llm)
    fields = b'"messages": [{"role": "user", "content": "hi"}]' if "chat" in path \
        else b'"prompt": "hi"'
    name = field.split("[")[0].encode()
    body = b'{"model": MODEL, ' + fields + b', "' + name + b'": ' + value + b"}"
    if field == "prompt":
        body = b'{"model": MODEL, "prompt": ' + value + b"}"
    status, error = await _hostile(client, path, _with_model(client, body))
    assert status == 400 and error["param"] == field
    assert len(error["message"]) < 200


# -- 3. Authorization bytes --------------------------------------------------------------
@pytest.mark.parametrize("authorization, status", [
    (b"Bearer \xc3\xa9\xff\xfe", 401),
    (b"Bearer \xff", 401),
    (b"\xff\xfe key", 401),
    ("Bearer clé".encode(), 200),
])
async def test_authorization_bytes_are_compared_never_decoded(aiohttp_client, llm,
                                                              authorization, status):
    client = await start_app(aiohttp_client, llm, api_keys=("clé",))
    body = _with_model(client, b'{"model": MODEL, "prompt": "hi", "max_tokens": 1}')
    reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
    try:
        writer.write(request_bytes("POST", "/v1/completions", body, Authorization=authorization))
        got, _, raw = await read_response(reader)
    finally:
        writer.close()
    assert got == status
    if status == 401:
        assert error_of(raw)["code"] == "invalid_api_key"


# -- 4. tokenizing and templates off the loop --------------------------------------------
def _answered_all_along(polled: _Polled) -> None:
    """The request's heaviest work (tokenizing megabytes: more CPU than the budget, however
    fast the machine) ran off the loop, and /health answered while it ran."""
    heaviest = polled.heaviest()
    assert heaviest.cpu_s >= HEALTH_BUDGET_S and not heaviest.on_loop, polled.runs
    # Blocked, the loop could have answered none while it ran (the client shares the loop).
    assert len(heaviest.answers_during(polled.answers)) >= 2, (heaviest, polled.answers)


async def test_a_huge_prompt_is_tokenized_off_the_event_loop(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    body = json.dumps({"model": model_name(client), "prompt": _words(3_900_000)}).encode()
    status, error, polled = await _hostile_polled(client, "/v1/completions", body)
    assert status == 400 and error["code"] == "context_length_exceeded"
    _answered_all_along(polled)


async def test_a_huge_chat_message_is_rendered_off_the_event_loop(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    body = json.dumps({"model": model_name(client),
                       "messages": [{"role": "user", "content": _words(3_500_000)}]}).encode()
    status, error, polled = await _hostile_polled(client, "/v1/chat/completions", body)
    assert status == 400 and error["code"] == "context_length_exceeded"
    _answered_all_along(polled)


async def test_more_messages_than_the_limit_is_400(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    messages = [{"role": "user", "content": "hi"}]
    for count, too_many in ((limits.MAX_MESSAGES + 1, True), (limits.MAX_MESSAGES, False)):
        body = json.dumps({"model": model_name(client), "messages": messages * count}).encode()
        got, error = await _hostile(client, "/v1/chat/completions", body)
        assert got == 400
        if too_many:
            assert error["param"] == "messages" and str(limits.MAX_MESSAGES) in error["message"]
        else:  # at the limit it renders, and is too long for the context
            assert error["code"] == "context_length_exceeded"


# A request's own template (--trust-request-chat-template) as an attacker writes it: before,
# the loops held the event loop 10.5 s and the repeat took 26 s and 1.6 GB.
TEMPLATE_BOMBS = {
    "loops": "{% for i in range(100000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}hi",
    "repeat": "{{ 'x' * 50000000 }}",
    "power": "{{ 7 ** 10000000 }}",
    "long": "{% for i in range(100000) %}{{ 'abcdefghij' * 100 }}{% endfor %}",
}


@pytest.mark.parametrize("name", TEMPLATE_BOMBS)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
async def test_a_requests_own_template_is_bounded_and_off_the_loop(aiohttp_client, llm, name,
                                                                  path):
    client = await start_app(aiohttp_client, llm, trust_request_chat_template=True)
    body = json.dumps({"model": model_name(client), "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}],
                       "chat_template": TEMPLATE_BOMBS[name]}).encode()
    if path == "/tokenize":
        body = json.dumps({**json.loads(body), "max_tokens": None}).encode()
        body = body.replace(b', "max_tokens": null', b"")
    started = time.perf_counter()
    status, error = await _hostile(client, path, body)
    assert status == 400 and error["param"] == "chat_template", error
    assert time.perf_counter() - started < 2 * RENDER_SECONDS + 3  # _hostile may try twice


async def test_tokenize_counts_messages_and_builds_its_answer_off_the_loop(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    messages = [{"role": "user", "content": "hi"}] * (limits.MAX_MESSAGES + 1)
    got, error = await _hostile(client, "/tokenize", json.dumps({"messages": messages}).encode())
    assert got == 400 and str(limits.MAX_MESSAGES) in error["message"]  # was served
    body = json.dumps({"prompt": _words(2_000_000), "return_token_strs": True}).encode()
    status, answer, polled = await _hostile_polled(client, "/tokenize", body)
    assert status == 200 and len(answer["token_strs"]) == answer["count"] > 100_000
    _answered_all_along(polled)


async def test_an_answer_of_logprobs_is_built_off_the_loop(aiohttp_client, tiny_llama_dir):
    """Echoed prompt logprobs, 20 a position, for 16 choices: megabytes of JSON, built off
    the loop (before, /health waited 0.4-0.95 s on it)."""
    llm = make_llm(tiny_llama_dir, max_model_len=1024, num_gpu_blocks_override=1100,
                   max_num_seqs=16)
    client = await start_app(aiohttp_client, llm)
    body = json.dumps({"model": model_name(client), "prompt": _words(4000)[:2600],
                       "echo": True, "max_tokens": 0, "logprobs": 20, "n": 16}).encode()
    status, answer, _ = await _hostile_polled(client, "/v1/completions", body)
    assert status == 200 and len(answer["choices"]) == 16
    assert len(answer["choices"][0]["logprobs"]["top_logprobs"]) > 500


async def test_a_client_gone_while_its_prompt_is_tokenized_reserves_nothing(aiohttp_client, llm,
                                                                            monkeypatch):
    client = await start_app(aiohttp_client, llm)
    tokenizer = client.app[STATE].door.engine.tokenizer
    started, release = threading.Event(), threading.Event()
    encode = tokenizer.encode

    def slow_encode(text, add_special_tokens=True):
        started.set()
        release.wait(10)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    # A body over INLINE_BODY_BYTES: its tokenizing runs on a worker thread.
    request = asyncio.create_task(client.post("/v1/completions", json={
        "model": model_name(client), "prompt": "Once upon a time " * 600, "max_tokens": 4}))
    assert await asyncio.to_thread(started.wait, 10)
    request.cancel()  # the connection closes; the server cancels the handler
    with pytest.raises(asyncio.CancelledError):
        await request
    await asyncio.sleep(0.1)
    release.set()
    await asyncio.sleep(0.2)  # the tokenizer thread finishes; its result goes nowhere
    assert await metric(client, "kvledger_requests_admitted_total") == 0
    assert await wait_for_metric(client, "kvledger_kv_blocks_reserved", 0) == 0
    assert not client.app[STATE].door.admission.running


# -- 5. stop strings ---------------------------------------------------------------------
@pytest.mark.parametrize("field, value, limit", [
    ("stop", ["QZ|"] * (limits.MAX_STOP_STRINGS + 1), limits.MAX_STOP_STRINGS),
    ("stop", "x" * (limits.MAX_STOP_STRING_CHARS + 1), limits.MAX_STOP_STRING_CHARS),
    ("stop", ["y" * 1000] * 5, limits.MAX_STOP_TOTAL_CHARS),
    ("stop_token_ids", [7] * (limits.MAX_STOP_TOKEN_IDS + 1), limits.MAX_STOP_TOKEN_IDS),
    ("stop", ["QZ|"] * 520_000, limits.MAX_JSON_ITEMS),
])
async def test_stop_lists_past_their_limits_are_400(aiohttp_client, llm, field, value, limit):
    client = await start_app(aiohttp_client, llm)
    body = json.dumps({"model": model_name(client), "prompt": "Once", "max_tokens": 4,
                       field: value}, separators=(",", ":")).encode()
    status, error = await _hostile(client, "/v1/completions", body)
    assert status == 400 and f"{limit}" in error["message"]
    assert error["param"] == field or limit == limits.MAX_JSON_ITEMS


async def test_stop_lists_at_their_limits_are_served(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    width = limits.MAX_STOP_TOTAL_CHARS // limits.MAX_STOP_STRINGS
    response = await client.post("/v1/completions", json={
        "model": model_name(client), "prompt": "Once", "max_tokens": 4, "ignore_eos": True,
        "stop": [f"{i:0{width}d}" for i in range(limits.MAX_STOP_STRINGS)],
        "stop_token_ids": list(range(10_000, 10_000 + limits.MAX_STOP_TOKEN_IDS))})
    assert response.status == 200


# -- 6. slow clients ---------------------------------------------------------------------
async def _seconds_until_closed(reader, writer, data: bytes, interval_s: float) -> float:
    """Send ``data`` a byte at a time; the seconds until the server hangs up."""
    started = time.perf_counter()
    try:
        for byte in data:
            try:
                writer.write(bytes([byte]))
                await writer.drain()
                if await asyncio.wait_for(reader.read(1), interval_s) == b"":
                    break
            except TimeoutError:
                continue
            except ConnectionError:
                break
        else:
            pytest.fail("the server read the whole request")
        return time.perf_counter() - started
    finally:
        writer.close()


async def test_headers_sent_slower_than_the_limit_are_cut_off(llm):
    async with serving(llm, header_timeout_s=0.5) as port, aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{port}"
        crawl = [asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
        connections = await asyncio.gather(*crawl)
        slow = request_bytes("GET", "/health", **{f"X-Pad-{i}": "a" * 20 for i in range(20)})
        work = asyncio.gather(*(_seconds_until_closed(r, w, slow, 0.05) for r, w in connections))
        polled = await _while_polling(lambda p: session.get(url + p), work)
        closed_after = polled.result
        assert all(0.4 < s < 3 for s in closed_after), closed_after  # not ~30 s
        assert polled.failure() is None, polled.failure()
        # Headers in pieces, but whole within the limit: served.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = request_bytes("GET", "/health")
        for piece in (request[:10], request[10:20], request[20:]):
            writer.write(piece)
            await asyncio.sleep(0.1)
        assert (await read_response(reader))[0] == 200
        writer.close()


async def test_a_stalled_body_gets_408_within_the_limit(llm):
    async with serving(llm, body_timeout_s=0.5) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"model": "m", "prompt": "hi"}'
        started = time.perf_counter()
        writer.write(request_bytes("POST", "/v1/completions", body)[:-len(body) + 5])
        status, headers, raw = await asyncio.wait_for(read_response(reader), 5)
        assert 0.45 < time.perf_counter() - started < 3
        assert status == 408 and error_of(raw)["code"] == "body_timeout"
        assert headers["connection"] == "close"
        writer.close()


async def test_an_idle_keepalive_connection_closes_after_its_timeout(llm):
    async with serving(llm, header_timeout_s=0.3, keepalive_timeout_s=1.0) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request_bytes("GET", "/health"))
        assert (await read_response(reader))[0] == 200
        await asyncio.sleep(0.6)  # idle past the header limit, within keep-alive: still open
        writer.write(request_bytes("GET", "/health"))
        assert (await read_response(reader))[0] == 200
        assert await asyncio.wait_for(reader.read(1), 3) == b""
        writer.close()


async def test_an_answer_nobody_reads_is_dropped_after_the_write_timeout(llm):
    """A client that sends a request whose answer is megabytes and reads none of it: the
    server holds the answer until the write timeout, then drops the connection (before,
    eight such clients held 1.5 GB after they had gone)."""
    import socket

    async with serving(llm, write_timeout_s=0.5) as port:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
        # An answer (about 15 MB) larger than what the kernel buffers for the socket
        body = json.dumps({"prompt": _words(2_000_000), "return_token_strs": True}).encode()
        writer.write(request_bytes("POST", "/tokenize", body))
        await asyncio.sleep(5.0)  # reads nothing: tokenizing, then the timeout
        received = b""
        with contextlib.suppress(ConnectionError, TimeoutError):
            while chunk := await asyncio.wait_for(reader.read(1 << 16), 5):
                received += chunk
        writer.close()
        head, _, answer = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        assert len(answer) < length  # cut off: the rest was dropped, not kept for it
        async with (aiohttp.ClientSession() as session,  # and the server serves on
                    session.get(f"http://127.0.0.1:{port}/health") as response):
            assert response.status == 200


@pytest.mark.parametrize("flags", [["--header-timeout", "0"], ["--body-timeout", "soon"],
                                   ["--keepalive-timeout", "-1"]])
def test_bad_timeout_flags_exit_2(tmp_path, capsys, flags):
    assert main(["serve", "--model", str(tmp_path), *flags]) == 2
    assert flags[0] in capsys.readouterr().err


# -- 7. failures are counted -------------------------------------------------------------
async def test_a_bug_is_a_bare_500_and_counted(aiohttp_client, llm, monkeypatch):
    client = await start_app(aiohttp_client, llm)
    assert await metric(client, "kvledger_requests_failed_total", 'reason="internal_error"') == 0

    def broken(req, cap):
        raise RuntimeError("injected bug at /secret/path")

    monkeypatch.setattr(openai_api, "sampling_params", broken)
    response = await client.post("/v1/completions", json={
        "model": model_name(client), "prompt": "hi", "max_tokens": 2})
    text = await response.text()
    assert response.status == 500 and json.loads(text)["error"]["code"] == "internal_error"
    assert "Traceback" not in text and "/secret/path" not in text
    assert await metric(client, "kvledger_requests_failed_total", 'reason="internal_error"') == 1
    assert await wait_for_metric(client, "kvledger_kv_blocks_reserved", 0) == 0


@pytest.mark.parametrize("error, code", [(EngineDeadError("the engine has stopped"),
                                          "engine_dead"),
                                         (RuntimeError("injected bug"), "internal_error")])
async def test_a_stream_ending_in_an_error_event_is_counted(aiohttp_client, llm, error, code):
    client = await start_app(aiohttp_client, llm)
    admission = client.app[STATE].door.admission

    def progress(ticket, generated_tokens):
        raise error

    admission.progress = progress
    response = await client.post("/v1/completions", json={
        "model": model_name(client), "prompt": "hi", "max_tokens": 4, "ignore_eos": True,
        "stream": True})
    raw = await response.text()
    assert response.status == 200
    *_, error_event, done = raw.strip().split("\n\n")
    assert done == "data: [DONE]"  # stream readers end normally after the error event
    error = json.loads(error_event.removeprefix("data: "))
    assert error["error"]["code"] == code and "Traceback" not in raw
    labels = f'reason="{code}"'
    assert await metric(client, "kvledger_requests_failed_total", labels) == 1
    assert await wait_for_metric(client, "kvledger_kv_blocks_reserved", 0) == 0
