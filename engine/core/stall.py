"""The last line behind the progress guarantee of safe admission (``kv/safety.py``): the
engine has requests but none of them advances (``StallWatch``), or requests wait in
admission's line while the engine holds none and nobody is let in (``LineWatch``). By design that never lasts (the head of
the safety check's order is run first every step), so a stall is a bug: it is logged
once, loudly, with the ledger's state; ``/health`` answers 503 while it lasts, so
Kubernetes restarts the pod instead of it hanging silently; ``kvledger_engine_stalled``
and ``kvledger_engine_stalls_total`` count it.

A stall is ``min_steps`` steps in a row and ``min_seconds`` of them in which requests
were in the engine and no token was computed; both, so that neither a fast empty loop
nor one slow step raises it. A request the server is still handing over can head the
order for a moment: that is well under either threshold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvledger.engine.admission.line import Admission

log = logging.getLogger("kvledger.engine")

STALL_STEPS = 100
STALL_SECONDS = 20.0  # the engine's liveness probe then restarts the pod within 30 s more


class StallWatch:
    """Fed one ``observe`` per engine step; ``stalled`` while steps with work compute
    nothing, from the thresholds on until a step computes a token again."""

    def __init__(self, min_steps: int = STALL_STEPS, min_seconds: float = STALL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.min_steps = min_steps
        self.min_seconds = min_seconds
        self._clock = clock
        self.idle_steps = 0             # steps in a row with work and no token computed
        self.idle_since: float | None = None
        self.stalled = False
        self.stalls = 0                 # times it became stalled (kvledger_engine_stalls_total)

    def observe(self, progressed: bool, has_work: bool, state: Callable[[], str] = str) -> bool:
        """Record a step; True on the step the engine becomes stalled, which is logged then
        as one ERROR line with ``state()`` (the engine's queues and ledger)."""
        if progressed or not has_work:
            self.idle_steps, self.idle_since, self.stalled = 0, None, False
            return False
        now = self._clock()
        if self.idle_since is None:
            self.idle_since = now
        self.idle_steps += 1
        if self.stalled or self.idle_steps < self.min_steps or (
                now - self.idle_since < self.min_seconds):
            return False
        self.stalled, self.stalls = True, self.stalls + 1
        log.error("engine stalled: %s while %s", self.describe(), state())
        return True

    def describe(self) -> str:
        seconds = 0.0 if self.idle_since is None else self._clock() - self.idle_since
        return f"no request has progressed for {self.idle_steps} steps ({seconds:.1f} s)"


LINE_CHECK_S = 1.0  # how often the server looks at the line
LINE_STALL_CHECKS = 5  # looks at a stuck line, at least, before it is called stalled


class LineWatch:
    """The admission line's stall: requests wait in line while the engine holds none, so
    nothing it runs will give blocks back and the whole pool is there for them, yet no
    request is admitted. By design that never lasts: a request that fits an idle engine is
    admitted as it joins, and every release wakes the line; so it is a bug (a wake-up
    lost, a grant that never reached the engine), made as loud as ``StallWatch``'s.

    ``observe`` counts the looks at a line with waiters and an idle engine since the last
    admission, and the time since the first of them; only an admission resets them. A
    line that empties because its waiters' ``--max-queue-wait`` ran out did not move, so
    it keeps them: the next waiters, stuck as well, complete the count.
    """

    def __init__(self, admission: Admission, engine_idle: Callable[[], bool],
                 min_checks: int = LINE_STALL_CHECKS, min_seconds: float = STALL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.admission = admission
        self.engine_idle = engine_idle
        self.min_checks = min_checks
        self.min_seconds = min_seconds
        self.interval_s = LINE_CHECK_S  # between two looks (``run``)
        self._clock = clock
        self._granted = admission.granted
        self.stuck_checks = 0
        self.stuck_since: float | None = None
        self.stalled = False
        self.stalls = 0  # times it became stalled (kvledger_line_stalls_total)

    def observe(self) -> bool:
        """Look at the line once; True when it becomes stalled (logged then, one ERROR
        line with the line's length and the pool's free blocks)."""
        if self.admission.granted != self._granted:  # it moved
            self._granted = self.admission.granted
            self.stuck_checks, self.stuck_since, self.stalled = 0, None, False
        waiting = self.admission.queue_length
        if not waiting or not self.engine_idle():
            return False
        now = self._clock()
        if self.stuck_since is None:
            self.stuck_since = now
        self.stuck_checks += 1
        if self.stalled or self.stuck_checks < self.min_checks or (
                now - self.stuck_since < self.min_seconds):
            return False
        self.stalled, self.stalls = True, self.stalls + 1
        log.error("admission line stalled: %s; %d KV blocks of %d free", self.describe(),
                  self.admission.ledger.free_blocks, self.admission.ledger.num_blocks)
        return True

    def describe(self) -> str:
        seconds = 0.0 if self.stuck_since is None else self._clock() - self.stuck_since
        return (f"{self.admission.queue_length} requests wait in line and none has been "
                f"admitted for {seconds:.1f} s while the engine holds none")

    async def run(self) -> None:
        """``observe`` every ``interval_s`` on the event loop (admission's thread) until
        cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.observe()
