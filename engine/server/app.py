"""The aiohttp application: routes, API-key check, and OpenAI-shaped errors for everything.

``build_app(options)`` returns an app whose ``/health`` answers at once and whose
``/ready`` is 503 until ``app[STATE].attach(engine)`` (an ``LLMEngine``) has loaded and
warmed the model.
"""

from __future__ import annotations

import hmac
import logging
import os
import time

from aiohttp import web

from kvledger.engine.frontend.served import PoolGauges
from kvledger.engine.server import cors, request_id, responses_api, server_load, tokenizer_info
from kvledger.engine.server.api_errors import ApiError, error_body
from kvledger.engine.server.lora_routes import LoraCollector, add_routes, model_cards
from kvledger.engine.server.openai_api import chat_completions, completions
from kvledger.engine.server.sleep_routes import PATHS as SLEEP_PATHS
from kvledger.engine.server.sleep_routes import add_sleep_routes
from kvledger.engine.server.state import API_KEY_INDEX, STATE, ServeOptions, ServerState
from kvledger.engine.server.tokenize_api import detokenize, tokenize, version

log = logging.getLogger(__name__)

# What an API key guards: the API and the tokenizer (each costs CPU); not the probes,
# /version or /load (a router polls it, as vLLM's). /metrics has a key of its own
# (--metrics-api-key), so a tenant's key cannot read the prefix cache's counters.
_KEYED_PATHS = ("/v1/", "/tokenize", "/detokenize", tokenizer_info.PATH, "/reset_prefix_cache",
                *SLEEP_PATHS)
# The pool's live figures, which --metrics-api-key guards once given (else no key does).
_LIVE_FIGURES = ("/v1/budget", server_load.PATH)
# vLLM serves its development endpoints (/reset_prefix_cache among them) only with this
# variable set to 1; so does kvledger, behind the API key as well.
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
# vLLM's endpoints kvledger does not serve. vLLM 0.32 mounts a route only for the tasks its
# model serves (entrypoints/launchers/api_server/routers.py), so such a path is a 404 there:
# a 4xx, which OpenAI's SDKs raise at once (NotFoundError) where a 5xx is retried twice.
# Here the 404 names what the endpoint is and what kvledger serves instead, so it does not
# read like a wrong base URL.
UNSERVED = {
    "/v1/embeddings": "embeddings (an embedding model's pooled output)",
    "/v1/audio/transcriptions": "speech to text", "/v1/audio/translations": "speech to text",
    "/pooling": "pooling models' outputs", "/classify": "classification",
    "/score": "scoring", "/v1/score": "scoring", "/rerank": "reranking",
    "/v1/rerank": "reranking", "/v2/rerank": "reranking",
}
SERVED = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/tokenize",
          "/detokenize")
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


def build_app(options: ServeOptions | None = None) -> web.Application:
    options = options or ServeOptions()
    app = web.Application(middlewares=[_errors],
                          client_max_size=options.max_body_bytes)
    app[STATE] = ServerState(options)
    app[STATE].metrics.registry.register(LoraCollector(app[STATE]))
    app.on_cleanup.append(_close)
    if options.allowed_origins:
        app.on_response_prepare.append(cors.on_prepare)
    if options.enable_request_id_headers:
        app.on_response_prepare.append(request_id.on_prepare)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/budget", budget)
    app.router.add_post("/v1/completions", server_load.counted(completions))
    app.router.add_post("/v1/chat/completions", server_load.counted(chat_completions))
    app.router.add_get(server_load.PATH, server_load.load)
    responses_api.add_routes(app)  # /v1/responses (and its stored ids': none are kept)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    if options.enable_tokenizer_info_endpoint:
        tokenizer_info.add_route(app)
    add_routes(app)  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    if os.environ.get(DEV_MODE_ENV, "").strip() == "1":
        app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
        add_sleep_routes(app)  # /sleep, /wake_up, /is_sleeping (with --enable-sleep-mode)
    for path in UNSERVED:
        app.router.add_route("*", path, _unserved)
    return app


async def _unserved(request: web.Request) -> web.Response:
    raise ApiError(404, f"kvledger does not serve {request.path} ({UNSERVED[request.path]}); "
                        f"it serves text generation: {', '.join(SERVED)}",
                   code="not_found", reason="not_served")


async def _close(app: web.Application) -> None:
    await app[STATE].close()


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """The API key check, then every refusal leaves as OpenAI's error body; an unexpected
    failure as a bare 500. (One middleware: each layer costs every request, 429s included.)

    Also the one place that counts 5xx answers (``kvledger_requests_failed_total``): any
    500, and every 5xx of the API (the probes' 503s are their answer, not a failure).
    """
    state = request.app[STATE]
    code = "http_error"
    try:
        answered = cors.preflight(request, state.options)
        if answered is not None:
            return answered
        _check_api_key(request)
        response = await handler(request)
    except ApiError as exc:
        if request.path.startswith("/v1/") and exc.status != 500:  # a 500 is a failure
            state.metrics.rejected.labels(exc.reason).inc()
        response, code = exc.response(), exc.code
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 413:
            state.metrics.rejected.labels("body_too_large").inc()
        code = _HTTP_CODES.get(exc.status, "http_error")
        message = exc.text if exc.text and exc.status != 404 else f"{exc.status}: {exc.reason}"
        if exc.status == 404:
            message = f"no route for {request.method} {request.path}"
        response = web.json_response(error_body(exc.status, message, code), status=exc.status)
    except Exception:  # a bug, not bad input: log it, never send the traceback
        log.exception("unhandled error on %s %s", request.method, request.path)
        code = "internal_error"
        response = web.json_response(error_body(500, "internal server error", code), status=500)
    if response.status == 500 or (response.status > 500 and request.path.startswith("/v1/")):
        state.metrics.count_failure(code)
    return response


