"""When the running requests give their blocks back: in engine steps, for backfilling the
admission line, and in seconds, for Retry-After (``seconds_until_freed``).

Backfilling (``--backfill``, off by default). While the head of the line waits for blocks to come back, the ones already free sit idle.
With backfilling a later request may go ahead of the line (as batch schedulers backfill)
when it fits in them now and will have finished, at one token per engine step, before the
head can start: the head's start is the step by which the running requests, each decoding
its remaining cap at a token a step, have given back what it lacks (a lower bound; a
request that stops early only brings it closer). So, counted in steps, nobody in line
starts later than without backfilling; a request that cannot finish in time waits its
turn. Counted in seconds they can: each step is slower with more requests in it, and under
bench/serving.py's overload backfilling cut the short requests' latency by 3.5x but raised
the p99 by 29%, made latency depend on the size of the promise, and did not raise goodput;
strict FIFO stays the default. A long prompt's prefill takes a step per
``prefill_tokens_per_step`` (the engine's token budget); ``Admission`` stops backfilling
while ``max_num_seqs`` requests are admitted, since one waiting for a seat would not decode
at that rate.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from typing import Any


def steps_to_finish(prompt_tokens: int, cap_tokens: int,
                    prefill_tokens_per_step: int | None) -> int:
    """Engine steps a request takes once started: its prefill chunks, the first of which
    yields its first token, then a step per further token."""
    if not prefill_tokens_per_step:
        return cap_tokens
    return cap_tokens + math.ceil(prompt_tokens / prefill_tokens_per_step) - 1


def first_covering(due: list[tuple[float, Any]], deficit: int, ledger: Any) -> float | None:
    """The time of the release, in ``due`` ((time, ticket), soonest first), by which
    ``deficit`` blocks have come back, each release counted with what it really frees (a
    block shared with a later finisher, such as a cached prefix several chats pinned,
    comes back with the last of them); None when they never do (blocks held outside
    these tickets)."""
    returned = ledger.blocks_returned([ticket.reservations for _, ticket in due])
    freed = 0
    for (when, _), blocks in zip(due, returned, strict=True):
        freed += blocks
        if freed >= deficit:
            return when
    return None


def head_start_step(head_blocks: int, ledger: Any, running: Iterable[Any]) -> int | None:
    """The soonest step at which ``head_blocks`` can be reserved, if the ``running``
    tickets decode their remaining caps at a token a step; None when that cannot be told
    (blocks held outside those tickets)."""
    deficit = head_blocks - ledger.free_blocks
    if deficit <= 0:
        return 0
    due = sorted(((t.remaining_tokens, t) for t in running), key=lambda item: item[0])
    return first_covering(due, deficit, ledger)


def seconds_until_freed(deficit: int, tickets: list[Any], ledger: Any, rate: float,
                        max_num_seqs: int | None) -> float:
    """Seconds until ``deficit`` blocks are back: ``tickets`` (in admission order) reach
    their caps at ``rate`` tokens/s each, at most ``max_num_seqs`` decoding at a time in
    that order (the engine's own FIFO), taken soonest first; the last return when they
    never cover it (blocks held outside these tickets), 1 s when nothing runs."""
    slots = [0.0] * min(max_num_seqs or len(tickets), len(tickets))
    due = []
    for ticket in tickets:
        start = heapq.heappop(slots)
        end = start + ticket.remaining_tokens / rate
        heapq.heappush(slots, end)
        due.append((end, ticket))
    due.sort(key=lambda item: item[0])
    seconds = first_covering(due, deficit, ledger)
    if seconds is not None:
        return seconds
    return due[-1][0] if due else 1.0
