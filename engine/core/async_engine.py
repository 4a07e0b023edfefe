"""Drive an ``LLMEngine`` from asyncio: one worker thread steps, per-request queues fan out.

The worker thread sleeps while the engine has nothing to do and wakes on any new request
or abort. ``generate`` is an async iterator of one request's ``RequestOutput``s; leaving
it early (client gone, handler cancelled) aborts the request, and the engine then
releases its reservation. If ``step()`` raises, every live request gets an
``EngineDeadError`` and the engine releases every reservation it holds
(``LLMEngine.abort_all``), so no block is ever lost.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvledger.engine.core.kv_publisher import KVEventPublisher
from kvledger.engine.core.outputs import RequestOutput
from kvledger.engine.core.request import EngineRequest
from kvledger.engine.errors import EngineDeadError
from kvledger.engine.kv.reservation import Reservation
from kvledger.engine.sampling.params import SamplingParams

if TYPE_CHECKING:  # the engine pulls torch in
    from kvledger.engine.core.engine import LLMEngine

log = logging.getLogger(__name__)

_EWMA = 0.2  # weight of the newest step in the decode-rate average
# After a step that ran nothing though requests are in (a request still being handed
# over heads the order), wait this long or until woken rather than spin.
IDLE_STEP_WAIT_S = 0.005

# The engine each running driver steps: two drivers on one engine would each step it and
# hand a request's outputs to whichever stepped, so the other's stream would wait forever.
_DRIVERS: weakref.WeakKeyDictionary[LLMEngine, AsyncEngine] = weakref.WeakKeyDictionary()
_DRIVERS_LOCK = threading.Lock()


class RequestStream:
    """Async iterator of one request's outputs; ``aclose()`` aborts it if unfinished."""

    def __init__(self, owner: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.last: RequestOutput | None = None  # the latest output
        self._owner = owner

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True  # the engine is dead; nothing left to abort
            self._owner._streams.pop(self.request_id, None)
            raise item
        self.last = item
        if item.finished:
            self.finished = True
            self._owner._streams.pop(self.request_id, None)
        return item

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner._streams.pop(self.request_id, None)
            self._owner.abort(self.request_id)


class AsyncEngine:
    """``start()`` the worker, ``generate()`` per request, ``stop()`` at shutdown."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead: BaseException | None = None
        # Called on the loop thread with each step's outputs (admission's capacity_changed).
        self.on_step_outputs: Callable[[list[RequestOutput]], None] | None = None
        self._step_s: float | None = None  # EWMA of the time of steps that decoded
        self._last_step_s: float | None = None
        # Steps that produced tokens, their wall time and tokens (kvledger_engine_step*_total).
        self.steps, self.step_seconds, self.step_tokens = 0, 0.0, 0
        # Called on the worker thread with each step's tokens, the prompt tokens it computed
        # and those it generated, when it computed any (vllm:iteration_tokens_total).
        self.on_step_tokens: Callable[[int], None] | None = None
        self.kv_events: KVEventPublisher | None = None  # --kv-events-config

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """The worker thread, and the KV events' publisher when the ledger logs them
        (BadInput when its endpoint cannot be bound or connected). RuntimeError when
        another driver runs the same engine: an engine has one driver at a time."""
        self._loop = asyncio.get_running_loop()
        with _DRIVERS_LOCK:
            if _DRIVERS.get(self.engine, self) is not self:
                raise RuntimeError("this engine is already driven by a running AsyncEngine;"
                                   " stop that one first")
            _DRIVERS[self.engine] = self
        events = self.engine.ledger.prefix_cache.events
        if events is not None:
            try:
                self.kv_events = KVEventPublisher(self.engine.config.kv_events_config, events)
            except BaseException:
                self._let_go()
                raise
        self._thread = threading.Thread(target=self._run, name="kvledger-engine", daemon=True)
        self._thread.start()

    async def stop(self, drain_s: float = 5.0) -> None:
        """Abort everything still running, let the engine release it, join the worker."""
        for request_id in list(self._streams):
            self.abort(request_id)
        deadline = time.monotonic() + drain_s
        while (self.dead is None and self.engine.has_unfinished_requests()
               and time.monotonic() < deadline):
            await asyncio.sleep(0.01)
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)
        if self.kv_events is not None:
            self.kv_events.close()
        self._let_go()

    def _let_go(self) -> None:
        """Another driver may run this engine now."""
        with _DRIVERS_LOCK:
            if _DRIVERS.get(self.engine) is self:
                del _DRIVERS[self.engine]

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Observed tokens per second of one running sequence (one token per step)."""
        return None if not self._step_s else 1.0 / self._step_s

    def restart_rate(self) -> None:
        """Forget cold-start steps (first-call overheads): keep only the latest one."""
        self._step_s = self._last_step_s

    # -- requests --------------------------------------------------------------------
    def generate(self, request_id: str, prompt: list[int] | EngineRequest,
                 params: SamplingParams | None = None,
                 reservation: Reservation | None = None) -> RequestStream:
        """Add the request now (``LLMEngine.add_request``: ``prompt`` is token ids with
        ``params``, or an ``EngineRequest``) and return the async iterator of its outputs;
        close it (``aclosing``) to abort an unfinished request.

        From this call on ``reservation`` is the engine's, the caller must not release it:
        if this raises (a dead or stopping engine, a duplicate id, a request the engine
        refuses) it has been released, else the engine releases it when the request
        finishes or is aborted.
        """
        refusal = None
        if self.dead is not None:
            refusal = EngineDeadError(f"the engine has stopped: {self.dead}")
        elif self._stopping.is_set():
            refusal = EngineDeadError("the engine is shutting down")
        elif request_id in self._streams:
            refusal = ValueError(f"duplicate request id {request_id!r}")
        if refusal is not None:
            if reservation is not None:  # refused before the engine saw it
                self.engine.ledger.release(reservation)
            raise refusal
        stream = RequestStream(self, request_id)
        self.engine.add_request(request_id, prompt, params, reservation)  # releases it if refused
        self._streams[request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Idempotent; the engine drops the request and its blocks at its next step."""
        if self.dead is not None:
            return
        self.engine.abort_request(request_id)
        self._wake.set()

    # -- the worker thread -----------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            started = time.perf_counter()
            prefilled = self.engine.num_prefill_tokens
            try:
                outputs = self.engine.step()
            except BaseException as exc:  # the engine is broken; fail everyone, loudly
                log.exception("engine step failed")
                self._loop.call_soon_threadsafe(self._fail_all, exc)
                return
            elapsed = time.perf_counter() - started
            tokens = sum(len(o.new_token_ids) for o in outputs)
            if tokens:
                self.steps, self.step_tokens = self.steps + 1, self.step_tokens + tokens
                self.step_seconds += elapsed
            computed = self.engine.num_prefill_tokens - prefilled + tokens
            if computed and self.on_step_tokens is not None:
                self.on_step_tokens(computed)
            if any(not o.finished and o.new_token_ids for o in outputs):
                self._last_step_s = elapsed
                self._step_s = (elapsed if self._step_s is None
                                else (1 - _EWMA) * self._step_s + _EWMA * elapsed)
            # Even an empty step may have released blocks (aborts), so always report.
            self._loop.call_soon_threadsafe(self._deliver, outputs)
            if self.kv_events is not None:  # the step's events, one batch (kv/events.py)
                self.engine.ledger.prefix_cache.events.seal()
            if not outputs and self.engine.stall_watch.idle_steps:
                # Nothing ran: only a new request, an abort or a release can change that.
                self._wake.wait(timeout=IDLE_STEP_WAIT_S)
                self._wake.clear()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.queue.put_nowait(output)
        if self.on_step_outputs is not None:
            self.on_step_outputs(outputs)

    def fail(self, exc: BaseException) -> None:
        """The engine is broken from outside its loop (a tensor-parallel rank is gone):
        stop the worker and fail every request as if a step had raised ``exc``."""
        self._stopping.set()
        self._wake.set()
        self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        """The worker has stopped: the engine releases every reservation it still held
        (streams closed with their abort still pending included); every stream fails."""
        self.dead = exc
        error = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
        try:
            self.engine.abort_all()
        except Exception:
            log.exception("releasing the dead engine's requests failed")
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        if self.on_step_outputs is not None:
            self.on_step_outputs([])
