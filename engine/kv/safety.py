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

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass
class Claim:
    """A live request as the check sees it: ``need`` more blocks it may draw, the
    ``blocks`` it holds (shared ones too), and ``fresh`` blocks it would hold only it."""

    need: int
    blocks: Sequence[int] = ()
    fresh: int = 0


def completion_margin(unused_blocks: int, claims: Sequence[Claim], ref_counts: Sequence[int],
                      pins: Mapping[int, int] | None = None,
                      shared: set[int] | None = None) -> int | None:
    """The least slack of the smallest-need-first order: the fewest blocks any claim would
    find beyond its need on its turn, or None when some claim would not find its need (the
    state is not safe; see the module docstring). ``unused_blocks``: free and cached
    (evictable) blocks; ``ref_counts``: each block's holders now, plus ``pins`` more;
    ``shared``: the blocks held more than once (the pool keeps them; found when None).
    A block only one claim holds comes back with it: counted, not followed.

    One draw lowers every claim's slack by at most one (the claims before the drawer in
    the order find one block fewer; the drawer needs one fewer; those after it get the
    block back with it), so a state whose margin is ``m`` stays safe for ``m`` more draws
    by anyone, in any order, with nothing checked (``Overcommit.may_draw``)."""
    pins = pins or {}
    if shared is None:
        shared = {block for claim in claims for block in claim.blocks if ref_counts[block] > 1}
    several = shared.union(pins) if pins else shared  # the rest have one claim alone
    # Claims holding the same shared blocks (one system prompt's) form a group: its blocks
    # lose the group's holds when its last member has gone, none of them sooner.
    keyed = [(claim, frozenset(several.intersection(claim.blocks)) if several else _NONE)
             for claim in claims]
    members = Counter(key for _, key in keyed)
    left = dict(members)
    holders: dict[int, int] = {}
    available = margin = unused_blocks
    for claim, key in sorted(keyed, key=lambda pair: pair[0].need):
        if claim.need > available:
            return None
        margin = min(margin, available - claim.need)
        # What it drew (``fresh``: its own until it releases it) and what it alone holds.
        available += claim.fresh + len(claim.blocks) - len(key)
        if not key:
            continue
        left[key] -= 1
        if left[key]:
            continue
        for block in key:
            held = holders.get(block, ref_counts[block] + pins.get(block, 0)) - members[key]
            holders[block] = held
            available += held == 0
    return margin


_NONE: frozenset[int] = frozenset()


def completion_order_exists(unused_blocks: int, claims: Sequence[Claim],
                            ref_counts: Sequence[int], pins: Mapping[int, int] | None = None) -> bool:
    """Whether every claim can reach its cap in some order (see the module docstring)."""
    return completion_margin(unused_blocks, claims, ref_counts, pins) is not None


