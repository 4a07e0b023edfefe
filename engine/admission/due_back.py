"""When the running requests give their blocks back: in engine steps, for backfilling the
admission line (``projection``), and in seconds, for a refusal's wait, the server's
Retry-After (``seconds_until_freed``, ``jittered_wait_s``).

Backfilling (``--backfill``, off by default). While the head of the line waits for blocks
to come back, some of the pool sits idle. With backfilling, ``Admission`` plans the first
``BACKFILL_DEPTH`` requests in line, in line order, each at the soonest step it could start
in the pool's projected holdings around the plans before it (``kv/projection.py``:
admission's own projection, every request writing a token a step until its cap), and
starts one whose plan is now: batch schedulers call this conservative backfilling. A
request that goes ahead only takes room no earlier plan uses, so, counted in engine steps,
none of those before it starts later than planned (requests that stop early only bring
the plans closer); one further back may. Not while ``max_num_seqs`` requests are
admitted: one waiting for a seat would not decode a token a step.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable, Sequence
from typing import Protocol

from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.kv.projection import Projection
from kvledger.engine.kv.reservation import Reservation

MAX_RETRY_AFTER_S = 60.0  # past this a client should go elsewhere, not wait
JITTER_FRACTION = 0.25


class Holder(Protocol):
    """A running request as these estimates see it (``Ticket`` is one): the reservations it
    holds and the tokens it may still write before its cap."""

    @property
    def reservations(self) -> Sequence[Reservation]: ...

    @property
    def remaining_tokens(self) -> int: ...


def first_covering(due: list[tuple[float, Holder]], deficit: int,
                   ledger: KVLedger) -> float | None:
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


def projection(ledger: KVLedger, running: Iterable[Holder]) -> Projection:
    """The pool's holdings over the steps ahead, as admission projects them: over-committing,
    the ledger's live reservations, each drawing as it writes; reserving, each ``running``
    ticket's reservation until its cap, counted with what its release really frees (soonest
    first; the rest, such as a prefix a request outside them pins, is held beyond)."""
    timelines = ledger.timelines()
    if timelines is not None:
        plan = Projection(ledger.num_blocks, ledger.block_size, grows=True)
        plan.add_growing(timelines)
        return plan
    tickets = sorted(running, key=lambda ticket: ticket.remaining_tokens)
    returned = ledger.blocks_returned([ticket.reservations for ticket in tickets])
    plan = Projection(ledger.num_blocks, ledger.block_size, grows=False,
                      held_beyond=ledger.reserved_blocks - sum(returned))
    plan.add_flat(returned, [ticket.remaining_tokens for ticket in tickets])
    return plan


def seconds_until_freed(deficit: int, tickets: list[Holder], ledger: KVLedger, rate: float,
                        max_num_seqs: int | None) -> float:
    """Seconds until ``deficit`` blocks are back: ``tickets`` (in admission order) reach
    their caps at ``rate`` tokens/s each, at most ``max_num_seqs`` decoding at a time in
    that order (the engine's own FIFO), taken soonest first; the last return when they
    never cover it (blocks held outside these tickets), 1 s when nothing runs."""
    slots = [0.0] * min(max_num_seqs or len(tickets), len(tickets))
    due: list[tuple[float, Holder]] = []
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


def jittered_wait_s(wait_s: float, rng: random.Random) -> float:
    """A refusal's wait: ``wait_s`` plus up to ``JITTER_FRACTION`` of it and 0.05-0.25 s (so
    clients told the same do not come back together, those told ~0 included), at most
    ``MAX_RETRY_AFTER_S``. (The server writes it as Retry-After, ``api_errors.retry_headers``.)"""
    jittered = wait_s * (1.0 + rng.uniform(0.0, JITTER_FRACTION))
    return min(jittered + rng.uniform(0.05, 0.25), MAX_RETRY_AFTER_S)
