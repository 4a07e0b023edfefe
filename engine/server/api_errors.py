"""HTTP errors in OpenAI's body shape: ``{"error": {"message", "type", "code", "param"}}``.

Every refusal the server makes is an ``ApiError``; the app's middleware turns it (and
aiohttp's own HTTP exceptions) into a JSON response, so no client ever sees a traceback.
The engine's front door refuses with the engine's errors; ``engine_error`` maps each to
its answer (``admission_error`` those of admission).
"""

from __future__ import annotations

import json
import math

from aiohttp import web

from kvledger.engine.errors import (
    BadInput,
    CapTooLarge,
    EngineDeadError,
    EngineSleeping,
    KVCacheFull,
    PoolTooSmall,
    PromptTooLong,
    UnknownModel,
)

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


def retry_headers(wait_s: float) -> dict[str, str]:
    """A 429's headers for a wait of ``wait_s``: ``Retry-After`` in whole seconds and
    ``retry-after-ms`` (OpenAI's SDKs read it), each at least 1."""
    return {"Retry-After": str(max(1, math.ceil(wait_s))),
            "retry-after-ms": str(max(1, round(wait_s * 1000)))}


def admission_error(exc: PromptTooLong | CapTooLarge | PoolTooSmall | KVCacheFull) -> ApiError:
    """The HTTP answer to admission's refusal ``exc``: 400 ``context_length_exceeded`` for a
    prompt that fills the context (as vLLM and OpenAI answer it: the SDKs raise
    ``BadRequestError``) or a cap over it, 400 for a request the pool could never hold, 429
    with Retry-After for one the KV cache cannot hold now."""
    if isinstance(exc, PromptTooLong):
        return ApiError(400, f"This model's maximum context length is {exc.max_model_len} "
                             f"tokens. However, your prompt contains {exc.prompt_tokens} input "
                             f"tokens, which leaves no room for an output token. Please reduce "
                             f"the length of the input prompt.",
                        code="context_length_exceeded", param="prompt", reason="prompt_too_long")
    if isinstance(exc, CapTooLarge):
        return ApiError(400, f"prompt ({exc.prompt_tokens} tokens) + max_tokens "
                             f"({exc.max_tokens}) = {exc.prompt_tokens + exc.max_tokens} "
                             f"exceeds the context limit of {exc.max_model_len} tokens; "
                             f"lower max_tokens to at most {exc.room_tokens}",
                        code="context_length_exceeded", param="max_tokens", reason="over_context")
    if isinstance(exc, PoolTooSmall):
        choices = f" for {exc.count} choices" if exc.count > 1 else ""
        kept = (f", of which {exc.kept_blocks} are kept for more urgent requests "
                f"(--priority-headroom)" if exc.kept_blocks else "")
        return ApiError(400, f"the request needs {exc.needed_blocks} KV blocks ({exc.num_tokens} "
                             f"tokens{choices}) but the whole pool holds {exc.pool_blocks}"
                             f"{kept}; lower max_tokens{' or n' if exc.count > 1 else ''}",
                        code="kv_pool_too_small", param="max_tokens", reason="over_pool")
    return ApiError(429, str(exc), code=exc.reason, reason=exc.reason,
                    headers=retry_headers(exc.wait_s))


def engine_error(exc: Exception) -> ApiError | None:
    """The HTTP answer to an error the engine's front door raised: admission's refusals
    (``admission_error``), 404 ``model_not_found``, 400 naming the field at fault, 503
    for a dead engine; None for anything else (a bug: the middleware's 500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, PromptTooLong | CapTooLarge | PoolTooSmall | KVCacheFull):
        return admission_error(exc)
    if isinstance(exc, UnknownModel):
        return ApiError(404, str(exc), code="model_not_found", param="model",
                        reason="unknown_model")
    if isinstance(exc, BadInput):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, EngineDeadError):
        return ApiError(503, str(exc), code="engine_dead", reason="engine_dead")
    if isinstance(exc, EngineSleeping):
        return ApiError(503, str(exc), code="engine_sleeping", reason="sleeping",
                        headers={"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))})
    return None
