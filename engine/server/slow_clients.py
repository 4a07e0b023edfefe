"""Time limits on slow clients, so idle or trickling connections cannot pile up.

- headers: a request's headers must be complete within ``header_timeout_s`` of its first
  byte (the first request's: of the connection opening), else the connection is closed;
- body: the handler reads it within ``body_timeout_s`` (``openai_api.read_body``: 408);
- idle: a keep-alive connection with no request for ``keepalive_timeout_s`` is closed
  (aiohttp's own ``keepalive_timeout``).

aiohttp (3.14) has no header timeout, so ``_Connection`` adds one to its per-connection
protocol. It reads two of aiohttp's private fields, ``_waiter`` (set while the protocol
waits for the next request's headers) and ``_request_count`` (requests parsed so far);
tests/server/test_guard.py fails if an aiohttp release changes them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from kvledger.engine.server.state import ServeOptions


def make_runner(app: web.Application, options: ServeOptions, **kwargs: Any) -> web.AppRunner:
    """The app's runner with the slow-client limits of ``options``; ``kwargs`` go to
    aiohttp's ``AppRunner``."""
    return _Runner(app, header_timeout_s=options.header_timeout_s,
                   keepalive_timeout=options.keepalive_timeout_s, **kwargs)


class _Runner(web.AppRunner):
    def __init__(self, app: web.Application, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s

    async def _make_server(self) -> _Server:
        return _Server(await super()._make_server(), self._header_timeout_s)


class _Server:
    """aiohttp's ``Server`` (the protocol factory) making ``_Connection`` protocols."""

    def __init__(self, server: web.Server, header_timeout_s: float) -> None:
        self._server = server
        self._header_timeout_s = header_timeout_s

    def __call__(self) -> RequestHandler:
        server = self._server
        return _Connection(server, loop=server._loop, header_timeout_s=self._header_timeout_s,
                           **server._kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class _Connection(RequestHandler):
    """aiohttp's per-connection protocol with a deadline on each request's headers."""

    def __init__(self, manager: web.Server, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._start_header_clock()

    def data_received(self, data: bytes) -> None:
        if self._header_deadline is None and self._awaiting_request():
            self._start_header_clock()  # the first byte of the next request
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:  # its headers are complete
            self._stop_header_clock()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_header_clock()
        super().connection_lost(exc)

    def _awaiting_request(self) -> bool:
        return self._waiter is not None and not self._waiter.done()

    def _start_header_clock(self) -> None:
        if self._header_timeout_s > 0:
            self._header_deadline = self._loop.call_later(self._header_timeout_s,
                                                          self._headers_late)

    def _stop_header_clock(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self._awaiting_request():
            self.force_close()
