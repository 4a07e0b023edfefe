"""vLLM's ``GET /load`` and ``--enable-server-load-tracking``: ``{"server_load": N}``, the
generation requests in flight (``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses``), waiting in the line or running, from the moment their handler starts
until their answer's last byte is written or they end otherwise (an error, a refusal, the
client gone). vLLM serves the path whatever the flag, and without it the count stays 0;
so does kvledger.

It is the server's one count, every tenant's requests together: it tells no tenant what
another sent. It needs no API key, as vLLM's and the probes' (a router polls it), except
under ``--metrics-api-key``, whose key then guards it as it guards the pool's other live
figures (``/metrics``, ``/v1/budget``; ``app._check_api_key``).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from aiohttp import web

from kvledger.engine.server.state import STATE

PATH = "/load"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def counted(handler: Handler) -> Handler:
    """``handler`` counted in ``/load`` while it runs, under the flag (a stream's handler
    runs until the stream ends)."""

    @functools.wraps(handler)
    async def tracked(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        if not state.options.enable_server_load_tracking:
            return await handler(request)
        state.server_load += 1
        try:
            return await handler(request)
        finally:
            state.server_load -= 1

    return tracked


async def load(request: web.Request) -> web.Response:
    return web.json_response({"server_load": request.app[STATE].server_load})
