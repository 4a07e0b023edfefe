"""Safe over-commitment (``--admission safe``): the banker's algorithm on the KV pool.

With ``--admission reserve`` (the default) every admitted request holds ``prompt + cap``
for its whole life, so at any moment every one of them could draw all it may still need.
That is a *safe* state, but not the only one. A state is safe when some order exists in
which each request, in turn, can draw everything it may still need from the blocks not in
use plus those given back by the ones before it (which reached their caps and released).
From a safe state the first request of such an order can always draw its next block and
the state stays safe, so if the engine grants a draw only when the state after it is safe
(else that request *pauses* for a step, keeping its blocks), every admitted request still
reaches its cap: nothing is preempted, nothing recomputed, and no request fails mid-decode.
The pool may then hold the tokens of more requests than their promises would allow.

Admitting every request the check allows would fill the pool with prompts that mostly
wait (measured: 16 running, most of them paused, a third of the reservation's goodput). So
admission asks more: the blocks every admitted request would hold, each decoding a token a
step until its cap and then releasing, must never exceed the pool (``peak_blocks``). Then
nobody pauses while the requests run as projected; the check above covers the rest (a
prompt that waited for a seat, a chunked prefill), so the guarantee never rests on the
projection.

With one kind of resource the check is a sort: taking the request that needs least first
never hurts (each release only adds blocks), so the state is safe iff that greedy order
works. A block several requests hold (a cached prefix) comes back with the last of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvledger.engine.kv.claims import blocks_for


@dataclass
class Claim:
    """A live request as the check sees it: ``need`` more blocks it may draw, the
    ``blocks`` it holds (shared ones too), and ``fresh`` blocks it would hold only it."""

    need: int
    blocks: Sequence[int] = ()
    fresh: int = 0


def completion_order_exists(unused_blocks: int, claims: Iterable[Claim],
                            ref_counts: Sequence[int], pins: Mapping[int, int] | None = None) -> bool:
    """Whether every claim can reach its cap in some order (see the module docstring).
    ``unused_blocks``: free and cached (evictable) blocks; ``ref_counts``: each block's
    holders now, plus ``pins`` more."""
    holders: dict[int, int] = {}
    pins = pins or {}
    available = unused_blocks
    for claim in sorted(claims, key=lambda c: c.need):
        if claim.need > available:
            return False
        available += claim.fresh  # the blocks it drew: its own until it releases them
        for block in claim.blocks:
            left = holders.get(block)
            if left is None:
                left = ref_counts[block] + pins.get(block, 0)
            holders[block] = left - 1
            if left == 1:
                available += 1
    return True


def peak_blocks(timelines: Iterable[tuple[int, int]], block_size: int) -> int:
    """The most blocks requests hold at once if each, from ``start`` tokens, writes a token a
    step until ``total`` (prompt + cap) and then releases: ``(start, total)`` per request. A
    request's blocks only grow until it releases, so the peak is at one's last step."""
    timelines = [(start, max(total - start, 1)) for start, total in timelines]
    peak = 0
    for last in {left - 1 for _, left in timelines}:
        held = sum(blocks_for(start + last + 1, block_size)
                   for start, left in timelines if left > last)
        peak = max(peak, held)
    return peak


class Overcommit:
    """The ledger's rules in ``--admission safe``: it tracks the live reservations (those
    it must keep able to finish) and the paused ones (refused a draw on their last try),
    and answers whether an admission, a draw or a pin keeps the state safe.

    Admission also needs the projected peak within the pool (``peak_blocks``), at most
    ``max_live`` reservations (the engine's ``max_num_seqs``: every admitted request has a
    seat, so the one that can finish is among those scheduled) and nobody paused (a paused
    request is not kept waiting by newer ones)."""

    def __init__(self, num_blocks: int, block_size: int, max_live: int | None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_live = max_live
        self.live: dict = {}      # Reservation -> [tokens held, prompt + cap]
        self.paused: set = set()
        self.refused_draws = 0    # a sequence paused for a step (kvledger_kv_draws_refused_total)

    def admits(self, in_use: int, outstanding: int, ref_counts: Sequence[int], count: int,
               need: int, hits: Sequence[int], revived: int, prompt_tokens: int,
               total_tokens: int) -> bool:
        """Whether ``count`` new reservations of ``total_tokens`` (prompt + cap), each
        drawing ``need`` blocks after pinning ``hits`` (``revived`` of them cached, held by
        none), may be admitted."""
        if self.paused or (self.max_live is not None and len(self.live) + count > self.max_live):
            return False
        if in_use + outstanding + need * count + revived <= self.num_blocks:
            return True  # every promise could be drawn at once
        timelines = [*self.live.values(), *[(prompt_tokens, total_tokens)] * count]
        if peak_blocks(timelines, self.block_size) > self.num_blocks:
            return False
        pins = {block: count for block in hits}
        new = [Claim(need, hits) for _ in range(count)]
        return self._safe_after(in_use + revived, ref_counts, pins, new, {})

    def may_draw(self, reservation, in_use: int, outstanding: int,
                 ref_counts: Sequence[int]) -> bool:
        """Whether ``reservation`` may draw one more block now."""
        if in_use + outstanding <= self.num_blocks:
            return True
        changed = {reservation: Claim(reservation.draws_left - 1, reservation.block_ids, 1)}
        return self._safe_after(in_use + 1, ref_counts, {}, [], changed)

    def admit(self, reservations: Sequence, prompt_tokens: int, total_tokens: int) -> None:
        for reservation in reservations:
            self.live[reservation] = [prompt_tokens, total_tokens]

    def advance(self, reservation, tokens: int) -> None:
        """``reservation`` now holds blocks for ``tokens`` tokens: it drew, so it is not paused."""
        self.paused.discard(reservation)
        timeline = self.live.get(reservation)
        if timeline is not None:
            timeline[0] = max(timeline[0], tokens)

    def forget(self, reservation) -> None:
        self.live.pop(reservation, None)
        self.paused.discard(reservation)

    def pause(self, reservation) -> None:
        """``reservation`` was refused a draw: it waits, and nobody new is admitted."""
        self.paused.add(reservation)
        self.refused_draws += 1

    def may_pin(self, reservation, blocks: Sequence[int], in_use: int,
                ref_counts: Sequence[int]) -> bool:
        """Whether ``reservation`` may pin cached ``blocks`` in place of as many draws."""
        revived = sum(1 for block in blocks if ref_counts[block] == 0)
        changed = {reservation: Claim(reservation.draws_left - len(blocks),
                                      [*reservation.block_ids, *blocks])}
        return self._safe_after(in_use + revived, ref_counts, dict.fromkeys(blocks, 1), [],
                                changed)

    def _safe_after(self, in_use: int, ref_counts: Sequence[int], pins: Mapping[int, int],
                    new: list[Claim], changed: Mapping) -> bool:
        claims = [changed.get(r) or Claim(r.draws_left, r.block_ids) for r in self.live]
        return completion_order_exists(self.num_blocks - in_use, claims + new, ref_counts, pins)