def _check_api_key(request: web.Request) -> None:
    """401 unless the request's bearer token is one of the keys that guard its path: the
    API keys for ``_KEYED_PATHS``, the metrics key for ``/metrics`` (and ``_LIVE_FIGURES``
    when there is one). The API key's index
    is kept on the request (``API_KEY_INDEX``) for salting the prefix cache per key."""
    options = request.app[STATE].options
    if request.path == "/metrics":
        keys = (options.metrics_api_key,) if options.metrics_api_key else ()
    elif request.path in _LIVE_FIGURES and options.metrics_api_key:
        # The pool's live figures are /metrics' (one tenant would watch another's prompt
        # sizes and cache reuse in them): the operator's key, once it has its own.
        keys = (options.metrics_api_key,)
    elif request.path.startswith(_KEYED_PATHS):
        keys = request.app[STATE].tenants.keys  # --api-key's, then --tenants-file's
    else:
        return
    if not keys:
        return
    given = request.headers.get("Authorization", "")
    scheme, _, token = given.partition(" ")
    # Bytes that are not UTF-8 arrive as surrogate escapes; "surrogatepass" encodes any
    # str, so a hostile header is a wrong key, never a UnicodeEncodeError. Every key is
    # compared, in constant time, so the time taken does not tell which one matched.
    given_bytes = token.strip().encode("utf-8", "surrogatepass")
    matched = [hmac.compare_digest(given_bytes, key.encode("utf-8", "surrogatepass"))
               for key in keys]
    if scheme.lower() != "bearer" or not any(matched):
        raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                       code="invalid_api_key", reason="unauthorized")
    request[API_KEY_INDEX] = matched.index(True)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    dead = state.dead
    if dead is not None:
        return web.json_response({"status": "engine_dead", "error": str(dead)}, status=503)
    stalled = state.stalled
    if stalled is not None:  # a bug (engine/core/stall.py): restart the pod
        return web.json_response({"status": "engine_stalled", "error": stalled}, status=503)
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return web.json_response({"status": "shutting_down"}, status=503)
    if not state.ready:
        return web.json_response({"status": "loading"}, status=503)
    if state.dead is not None:
        return web.json_response({"status": "engine_dead"}, status=503)
    if state.stalled is not None:
        return web.json_response({"status": "engine_stalled"}, status=503)
    if state.door.sleep is not None and state.door.sleep.is_sleeping:
        return web.json_response({"status": "sleeping"}, status=503)
    return web.json_response({"status": "ready", "model": state.model_name})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.served is None:
        return web.json_response({"object": "list", "data": []})
    return web.json_response({"object": "list", "data": model_cards(state)})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's development endpoint (``VLLM_SERVER_DEV_MODE=1``): the prefix cache's
    blocks that no running request holds are dropped (a benchmark's cold start, a router
    that resets its view); 200 with how many, as ``{"dropped_blocks": N}``."""
    door = request.app[STATE].check_accepting()
    dropped = door.reset_prefix_cache()
    log.info("prefix cache reset: %d cached blocks dropped", dropped)
    return web.json_response({"dropped_blocks": dropped})


async def budget(request: web.Request) -> web.Response:
    """The plan the engine runs under and the pool's live state (read-only)."""
    state = request.app[STATE]
    served = state.served
    if served is None:
        raise ApiError(503, "the model is still loading", code="not_ready", reason="not_ready")
    pool = served.pool()
    return web.json_response({
        "model": served.model_name,
        "max_model_len": served.max_model_len,
        "plan": served.plan_json(),
        "pool": {"block_size": pool.block_size, "total_blocks": pool.num_blocks,
                 "reserved_blocks": pool.reserved_blocks, "used_blocks": pool.used_blocks,
                 "free_blocks": pool.free_blocks,
                 "admission": "safe" if pool.overcommit else "reserve",
                 "paused": pool.paused_reservations},
        "prefix_cache": _prefix_cache(pool),
        "queue": state.door.queue_status(),
        "decode_tokens_per_s": state.door.decode_tokens_per_s,
        "time_to_ready": state.door.time_to_ready,
        "time": time.time(),
    })


def _prefix_cache(pool: PoolGauges) -> dict:
    """Whether the prefix cache is on, its evictable blocks, and its hit rate in prompt
    tokens (None before the first lookup)."""
    queries, hits = pool.prefix_cache_queries, pool.prefix_cache_hits
    return {"enabled": pool.enable_prefix_caching, "cached_blocks": pool.cached_blocks,
            "queries_tokens": queries, "hits_tokens": hits,
            "hit_rate": hits / queries if queries else None}
