"""The last line behind the progress guarantee of safe admission (``kv/safety.py``): the
engine has requests but none of them advances. By design that never lasts (the head of
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

import logging
import time
from collections.abc import Callable

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
