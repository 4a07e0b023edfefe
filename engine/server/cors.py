"""Cross-origin requests from browsers, served as vLLM's ``--allowed-origins``,
``--allowed-methods``, ``--allowed-headers`` and ``--allow-credentials`` serve them (the
CORS rules of Starlette's middleware, which vLLM mounts), but off unless origins are
named: vLLM allows every origin by default, which lets any page a user opens call a server
their browser can reach.

A preflight (``OPTIONS`` with ``Access-Control-Request-Method``) from an allowed origin is
answered before the API key is asked for (browsers send none with it); one from another
origin is a 400. Every other answer to an allowed origin, streamed ones included, carries
``Access-Control-Allow-Origin`` (set as its headers are sent)."""

from __future__ import annotations

from aiohttp import web

from kvledger.engine.server.state import STATE
from kvledger.engine.settings.serve_config import ServeConfig

ALL_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
PREFLIGHT_MAX_AGE_S = 600


def allows(options: ServeConfig, origin: str | None) -> bool:
    return origin is not None and bool(options.allowed_origins) and (
        "*" in options.allowed_origins or origin in options.allowed_origins)


def _origin_headers(options: ServeConfig, origin: str) -> dict[str, str]:
    if "*" in options.allowed_origins and not options.allow_credentials:
        return {"Access-Control-Allow-Origin": "*"}
    headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if options.allow_credentials:
        headers["Access-Control-Allow-Credentials"] = "true"
    return headers


def preflight(request: web.Request, options: ServeConfig) -> web.Response | None:
    """The answer to a CORS preflight, or None when the request is not one (or CORS is
    off: it then goes on as any request)."""
    if (request.method != "OPTIONS" or not options.allowed_origins
            or "Access-Control-Request-Method" not in request.headers):
        return None
    origin = request.headers.get("Origin")
    if not allows(options, origin):
        return web.Response(status=400, text="Disallowed CORS origin")
    methods = ALL_METHODS if "*" in options.allowed_methods else ", ".join(
        options.allowed_methods)
    asked = request.headers.get("Access-Control-Request-Headers", "")
    headers = asked if "*" in options.allowed_headers else ", ".join(options.allowed_headers)
    return web.Response(status=200, headers={
        **_origin_headers(options, origin), "Access-Control-Allow-Methods": methods,
        "Access-Control-Allow-Headers": headers,
        "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)})


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp's ``on_response_prepare``: an allowed origin's answer names it."""
    options = request.app[STATE].options
    origin = request.headers.get("Origin")
    if allows(options, origin):
        response.headers.update(_origin_headers(options, origin))
