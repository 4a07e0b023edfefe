"""``POST /v1/responses`` (OpenAI's Responses API, as vLLM 0.32 serves it for a model
without Harmony), and ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``.

A Responses body is translated into the chat request it stands for
(``responses_request``) and served by the chat route itself (``openai_api.serve``): the
same door, admission and reservation, API keys, tenants, limits, metrics, 429s with
``Retry-After`` and aborts on disconnect. Only the answer's shape is this API's
(``responses_answer``, ``responses_stream``). No response is stored (vLLM's default,
without ``VLLM_ENABLE_RESPONSES_API_STORE``), so fetching or cancelling one by its id is
vLLM's 404 for an unknown id.
"""

from __future__ import annotations

from aiohttp import web

from kvledger.engine.server import responses_answer, responses_stream
from kvledger.engine.server.api_errors import ApiError
from kvledger.engine.server.limits import shown
from kvledger.engine.server.openai_api import serve
from kvledger.engine.server.responses_request import (
    NamedRefusal,
    parse_responses,
    responses_error,
)
from kvledger.engine.server.server_load import counted


async def create(request: web.Request) -> web.StreamResponse:
    try:
        return await serve(request, parse_responses, "resp_", whole=responses_answer.whole,
                           stream=responses_stream.stream)
    except NamedRefusal:  # the body's own refusals name this API's fields already
        raise
    except ApiError as exc:  # the door's refusals name chat's fields: name this API's
        raise responses_error(exc) from None


async def unstored(request: web.Request) -> web.Response:
    """Retrieve or cancel: vLLM's answer for an id it does not hold, as no id is held."""
    response_id = request.match_info["response_id"]
    raise ApiError(404, f"Response with id {shown(response_id, 80)} not found: this server "
                        f"keeps no responses (as vLLM without VLLM_ENABLE_RESPONSES_API_STORE)",
                   code="not_found", param="response_id", reason="not_found")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", counted(create))
    app.router.add_get("/v1/responses/{response_id}", unstored)
    app.router.add_post("/v1/responses/{response_id}/cancel", unstored)
