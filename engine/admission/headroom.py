"""Headroom without preemption (``--priority-headroom``): a share of the KV pool and of
the engine's seats that only urgent requests (priority at most ``--headroom-priority``)
may take.

Best-effort requests are admitted only while the state stays safe *without* the headroom:
with ``--admission reserve``, their promises fit in the pool less the kept blocks; with
``--admission safe``, the banker's check holds in the pool less the kept blocks and the
seats less the kept seats, every admitted request counted (an urgent one using the
headroom too, so best-effort ones wait while it runs). Safety is monotone in the
resources, so that state is safe in the whole pool as well: no admitted request, urgent
or not, can strand, and nothing is preempted. An urgent request is checked against the
whole pool: while the headroom is free it is admitted at once, and the scheduler seats
best-effort requests only while the kept seats stay free, so it is seated at the next
step. The cost is best-effort throughput: the headroom idles while no urgent request
needs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Headroom:
    """``blocks`` of the pool and ``seats`` of the engine's that requests of priority above
    ``priority`` may not take."""

    blocks: int = 0
    seats: int = 0
    priority: int = 0

    @classmethod
    def of(cls, share: float, priority: int, num_blocks: int, max_num_seqs: int) -> Headroom:
        """``share`` of ``num_blocks`` and of ``max_num_seqs`` (rounded up, so any share
        keeps something), always leaving best-effort requests a block and a seat."""
        if not share:
            return NO_HEADROOM
        return cls(min(num_blocks - 1, math.ceil(share * num_blocks)),
                   min(max_num_seqs - 1, math.ceil(share * max_num_seqs)), priority)

    def kept_from(self, priority: int) -> tuple[int, int]:
        """The blocks and seats a request of ``priority`` may not take."""
        return (0, 0) if priority <= self.priority else (self.blocks, self.seats)

    def describe(self) -> str:
        return (f"{self.blocks} KV blocks and {self.seats} seats kept for requests of "
                f"priority <= {self.priority} (--priority-headroom)")


NO_HEADROOM = Headroom()
