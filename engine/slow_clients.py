"""Limits on slow and idle clients of an aiohttp server, so that connections that say little
or nothing cannot pile up: the engine's server (``kvledger serve``) and the operator's
admission webhook both use them (aiohttp only: no torch, no room of the engine).

- headers: a request's headers must be complete within ``header_timeout_s`` of its first
  byte (the first request's: of the connection opening, after TLS), else the connection
  is closed;
- body: the handler reads it within its own deadline (the engine's
  ``openai_api.read_body``, the webhook's server: 408);
- idle: a keep-alive connection with no request for ``keepalive_timeout`` is closed
  (aiohttp's own);
- reading: a connection whose client reads nothing for ``write_timeout_s`` while the server
  has more of an answer to write than the socket takes (asyncio paused its writing) is
  aborted, and what it held freed: an answer nobody reads cannot pile up in memory;
- with ``CappedSite``: a TLS handshake not done within ``handshake_timeout_s`` is dropped
  (asyncio's own, 60 s unless told), and no more than ``max_connections`` are open at once:
  one past them is closed as it is accepted, before any TLS, so a flood costs the process
  nothing past the cap (a TLS connection holds ~280 KiB: asyncio's read buffer alone is
  256 KiB).

aiohttp (3.14) has no header timeout, so ``_Connection`` adds one to its per-connection
protocol. It reads two of aiohttp's private fields, ``_waiter`` (set while the protocol
waits for the next request's headers) and ``_request_count`` (requests parsed so far);
tests/server/test_guard.py fails if an aiohttp release changes them.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import weakref
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler


def limited_runner(app: web.Application, *, header_timeout_s: float,
                   keepalive_timeout: float, write_timeout_s: float = 0.0,
                   **kwargs: Any) -> web.AppRunner:
    """The app's runner with these slow-client limits (0: none); ``kwargs`` go to
    aiohttp's ``AppRunner``."""
    return _Runner(app, header_timeout_s=header_timeout_s, keepalive_timeout=keepalive_timeout,
                   write_timeout_s=write_timeout_s, **kwargs)


class CappedSite(web.BaseSite):
    """A TCP site (TLS with ``ssl_context``) that holds at most ``max_connections`` and
    drops a TLS handshake not done within ``handshake_timeout_s``."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *,
                 max_connections: int, handshake_timeout_s: float,
                 ssl_context: ssl.SSLContext | None = None, backlog: int = 128) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._host, self._port = host, port
        self._max_connections = max_connections
        self._handshake_timeout_s = handshake_timeout_s
        self.listener: _CappedListener | None = None

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        self.listener = _CappedListener(family, self._max_connections)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((self._host, self._port))
        self._server = await asyncio.get_running_loop().create_server(
            self._runner.server, sock=self.listener, ssl=self._ssl_context,
            backlog=self._backlog,
            ssl_handshake_timeout=self._handshake_timeout_s if self._ssl_context else None)


class _CappedListener(socket.socket):
    """A listening socket whose ``accept`` (asyncio's loop calls it) closes, with a reset,
    each connection past the cap; it counts those it handed out that are still open (their
    transport closes them when done, which sets their descriptor to -1)."""

    def __init__(self, family: socket.AddressFamily, max_connections: int) -> None:
        super().__init__(family, socket.SOCK_STREAM)
        self.max_connections = max_connections
        self.refused = 0
        self._handed: weakref.WeakSet[socket.socket] = weakref.WeakSet()

    def open_connections(self) -> int:
        return sum(1 for conn in list(self._handed) if conn.fileno() != -1)

    def accept(self) -> tuple[socket.socket, Any]:
        while True:
            conn, address = super().accept()  # BlockingIOError when none is waiting
            if self.open_connections() < self.max_connections:
                self._handed.add(conn)
                return conn, address
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
            self.refused += 1


class _Runner(web.AppRunner):
    def __init__(self, app: web.Application, *, header_timeout_s: float,
                 write_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._timeouts = (header_timeout_s, write_timeout_s)

    async def _make_server(self) -> _Server:
        return _Server(await super()._make_server(), *self._timeouts)


class _Server:
    """aiohttp's ``Server`` (the protocol factory) making ``_Connection`` protocols."""

    def __init__(self, server: web.Server, header_timeout_s: float,
                 write_timeout_s: float) -> None:
        self._server = server
        self._timeouts = (header_timeout_s, write_timeout_s)

    def __call__(self) -> RequestHandler:
        server = self._server
        header_timeout_s, write_timeout_s = self._timeouts
        return _Connection(server, loop=server._loop, header_timeout_s=header_timeout_s,
                           write_timeout_s=write_timeout_s, **server._kwargs)

    @property
    def request_factory(self) -> Any:
        return self._server.request_factory

    @request_factory.setter
    def request_factory(self, factory: Any) -> None:
        # Set on aiohttp's server, which each connection reads it from.
        self._server.request_factory = factory

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class _Connection(RequestHandler):
    """aiohttp's per-connection protocol with a deadline on each request's headers, and
    one on a client that stops reading its answer."""

    def __init__(self, manager: web.Server, *, header_timeout_s: float,
                 write_timeout_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._header_deadline: asyncio.TimerHandle | None = None
        self._write_timeout_s = write_timeout_s
        self._write_deadline: asyncio.TimerHandle | None = None

    def pause_writing(self) -> None:  # the socket's buffer is full: the client is not reading
        super().pause_writing()
        if self._write_timeout_s > 0 and self._write_deadline is None:
            self._write_deadline = self._loop.call_later(self._write_timeout_s,
                                                         self._reader_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_write_clock()

    def _stop_write_clock(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _reader_stalled(self) -> None:
        self._write_deadline = None
        if self.transport is not None:
            self.transport.abort()  # drops what it buffered; the handler sees a reset

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
        self._stop_write_clock()
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