def peak_blocks(timelines: Iterable[Sequence[int]], block_size: int) -> int:
    """The most blocks requests hold at once if each, from ``start`` tokens, writes a token a
    step until ``total`` (prompt + cap) and then releases: ``(start, total)`` per request,
    or ``(start, total, less)`` for one that holds ``less`` of them with another (a choice
    pinning the prompt blocks its request's first choice computes). A request's blocks
    only grow until it releases, so the peak is at one's last step.

    One sweep over those steps, latest first, adding each request as the step reaches its
    life (O(n log n + n * block_size), not O(n^2)): at step ``t`` a request from ``start``
    holds ``ceil((start + t + 1) / bs)`` blocks, which with ``c = start + bs`` is
    ``c // bs + t // bs``, plus one when ``c % bs + t % bs >= bs``; so the live requests'
    sum needs only their count, the sum of ``c // bs - less`` and how many have each
    ``c % bs``."""
    bs = block_size
    # One at its cap holds it for a last step: from total - 1, it writes its last token.
    starts = [(min(t[0], t[1] - 1), t[1], t[2] if len(t) > 2 else 0) for t in timelines]
    lives = sorted(((total - start, start, less) for start, total, less in starts), reverse=True)
    residues = [0] * bs
    whole = peak = 0
    for live, (left, start, less) in enumerate(lives, 1):  # it lives for steps 0 .. left - 1
        whole += (start + bs) // bs - less
        residues[(start + bs) % bs] += 1
        last = left - 1  # the next request's last step is no later: add before it counts
        held = whole + live * (last // bs) + (sum(residues[bs - last % bs:]) if last % bs else 0)
        peak = max(peak, held)
    return peak


class Overcommit:
    """The ledger's rules in ``--admission safe``: it tracks the live reservations (those
    it must keep able to finish) and the paused ones (refused a draw on their last try),
    and answers whether an admission, a draw or a pin keeps the state safe.

    An admission that over-commits also needs the projected peak within the pool
    (``peak_blocks``) and at most ``max_live`` reservations (the engine's ``max_num_seqs``:
    every admitted request has a seat, so the one that can finish is among those
    scheduled); none is admitted while one is paused (it is not kept waiting by newer
    ones)."""

    def __init__(self, num_blocks: int, block_size: int, max_live: int | None,
                 pool=None) -> None:
        self.num_blocks = num_blocks
        self.pool = pool  # the ledger's BlockPool (its ``shared`` blocks, for ``may_share``)
        self.block_size = block_size
        self.max_live = max_live
        self.live: dict = {}      # Reservation -> [tokens held, prompt + cap, held with another]
        self.paused: set = set()
        self.refused_draws = 0    # a sequence paused for a step (kvledger_kv_draws_refused_total)
        self.refusal = ""         # why the last admission was refused (AdmissionRejected)
        # Draws the last full check proved safe (its margin), and those granted since: a
        # draw is checked only once they are spent; an admission or a pin voids them.
        self._slack: int | None = None
        self._spent = 0

    def admits(self, in_use: int, outstanding: int, ref_counts: Sequence[int], count: int,
               need: int, hits: Sequence[int], revived: int, prompt_tokens: int,
               total_tokens: int, shared: int = 0) -> bool:
        """Whether ``count`` new reservations of ``total_tokens`` (prompt + cap), each
        drawing ``need`` blocks after pinning ``hits`` (``revived`` of them cached, held by
        none), may be admitted; all but the first will pin ``shared`` prompt blocks the
        first computes (each is checked as if it drew them, until it pins them:
        ``may_share``). ``refusal`` says why not."""
        live = len(self.live)
        if self.paused:
            self.refusal = "a running request is paused for its next KV block"
        elif in_use + outstanding + need * count - shared * (count - 1) + revived <= self.num_blocks:
            return True  # every promise could be drawn at once: any order finishes
        elif self.max_live is not None and live + count > self.max_live:
            self.refusal = (f"{live} requests are admitted, at most {self.max_live} over-committed "
                            "(--max-num-seqs)")
        else:
            timelines = [*self.live.values(), (prompt_tokens, total_tokens, 0),
                         *[(prompt_tokens, total_tokens, shared)] * (count - 1)]
            peak = peak_blocks(timelines, self.block_size)
            pins = {block: count for block in hits}
            new = [Claim(need, hits) for _ in range(count)]
            if peak > self.num_blocks:
                self.refusal = (f"run to their caps, the admitted requests and this one would "
                                f"hold {peak} blocks at once, more than the pool's {self.num_blocks}")
            elif not self._safe_after(in_use + revived, ref_counts, pins, new, {}):
                self.refusal = "admitting it could leave an admitted request unable to reach its cap"
            else:
                return True
        return False

    def may_draw(self, reservation, in_use: int, outstanding: int,
                 ref_counts: Sequence[int]) -> bool:
        """Whether ``reservation`` may draw one more block now (the caller then draws it).
        Checked in full only when the draws the last check proved safe are spent
        (``completion_margin``), so over-committed a draw costs O(1) in the main."""
        if in_use + outstanding <= self.num_blocks or (
                self._slack is not None and self._spent < self._slack):
            self._spent += 1
            return True
        changed = {reservation: Claim(_need(reservation) - 1, reservation.block_ids, 1)}
        margin = self._margin_after(in_use + 1, ref_counts, {}, [], changed)
        self._slack, self._spent = margin, 0
        return margin is not None

    def admit(self, reservations: Sequence, prompt_tokens: int, total_tokens: int,
              shared: int = 0) -> None:
        self._slack = None
        for i, reservation in enumerate(reservations):
            self.live[reservation] = [prompt_tokens, total_tokens, shared if i else 0]

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
        changed = {reservation: Claim(_need(reservation) - len(blocks),
                                      [*reservation.block_ids, *blocks])}
        self._slack = None
        return self._safe_after(in_use + revived, ref_counts, dict.fromkeys(blocks, 1), [],
                                changed)

    def may_share(self, reservation, blocks: Sequence[int]) -> bool:
        """Whether a choice awaiting its request's shared prompt ``blocks`` (in use: the
        first choice computed them) may pin them. Until now it was checked as if it would
        draw them; holding them with the first choice, they come back with the later of
        the two, which may leave a request between them short. If not, it draws its own
        (the same claim as before: nothing changes) and is projected so."""
        pool = self.pool
        if pool.num_in_use + sum(r.draws_left for r in self.live) <= self.num_blocks:
            return True  # every promise can be drawn at once (as reserving), shares kept
        changed = {reservation: Claim(reservation.draws_left, [*reservation.block_ids, *blocks])}
        self._slack = None
        if self._safe_after(pool.num_in_use, pool.ref_counts, dict.fromkeys(blocks, 1), [],
                            changed):
            return True
        self.live[reservation][2] = 0
        return False

    def _safe_after(self, in_use: int, ref_counts: Sequence[int], pins: Mapping[int, int],
                    new: list[Claim], changed: Mapping) -> bool:
        return self._margin_after(in_use, ref_counts, pins, new, changed) is not None

    def _margin_after(self, in_use: int, ref_counts: Sequence[int], pins: Mapping[int, int],
                      new: list[Claim], changed: Mapping) -> int | None:
        claims = [changed.get(r) or Claim(_need(r), r.block_ids) for r in self.live]
        shared = self.pool.shared if self.pool is not None else None
        return completion_margin(self.num_blocks - in_use, claims + new, ref_counts, pins, shared)


def _need(reservation) -> int:
    """What a live reservation may still draw, counting the shared prompt blocks it awaits
    as draws (it may yet compute them itself: ``Overcommit.may_share``)."""
    return reservation.draws_left + reservation.awaited_blocks
