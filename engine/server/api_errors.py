"""HTTP errors in OpenAI's body shape: ``{"error": {"message", "type", "code", "param"}}``.

Every refusal the server makes is an ``ApiError``; the app's middleware turns it (and
aiohttp's own HTTP exceptions) into a JSON response, so no client ever sees a traceback.
"""

from __future__ import annotations

import json

from aiohttp import web

# OpenAI's error "type" per status; the "code" says which rule refused the request.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """A request refused with an HTTP status and a one-line message.

    ``reason`` labels ``kvledger_requests_rejected_total``; ``headers`` are added to the
    response (``Retry-After`` on 429).
    """

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None,
                 reason: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.reason = reason or code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code, self.param)

    def response(self) -> web.Response:
        response = web.json_response(self.body(), status=self.status, headers=self.headers)
        if self.status == 408:  # the body is half read: the connection cannot carry another
            response.force_close()
        return response


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> dict:
    error_type = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": error_type, "code": code, "param": param}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, code=code, param=param, reason="bad_request")


def sse_error_event(status: int, message: str, code: str) -> bytes:
    """An error delivered inside an already-started stream (headers are gone)."""
    return b"data: " + json.dumps(error_body(status, message, code)).encode() + b"\n\n"
