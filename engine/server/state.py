"""What one server holds: options, metrics, the engine once loaded, and its lifecycle.

loading (``/ready`` 503) -> ``attach`` (engine started, warmed) -> ready -> ``drain``
(SIGTERM: new requests 503, in-flight ones finish or are aborted after the grace) ->
``close`` (the app's cleanup).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from aiohttp import web

from kvledger.engine.errors import BadInput, UnknownModel
from kvledger.engine.frontend.door import FrontDoor, LineOptions
from kvledger.engine.frontend.offload import Offload
from kvledger.engine.frontend.served import Served
from kvledger.engine.frontend.submission import Tenant
from kvledger.engine.server.api_errors import ApiError, engine_error
from kvledger.engine.server.metrics import ServerMetrics
from kvledger.engine.server.objectives import Objectives
from kvledger.engine.server.reasoning import ReasoningTokens
from kvledger.engine.server.tenants import Tenants, TenantSpec
from kvledger.engine.server.vllm_metrics import CacheInfo
from kvledger.engine.server.watched_series import watch_series
from kvledger.engine.settings.lora_config import LoRARequest
from kvledger.engine.settings.serve_config import ServeConfig

R = TypeVar("R")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions(ServeConfig):
    """What the server runs with: serve's options (``ServeConfig``, each declared once with
    its flag, default and CRD field), the keys and chat template as the serve verb resolved
    them, and the tenants its ``--tenants-file`` names."""

    tenants: tuple[TenantSpec, ...] = ()  # --tenants-file's (server/tenants.py)

    @classmethod
    def of(cls, config: ServeConfig, **resolved: Any) -> ServeOptions:
        """``config``'s options with ``resolved`` (the tenants, keys read from elsewhere)."""
        return cls(**{**{f.name: getattr(config, f.name) for f in fields(config)}, **resolved})


class ServerState:
    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.tenants = Tenants(options.api_keys, options.tenants,
                               max_queue_len=options.max_queue_len,
                               max_queued=options.max_queue_len_per_tenant,
                               header=options.tenant_header,
                               header_from=options.tenant_header_from)
        self.objectives = Objectives(options.objective_header, options.objectives_file,
                                     self.tenants)
        if self.objectives.path is not None:
            self.objectives.reload()
        self.metrics = ServerMetrics(self.tenants.labels)
        self.door: FrontDoor | None = None  # the engine's one way in, once loaded
        self.reasoning: ReasoningTokens | None = None  # --reasoning-parser's, once loaded
        self.ready = False
        self.draining = False
        self.server_load = 0  # generation requests in flight, for /load (server_load.py)
        self.started_at = time.time()
        self.offload = Offload()  # the threads requests are prepared and adapters read on
        self._token_texts: dict[int, str] = {}
        watch_series(self)

    @property
    def served(self) -> Served | None:
        """What the server may read of the engine (``frontend/served.py``), once loaded."""
        return None if self.door is None else self.door.served

    @property
    def stalled(self) -> str | None:
        """Why the server is stuck by a bug (the engine's loop or the admission line), for
        ``/health``; None while it is not."""
        return None if self.door is None else self.door.stalled

    @property
    def dead(self) -> BaseException | None:
        """Why the engine stopped, for ``/health``; None while it runs (or loads)."""
        return None if self.door is None else self.door.dead

    # -- lifecycle -------------------------------------------------------------------
    async def attach(self, engine: Any, *, warm: bool = True) -> None:
        """Start serving ``engine`` through its front door: driver thread, line, warm-up."""
        options = self.options
        if options.chat_template is not None:  # checked when the flag was read
            engine.tokenizer.use_chat_template(options.chat_template)
        if options.reasoning_parser is not None:  # BadInput (exit 2): markers not in vocab
            self.reasoning = ReasoningTokens.of(options.reasoning_parser, engine.tokenizer)
        config = engine.config
        self.metrics.serve_model(engine.model_name, engine.max_model_len, CacheInfo(
            block_size=engine.ledger.block_size, cache_dtype=config.kv_cache_dtype,
            enable_prefix_caching=config.enable_prefix_caching,
            gpu_memory_utilization=config.gpu_memory_utilization,
            num_gpu_blocks=engine.ledger.num_blocks,
            num_gpu_blocks_override=config.num_gpu_blocks_override,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes))
        self.door = FrontDoor(engine, LineOptions(
            max_queue_wait_s=options.max_queue_wait_s, max_queue_len=options.max_queue_len,
            backfill=options.backfill, tenant_fairness=options.tenant_fairness,
            grammar_compile_timeout_s=options.grammar_compile_timeout_s,
            structured_outputs=options.structured_outputs_config), self.offload)
        await self.door.start(warm=warm)
        # Each step from now on, the warm-up's not counted (as the requests' series).
        self.door.driver.on_step_tokens = self.metrics.vllm.iteration_tokens.observe
        self.ready = True

    async def drain(self) -> None:
        """Stop admitting; give in-flight requests the grace period; abort the rest."""
        self.draining = True
        if self.door is None:
            return
        self.door.close(ApiError(503, "the server is shutting down", code="shutting_down",
                                 reason="shutting_down"))
        await self.door.drain(self.options.shutdown_grace_s)

    async def close(self) -> None:
        """Stop the engine and the worker threads (queued work is dropped)."""
        if self.door is not None:
            await self.door.stop()
        self.offload.close()

    # -- per-request work ------------------------------------------------------------
    async def off_loop(self, body_bytes: int | None, fn: Callable[..., R], *args: object) -> R:
        """``fn(*args)`` on the request-preparing threads (``Offload.run``)."""
        return await self.offload.run(body_bytes, fn, *args)

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs show it (cached: a vocabulary's worth at most)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.door.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    # -- per-request checks ----------------------------------------------------------
    def check_accepting(self) -> FrontDoor:
        """The engine's front door, unless the server is draining, loading or dead (503)."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down",
                           reason="shutting_down")
        if not self.ready:
            raise ApiError(503, "the model is still loading", code="not_ready", reason="not_ready")
        if self.door.dead is not None:
            raise ApiError(503, f"the engine has failed: {self.door.dead}",
                           code="engine_dead", reason="engine_dead")
        return self.door

    @property
    def model_name(self) -> str:
        return self.door.served.model_name

    def check_model(self, name: str | None) -> LoRARequest | None:
        """None for the base model (also when the request names none, as vLLM takes it),
        else the adapter ``name`` names (``FrontDoor.model``); 404 naming it when neither."""
        if name is None:
            return None
        try:
            return self.door.model(name)
        except UnknownModel as exc:
            raise engine_error(exc) from None

    def tenant(self, request: web.Request) -> Tenant:
        """Whom the request is for, as the admission line shares it out (``Tenants.of``:
        a trusted gateway's header, its API key, else everyone's anonymous tenant)."""
        try:
            return self.tenants.of(request.get(API_KEY_INDEX), request.headers, request.remote)
        except BadInput as exc:
            raise ApiError(400, str(exc), code="invalid_request", reason="bad_request") from None

    def objective(self, request: web.Request, tenant: Tenant) -> int | None:
        """The priority of the objective the request's gateway named, held to ``tenant``'s
        floor (``Objectives.priority``); None without one."""
        try:
            return self.objectives.priority(request.headers, request.remote, tenant)
        except BadInput as exc:
            raise ApiError(400, str(exc), code="invalid_request", reason="bad_request") from None


STATE = web.AppKey("kvledger_state", ServerState)
# Which of --api-key's keys opened this request (its position), when keys are set.
API_KEY_INDEX = web.RequestKey("kvledger_api_key_index", int)
