"""vLLM's ``--root-path PREFIX``: the API behind a proxy that routes by a path prefix.

vLLM sets FastAPI's ``root_path`` (``vllm/entrypoints/launchers/app.py``), and Starlette
routes a request for ``PREFIX/REST`` as ``/REST`` and any other path as it is
(``starlette._utils.get_route_path``): the proxy may forward the prefix or strip it. Here
the request itself is rewritten as it is made, before any middleware sees it, so the API
keys, limits and metrics of ``/v1/...`` are those of ``PREFIX/v1/...`` too, and a prefix
can never route around them. A path that merely begins with the prefix's letters
(``/llamas`` under ``/llama``) is left as it is, as Starlette leaves it.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from yarl import URL


def serve_under(server: web.Server, prefix: str) -> None:
    """Make ``server`` (aiohttp's, before its first connection) take ``PREFIX/REST`` as
    ``/REST``; ``prefix`` begins with ``/`` and does not end with one."""
    make = server.request_factory

    def request(message: Any, *args: Any) -> web.BaseRequest:
        return make(_stripped(message, prefix), *args)

    server.request_factory = request


def _stripped(message: Any, prefix: str) -> Any:
    url = getattr(message, "url", None)  # an unparsable request's stand-in has none
    if not isinstance(url, URL) or url.is_absolute():  # absolute form: a proxy's, as is
        return message
    path = url.raw_path
    if path != prefix and not path.startswith(prefix + "/"):
        return message
    rest = path[len(prefix):] or "/"
    query = url.raw_query_string
    target = rest + ("?" + query if query else "")
    return message._replace(path=target, url=URL.build(path=rest, query_string=query,
                                                       encoded=True))
