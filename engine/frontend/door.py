"""The one front door into the engine: ``FrontDoor.submit(Submission) -> Generation``.

Every request comes in here, from the HTTP server and from ``LLM``, and meets the
engine's rules once, in one order: its priority (``order.run_priority``), a full pool's
early refusal (before tokenizing), its prompt ids, its cap (``cap.output_cap``), its output
constraint compiled, its choices' parameters and ids, its adapter, whether the pool could
ever hold it; then admission's line reserves ``prompt + cap`` for each prompt's choices
and hands each reservation to the engine (``generation.Generation``). The door owns the
one ``Admission`` and the engine's driver thread, and wakes the line after every step.
Its refusals are the engine's errors (``kvledger.engine.errors``): the server maps them
to HTTP, ``LLM`` raises them. The server keeps HTTP: parsing, chat templates, SSE.
Anchors: vLLM v1's API server only calls ``AsyncLLM.generate`` (its input processor
checks, its scheduler admits); SGLang's tokenizer manager sends typed requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvledger.engine.admission.line import Admission
from kvledger.engine.admission.order import run_priority
from kvledger.engine.core.async_engine import AsyncEngine
from kvledger.engine.core.stall import LineWatch
from kvledger.engine.errors import UnknownModel
from kvledger.engine.frontend import checks
from kvledger.engine.frontend.constraints import Constraints
from kvledger.engine.frontend.generation import Generation
from kvledger.engine.frontend.line_options import LineOptions
from kvledger.engine.frontend.offload import Offload
from kvledger.engine.frontend.served import Served
from kvledger.engine.frontend.sleeping import SleepGate
from kvledger.engine.frontend.submission import PromptRun, Submission, Tenant
from kvledger.engine.planner.ready_time import WARMUP_STEPS
from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.settings.lora_config import LoRARequest

if TYPE_CHECKING:  # the engine pulls torch in
    from kvledger.engine.core.engine import LLMEngine

log = logging.getLogger(__name__)


class FrontDoor:
    """An engine's one way in. ``start`` (on the event loop) runs the engine's driver
    thread; ``LLM`` steps the engine itself (``run_offline``)."""

    def __init__(self, engine: LLMEngine, line: LineOptions | None = None,
                 offload: Offload | None = None) -> None:
        line = LineOptions() if line is None else line  # LLM's: no caps
        self.engine = engine
        self.line = line
        self.offload = offload
        self.driver: AsyncEngine | None = None  # once started
        self.served = Served(engine)  # what the server may read of the engine
        self.admission = Admission(
            engine.ledger, max_model_len=engine.max_model_len,
            max_queue_wait_s=line.max_queue_wait_s, max_queue_len=line.max_queue_len,
            max_num_seqs=engine.plan.max_num_seqs if engine.plan is not None else None,
            backfill=line.backfill, scheduling_policy=engine.config.scheduling_policy,
            headroom=engine.headroom, tenant_fairness=line.tenant_fairness,
            decode_tokens_per_s=lambda: self.decode_tokens_per_s)
        engine.scheduler.fair = line.tenant_fairness  # seats and prompt tokens too
        self.line_watch = LineWatch(self.admission, lambda: not engine.has_unfinished_requests())
        self._line_watching: asyncio.Task[None] | None = None
        self.constraints = Constraints(engine, line.grammar_compile_timeout_s,
                                       line.structured_outputs)
        # --enable-sleep-mode: who may come in while the engine sleeps (frontend/sleeping.py)
        self.sleep = (SleepGate(engine, lambda: bool(self.running or self.waiting))
                      if engine.config.enable_sleep_mode else None)

    # -- what it serves --------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The model's sampling defaults (its generation_config.json, ``--generation-config``)."""
        return self.engine.tokenizer.sampling_defaults

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name requests may use: the first is the one answers carry."""
        return (self.engine.model_name, *self.engine.config.served_model_aliases)

    def model(self, name: str) -> LoRARequest | None:
        """None for the base model (any of its names), else the ``LoRARequest`` of the
        adapter ``name`` names; UnknownModel when neither."""
        if name in self.model_names:
            return None
        served = {} if self.engine.loras is None else self.engine.loras.served
        if name in served:
            return served[name]
        raise UnknownModel(name, self.engine.model_name, len(served))

    # -- lifecycle (on the event loop) -------------------------------------------------
    async def start(self, *, warm: bool = True) -> None:
        """Run the engine's driver thread, wake the line after every step, watch the
        line for a stall; with ``warm``, one tiny request through the whole path."""
        self.driver = driver = AsyncEngine(self.engine)
        driver.on_step_outputs = lambda _: self.admission.capacity_changed(step=True)
        driver.start()
        self._line_watching = asyncio.create_task(self.line_watch.run())
        if warm:
            ready = self.engine.runner.time_to_ready  # what the start took, warm-up too
            with ready.phase("warmup") if ready is not None else contextlib.nullcontext():
                await self._warm_up()
            if ready is not None:
                log.info("%s", ready.describe())

    @property
    def time_to_ready(self) -> dict[str, Any] | None:
        """The start's phases, predicted and measured (``planner/ready_time.py``)."""
        ready = self.engine.runner.time_to_ready
        return None if ready is None else ready.to_json()

    async def _warm_up(self) -> None:
        """One tiny greedy request; its last (warm) decode step seeds the decode rate that
        Retry-After estimates use."""
        ids = self.tokenizer.encode("Hello", add_special_tokens=True)[:8] or [0]
        params = SamplingParams(temperature=0.0, max_tokens=WARMUP_STEPS, ignore_eos=True)
        reservation = self.engine.ledger.try_reserve(len(ids) + WARMUP_STEPS)
        async for _ in self.driver.generate("kvledger-warmup", ids, params, reservation):
            pass
        self.driver.restart_rate()

    def close(self, error: Exception) -> None:
        """Stop admitting: waiters in line and new requests get ``error``."""
        self.admission.close(error)

    @property
    def running(self) -> int:
        """Admitted requests not yet done."""
        return len(self.admission.running)

    @property
    def waiting(self) -> int:
        """Requests in line for a reservation."""
        return self.admission.queue_length

    def waiting_by_tenant(self) -> dict[str, int]:
        """Requests in line, by tenant label."""
        return self.admission.waiting_by_tenant()

    @property
    def backfilled(self) -> int:
        """Requests admitted ahead of the line (``--backfill``)."""
        return self.admission.backfilled

    async def drain(self, grace_s: float) -> None:
        """Once ``close``d: give admitted requests ``grace_s`` to finish, abort the rest,
        and stop the driver; their streams end with ``abort``."""
        deadline = time.monotonic() + grace_s
        while self.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.running:
            log.warning("aborting %d requests still running after the %.0fs grace",
                        self.running, grace_s)
        await self.driver.stop()
        deadline = time.monotonic() + 5.0  # their handlers see the aborts and finish
        while self.running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        """Stop the driver and the line's watch; drop the constraints' compiler."""
        if self._line_watching is not None:
            self._line_watching.cancel()
        if self.driver is not None:
            await self.driver.stop()
        self.constraints.close()

    def fail(self, reason: str) -> None:
        """A rank is gone (``-tp``, ``-pp``, another machine's): every request fails."""
        from kvledger.engine.core.ranks import RankLost

        self.driver.fail(RankLost(reason))

    @property
    def dead(self) -> BaseException | None:
        """Why the engine's loop stopped, or None while it runs."""
        return None if self.driver is None else self.driver.dead

    @property
    def stalled(self) -> str | None:
        """Why the engine or the line is stuck by a bug, for ``/health``; None if neither."""
        for watch in (self.engine.stall_watch, self.line_watch):
            if watch.stalled:
                return watch.describe()
        return None

    @property
    def decode_tokens_per_s(self) -> float | None:
        return None if self.driver is None else self.driver.decode_tokens_per_s

    def reset_prefix_cache(self) -> int:
        """Nothing cached is found again (vLLM's ``reset_prefix_cache``): the blocks no
        running request holds are freed (how many is returned); those running requests
        hold stay theirs until released."""
        ledger = self.engine.ledger
        dropped = ledger.prefix_cache.reset()
        if ledger.prefix_cache.events is not None:  # its AllBlocksCleared goes now, not after a next step
            ledger.prefix_cache.events.seal()
        return dropped

    def queue_status(self) -> dict[str, Any]:
        """The line as ``/v1/budget`` shows it."""
        admission = self.admission
        return {"waiting": self.waiting, "running": self.running,
                "max_queue_wait_s": admission.max_queue_wait_s,
                "max_queue_len": admission.max_queue_len, "backfill": admission.backfill,
                "backfilled": self.backfilled}

    # -- a request -----------------------------------------------------------------
    async def submit(self, sub: Submission) -> Generation:
        """``sub`` checked, every prompt admitted and handed to the engine: its
        ``Generation`` (iterate it for ``(choice, output)``; ``aclose`` it whatever
        happens). Raises the engine's errors: BadInput (UnknownModel, PromptTooLong,
        CapTooLarge, PoolTooSmall, BadConstraint...) for a request that cannot run here,
        KVCacheFull (with its wait) for one the pool cannot hold now, EngineDeadError,
        EngineSleeping. Nothing is held once it raises."""
        with self.sleep.entry() if self.sleep is not None else contextlib.nullcontext():
            return await self._submit(sub)

    async def _submit(self, sub: Submission) -> Generation:
        sub = checks.constrained(sub)
        priority = run_priority(self.admission.scheduling_policy, sub.tenant, sub.priority,
                                sub.objective_priority)
        longest = max(checks.max_prompt_tokens(prompt) for prompt in sub.prompts)
        early = self.admission.early_rejection(longest, sub.params.max_tokens, sub.n,
                                               sub.tenant, priority)
        if early is not None:  # a full pool refuses it whatever its exact length
            raise early
        ids = await self.offload.run(sub.body_bytes, checks.encode_all, self.engine, sub)
        caps = checks.caps(self.engine, sub, ids)
        grammar = None if sub.grammar is None else await self.constraints.compile(sub.grammar)
        if grammar is not None and sub.grammar_gate is not None:
            grammar = sub.grammar_gate.over(grammar, ids)
        params = checks.choice_params(self.engine, sub, caps, grammar)
        adapter = None if sub.lora is None else await self.offload.load_adapter(
            self.engine.resolve_lora, sub.lora)
        runs = checks.prompt_runs(self.engine, sub, ids, caps, params, adapter, priority,
                                  self.admission.headroom)
        generation = Generation(self.admission, self.driver, self.engine.ledger.block_size,
                                sub.request_id, runs, sub.n, sub.tenant)
        try:
            await generation.admit(checks.cache_salt(sub, runs), priority)
        except BaseException:
            await generation.aclose()
            raise
        return generation

    def prepare(self, sub: Submission) -> PromptRun:
        """``LLM``'s one-prompt submission checked in this thread, as ``submit`` checks it
        (no early refusal: its line has no cap; its constraint compiled in this thread);
        admitted later by ``run_offline``."""
        sub = checks.constrained(sub)
        priority = run_priority(self.admission.scheduling_policy, sub.tenant, sub.priority,
                                sub.objective_priority)
        ids = checks.encode_all(self.engine, sub)
        caps = checks.caps(self.engine, sub, ids)
        grammar = None if sub.grammar is None else self.constraints.compile_now(sub.grammar)
        params = checks.choice_params(self.engine, sub, caps, grammar)
        adapter = self.engine.resolve_lora(sub.lora)
        (run,) = checks.prompt_runs(self.engine, sub, ids, caps, params, adapter, priority,
                                     self.admission.headroom)
        return run

    def run_offline(self, runs: dict[str, PromptRun],
                    on_finished: Callable[[Any], None] | None = None) -> dict[str, Any]:
        """``LLM``'s runs to the end, stepping the engine in this thread (``offline``;
        ``on_finished`` told of each run's final output as it comes)."""
        from kvledger.engine.frontend.offline import run_to_end

        return run_to_end(self.engine, self.admission, runs, on_finished)


def load_engine(config: Any) -> LLMEngine:
    """Plan, load and allocate the engine ``config`` declares (``LLMEngine.from_config``):
    DoesNotFit with the plan's report, BadInput for a checkpoint it cannot run."""
    from kvledger.engine.core.engine import LLMEngine

    return LLMEngine.from_config(config)


__all__ = ["FrontDoor", "LineOptions", "Submission", "Tenant", "load_engine"]
