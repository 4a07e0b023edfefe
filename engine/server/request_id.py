"""vLLM's ``--enable-request-id-headers``: every response carries an ``X-Request-Id``
header, the request's own (echoed as it came) or, without one, a new random id (32 hex
digits, as vLLM's ``uuid4().hex``).

Every response means every one, as vLLM's middleware (mounted outside its API-key check)
answers: errors, a 401, the probes and streams included. The header is set as the
response's headers are sent (``on_response_prepare``). Unlike the answer's id, which a
generation request's ``X-Request-Id`` names (``cmpl-ID``), the header is not checked: any
value a client sent comes back, except one holding bytes that are not UTF-8, which could
not come back as sent (aiohttp writes headers as UTF-8 and would drop them, where vLLM's
server echoes them as latin-1): it gets a new id instead, never a mangled copy of its own.
"""

from __future__ import annotations

import uuid

from aiohttp import web

HEADER = "X-Request-Id"


def response_id(request: web.Request) -> str:
    """The id a response to ``request`` carries: its own ``X-Request-Id``, else a new one."""
    given = request.headers.get(HEADER)
    if given is not None:
        try:
            given.encode("utf-8")  # aiohttp decodes bytes that are not UTF-8 as surrogates
        except UnicodeEncodeError:
            given = None
    return uuid.uuid4().hex if given is None else given


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp's ``on_response_prepare``: the response names the request's id."""
    response.headers[HEADER] = response_id(request)
