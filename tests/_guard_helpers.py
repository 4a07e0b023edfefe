"""Helpers for the hostile-request tests: /health timed while a request runs, a server on
a real port with ``kvledger serve``'s runner, and raw HTTP for what clients refuse to send."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from aiohttp import web

from kvledger.engine.server.app import build_app
from kvledger.engine.server.state import STATE, ServeOptions
from kvledger.engine.slow_clients import limited_runner

POLL_INTERVAL_S = 0.005


async def while_polling_health(get, work):
    """Await ``work`` while ``get("/health")`` is polled; return (its result, the slowest
    /health answer in seconds, the number of polls).

    A poll's time includes the pause before it: when client and server share one event
    loop, a stall that starts between two polls delays the next one's start, not its
    answer, and would otherwise go unseen.
    """
    done = asyncio.Event()
    slowest, polls = 0.0, 0

    async def poll() -> None:
        nonlocal slowest, polls
        while not done.is_set():
            started = time.perf_counter()
            async with get("/health") as response:
                assert response.status == 200
                await response.read()
            await asyncio.sleep(POLL_INTERVAL_S)
            slowest = max(slowest, time.perf_counter() - started - POLL_INTERVAL_S)
            polls += 1

    poller = asyncio.create_task(poll())
    await asyncio.sleep(0.02)  # the first poll is out before the work starts
    try:
        result = await work
    finally:
        done.set()
        await poller
    return result, slowest, polls


@contextlib.asynccontextmanager
async def serving(llm, **options):
    """``llm`` served on 127.0.0.1 by the same runner as ``kvledger serve``; yields the port."""
    serve_options = ServeOptions(**options)
    app = build_app(serve_options)
    runner = limited_runner(app, header_timeout_s=serve_options.header_timeout_s,
                            write_timeout_s=serve_options.write_timeout_s,
                            keepalive_timeout=serve_options.keepalive_timeout_s,
                            handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        await app[STATE].attach(llm)
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length: (status, headers, body)."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionResetError("closed before a response")
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return int(status_line.split()[1]), headers, body


def request_bytes(method: str, path: str, body: bytes = b"", **headers: str | bytes) -> bytes:
    """A raw HTTP/1.1 request; header values may be bytes (sent as they are)."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: localhost"]
    if body:
        lines += [b"Content-Type: application/json", b"Content-Length: %d" % len(body)]
    for name, value in headers.items():
        value = value if isinstance(value, bytes) else value.encode()
        lines.append(name.replace("_", "-").encode() + b": " + value)
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def error_of(body: bytes) -> dict:
    return json.loads(body)["error"]
