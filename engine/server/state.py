"""What one server holds: options, metrics, the engine once loaded, and its lifecycle.

loading (``/ready`` 503) -> ``attach`` (engine started, warmed) -> ready -> ``drain``
(SIGTERM: new requests 503, in-flight ones finish or are aborted after the grace) ->
``close`` (the app's cleanup).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from kvledger.engine import serve_defaults
from kvledger.engine.admission.line import DEFAULT_MAX_QUEUE_LEN, Admission
from kvledger.engine.admission.order import Tenant
from kvledger.engine.core.async_engine import AsyncEngine
from kvledger.engine.core.stall import LineWatch
from kvledger.engine.errors import BadInput
from kvledger.engine.lora_config import LoRARequest
from kvledger.engine.server.api_errors import ApiError
from kvledger.engine.server.metrics import ServerMetrics
from kvledger.engine.server.tenants import Tenants, TenantSpec
from kvledger.engine.server.vllm_metrics import CacheInfo
from kvledger.engine.server.watched_series import watch_series

if TYPE_CHECKING:  # the engine and the grammar compiler pull torch and xgrammar in
    from kvledger.engine.core.engine import LLMEngine
    from kvledger.engine.sampling.grammar import GrammarCompiler

R = TypeVar("R")

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
# Parsing, rendering and tokenizing a body this small takes well under a millisecond:
# less than handing it to a worker thread and back.
INLINE_BODY_BYTES = 8 * 1024
# Slow clients: a request's headers must arrive within this of its first byte (or of the
# connection opening), its body within this of its headers; an idle keep-alive connection
# closes after the last. 75 s outlasts the 60 s idle timeout of common load balancers, so
# they, not the server, close idle connections (no race on reuse).
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_KEEPALIVE_TIMEOUT_S = 75.0
# A schema whose grammar takes longer than this to compile is a 400 (a client's 570 KiB
# anyOf took about 2 s on one core; typical schemas take milliseconds).
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 10.0
# Threads that parse bodies, render chat templates and tokenize, off the event loop.
PREPARE_THREADS = 4
# Threads that read LoRA adapters (from disk, or a hub that may be slow or never answer):
# their own, at most this many, so a stuck adapter load never holds up parsing and
# tokenizing; daemon threads, so one stuck until --hub-timeout never holds up shutdown.
ADAPTER_THREADS = 2


@dataclass(frozen=True)
class ServeOptions:
    api_keys: tuple[str, ...] = ()       # any one of them opens /v1/*; none: no key needed
    salt_cache_per_key: bool = False     # requests under different keys never share KV blocks
    metrics_api_key: str | None = None   # None: /metrics is open (Prometheus' default)
    max_queue_wait_s: float | None = None  # None: a waiter waits as long as it takes
    max_queue_len: int = DEFAULT_MAX_QUEUE_LEN
    backfill: bool = False               # later requests done before the head may go first
    tenant_fairness: bool = serve_defaults.TENANT_FAIRNESS  # the line takes turns (order.py)
    max_queue_len_per_tenant: int | None = None  # None: Tenants' default (half, or all)
    tenants: tuple[TenantSpec, ...] = ()  # --tenants-file's (server/tenants.py)
    tenant_header: str | None = None      # a gateway's header naming the tenant
    tenant_header_from: tuple[str, ...] = ()  # the peers (CIDRs) it is believed from
    shutdown_grace_s: float = serve_defaults.SHUTDOWN_GRACE_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S
    grammar_compile_timeout_s: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S
    enable_auto_tool_choice: bool = False  # vLLM's: tool_choice "auto" is served
    tool_call_parser: str | None = None    # vLLM's: hermes, llama3_json, mistral; None: the template's
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter (server/lora_routes.py)
    log_requests: bool = False            # vLLM's --enable-log-requests: a line per request
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens token_id:N
    prompt_tokens_details: bool = False   # vLLM's: usage.prompt_tokens_details.cached_tokens
    max_logprobs: int = 20                # vLLM's --max-logprobs (at most 20 here)
    chat_template: str | None = None     # vLLM's --chat-template: renders every chat instead
    trust_request_chat_template: bool = False  # a request's own chat_template may render
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # under a request's


class ServerState:
    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.tenants = Tenants(options.api_keys, options.tenants,
                               max_queue_len=options.max_queue_len,
                               max_queued=options.max_queue_len_per_tenant,
                               header=options.tenant_header,
                               header_from=options.tenant_header_from)
        self.metrics = ServerMetrics(self.tenants.labels)
        self.engine: LLMEngine | None = None          # once loaded
        self.async_engine: AsyncEngine | None = None  # its worker thread, driven from here
        self.admission: Admission | None = None
        self.line_watch: LineWatch | None = None  # the line's stall (core/stall.py)
        self._line_watching: asyncio.Task[None] | None = None
        self.ready = False
        self.draining = False
        self.started_at = time.time()
        self._workers = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="kvledger-prepare")
        self._adapter_threads: asyncio.Semaphore | None = None  # made on the loop
        self._grammars: GrammarCompiler | None = None
        self._token_texts: dict[int, str] = {}
        watch_series(self)

    @property
    def stalled(self) -> str | None:
        """Why the server is stuck by a bug (the engine's loop or the admission line), for
        ``/health``; None while it is not."""
        for watch in (self.engine.stall_watch if self.engine else None, self.line_watch):
            if watch is not None and watch.stalled:
                return watch.describe()
        return None

    # -- lifecycle -------------------------------------------------------------------
    async def attach(self, engine: LLMEngine, *, warm: bool = True) -> None:
        """Start serving ``engine``: worker thread, admission, warm-up."""
        if self.options.chat_template is not None:  # checked when the flag was read
            engine.tokenizer.use_chat_template(self.options.chat_template)
        self.engine = engine
        config = engine.config
        self.metrics.serve_model(engine.model_name, engine.max_model_len, CacheInfo(
            block_size=engine.ledger.block_size, cache_dtype=config.kv_cache_dtype,
            enable_prefix_caching=config.enable_prefix_caching,
            gpu_memory_utilization=config.gpu_memory_utilization,
            num_gpu_blocks=engine.ledger.num_blocks,
            num_gpu_blocks_override=config.num_gpu_blocks_override,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes))
        self.async_engine = driver = AsyncEngine(engine)
        self.admission = Admission(engine.ledger, max_model_len=engine.max_model_len,
                                   max_queue_wait_s=self.options.max_queue_wait_s,
                                   max_queue_len=self.options.max_queue_len,
                                   max_num_seqs=engine.plan.max_num_seqs,
                                   backfill=self.options.backfill,
                                   scheduling_policy=engine.config.scheduling_policy,
                                   headroom=engine.headroom,
                                   tenant_fairness=self.options.tenant_fairness,
                                   decode_tokens_per_s=lambda: driver.decode_tokens_per_s)
        engine.scheduler.fair = self.options.tenant_fairness  # seats and prompt tokens too
        self.async_engine.on_step_outputs = lambda _: self.admission.capacity_changed(step=True)
        self.async_engine.start()
        self.line_watch = LineWatch(self.admission,
                                    lambda: not engine.has_unfinished_requests())
        self._line_watching = asyncio.create_task(self.line_watch.run())
        if warm:
            await self._warm_up()
        self.ready = True

    async def _warm_up(self) -> None:
        """One tiny greedy request through the whole path; its last (warm) decode step
        seeds the decode rate that Retry-After estimates use."""
        from kvledger.engine.sampling.params import SamplingParams

        ids = self.engine.tokenizer.encode("Hello", add_special_tokens=True)[:8] or [0]
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        reservation = self.engine.ledger.try_reserve(len(ids) + 4)
        async for _ in self.async_engine.generate("kvledger-warmup", ids, params, reservation):
            pass
        self.async_engine.restart_rate()

    async def drain(self) -> None:
        """Stop admitting; give in-flight requests the grace period; abort the rest."""
        self.draining = True
        if self.admission is None:
            return
        self.admission.close(ApiError(503, "the server is shutting down", code="shutting_down",
                                      reason="shutting_down"))
        deadline = time.monotonic() + self.options.shutdown_grace_s
        while self.admission.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.admission.running:
            log.warning("aborting %d requests still running after the %.0fs grace",
                        len(self.admission.running), self.options.shutdown_grace_s)
        await self.async_engine.stop()
        # Handlers see their aborted outputs and finish their responses.
        deadline = time.monotonic() + 5.0
        while self.admission.running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        """Stop the engine and the worker threads (queued work is dropped)."""
        if self._line_watching is not None:
            self._line_watching.cancel()
        if self.async_engine is not None:
            await self.async_engine.stop()
        self._workers.shutdown(wait=False, cancel_futures=True)
        if self._grammars is not None:
            self._grammars.close()

    # -- per-request work ------------------------------------------------------------
    async def off_loop(self, body_bytes: int | None, fn: Callable[..., R], *args: object) -> R:
        """``fn(*args)`` for a request of ``body_bytes``: on a worker thread when the body
        is large (or ``None``: work whose cost the body's size does not bound). Parsing a 4 MiB body, rendering a chat and tokenizing take up to seconds
        of CPU, during which ``/health`` and every stream must still answer; the GIL is
        shared, so what runs there should release it (tokenizers' batch encode, numpy) or
        be bounded (``limits``). A body up to ``INLINE_BODY_BYTES`` costs less than the
        trip to a thread and back, so it is done on the loop."""
        if body_bytes is not None and body_bytes <= INLINE_BODY_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn, *args)

    async def load_adapter(self, fn: Callable[..., R], *args: object) -> R:
        """``fn(*args)`` that reads a LoRA adapter, on a daemon thread of its own, at most
        ``ADAPTER_THREADS`` at once. A thread keeps its place until ``fn`` returns, even
        when the request that started it is gone."""
        loop = asyncio.get_running_loop()
        if self._adapter_threads is None:
            self._adapter_threads = asyncio.Semaphore(ADAPTER_THREADS)
        threads = self._adapter_threads
        await threads.acquire()
        future = loop.create_future()

        def settle(ok: bool, value) -> None:
            threads.release()
            if not future.done():
                (future.set_result if ok else future.set_exception)(value)

        def run() -> None:
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the awaiting request, as an executor would
                loop.call_soon_threadsafe(settle, False, exc)
            else:
                loop.call_soon_threadsafe(settle, True, result)

        threading.Thread(target=run, name="kvledger-adapter", daemon=True).start()
        return await future

    @property
    def grammars(self) -> GrammarCompiler:
        """The engine's ``GrammarCompiler``, built at the first constrained request."""
        if self._grammars is None:
            from kvledger.engine.sampling.grammar import GrammarCompiler

            tokenizer = self.engine.tokenizer
            self._grammars = GrammarCompiler(tokenizer, tokenizer.eos_token_ids,
                                             self.engine.runner.config.vocab_size,
                                             cache_bytes=self.engine.config.grammar_cache_bytes)
        return self._grammars

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs show it (cached: a vocabulary's worth at most)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    # -- per-request checks ----------------------------------------------------------
    def check_accepting(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down",
                           reason="shutting_down")
        if not self.ready:
            raise ApiError(503, "the model is still loading", code="not_ready", reason="not_ready")
        if self.async_engine.dead is not None:
            raise ApiError(503, f"the engine has failed: {self.async_engine.dead}",
                           code="engine_dead", reason="engine_dead")

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name requests may use: the first is the one answers carry."""
        return (self.engine.model_name, *self.engine.config.served_model_aliases)

    def tenant(self, request: web.Request) -> Tenant:
        """Whom the request is for, as the admission line shares it out (``Tenants.of``:
        a trusted gateway's header, its API key, else everyone's anonymous tenant)."""
        try:
            return self.tenants.of(request.get(API_KEY_INDEX), request.headers, request.remote)
        except BadInput as exc:
            raise ApiError(400, str(exc), code="invalid_request", reason="bad_request") from None

    def check_model(self, name: str) -> LoRARequest | None:
        """None for the base model (any of its names), else the ``LoRARequest`` of the
        adapter ``name`` names; 404 naming it when neither."""
        if name in self.model_names:
            return None
        loras = self.engine.loras
        served = {} if loras is None else loras.served
        if name in served:
            return served[name]
        more = f" and {len(served)} LoRA adapters" if served else ""
        raise ApiError(404, f"the model {name!r} does not exist (no model or LoRA adapter has "
                            f"that name); this server serves {self.model_name!r}{more}",
                       code="model_not_found", param="model", reason="unknown_model")


STATE = web.AppKey("kvledger_state", ServerState)
# Which of --api-key's keys opened this request (its position), when keys are set.
API_KEY_INDEX = web.RequestKey("kvledger_api_key_index", int)
