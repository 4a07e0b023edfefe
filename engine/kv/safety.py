"""Safe over-commitment (``--admission safe``): the banker's algorithm on the KV pool, the
engine's seats and its LoRA adapter slots.

With ``--admission reserve`` every admitted request holds ``prompt + cap`` for its whole
life, so at any moment every one of them could draw all it may still need. That is a
*safe* state, but not the only one. A state is safe when some order exists in which each
request, in turn, can get everything it may still need: its blocks from those not in use
plus those given back by the ones before it (which reached their caps and released), and,
if it is not running yet, a seat (``max_num_seqs``) and a slot for its LoRA adapter
(``--max-loras``), from those free plus those the ones before it gave back. The engine
grants a draw, a seat or a pinned prefix only when the state after it is safe, else that
request *pauses* (keeping its blocks) or waits for its seat.

Safety alone is not progress: the request that can finish must also be *run*. In a safe
state some request can get all it may still need now (the first of the order), and any
such request can go first (finishing only gives back, so the rest of the order still
works after it). So every step the scheduler runs one of them first (``Overcommit.head``):
it seats it if it waits, gives it a slot for its adapter (the check counted one), and
lets it draw before anyone else, so its draws are safe, and its prompt tokens before any
other prompt's. A head thus progresses every step until it finishes, and every admitted
request reaches its cap: nothing is preempted, nothing recomputed, and no request fails
mid-decode. The pool may hold the tokens of more requests than their promises would
allow.

Admitting every request the check allows would fill the pool with prompts that mostly
wait (measured: 16 running, most of them paused, a third of the reservation's goodput). So
admission asks more: the blocks every admitted request would hold, each decoding a token a
step until its cap and then releasing, must never exceed the pool (``peak_blocks``). Then
few pause while the requests run as projected. The projection only keeps pauses rare: the
guarantee rests on the check and the head alone (tests switch the projection off).

The check itself, pure arithmetic on what each request holds and needs, is ``banker.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvledger.engine.kv.banker import Claim, completion_margin


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
    answers whether an admission, a draw, a pin or a seat keeps the state safe, and names
    the request to run first (``head``).

    An admission that over-commits also needs the projected peak within the pool
    (``peak_blocks``) and at most ``max_live`` reservations (the engine's
    ``max_num_seqs``); none is admitted while one is paused (it is not kept waiting by
    newer ones). ``max_adapters``: the engine's LoRA slots (``--max-loras``; None without
    LoRA)."""

    def __init__(self, num_blocks: int, block_size: int, max_live: int | None,
                 pool=None, max_adapters: int | None = None) -> None:
        self.num_blocks = num_blocks
        self.pool = pool  # the ledger's BlockPool (its ``shared`` blocks, for ``may_share``)
        self.block_size = block_size
        self.max_live = max_live
        self.max_adapters = max_adapters
        self.live: dict = {}      # Reservation -> [tokens held, prompt + cap, held with another]
        self.paused: set = set()
        # Choices projected as holding their prompt's shared blocks with another: by the
        # one projected as holding them (``live[...][2] == 0``), which hands that to the
        # next of them when it goes.
        self._sharers: dict = {}
        self.refused_draws = 0    # a sequence paused for a step (kvledger_kv_draws_refused_total)
        self.refusal = ""         # why the last admission was refused (AdmissionRejected)
        # Draws the last full check proved safe (its margin), and those granted since: a
        # draw is checked only once they are spent; an admission, a pin or a seat voids them.
        self._slack: int | None = None
        self._spent = 0

    def admits(self, in_use: int, outstanding: int, ref_counts: Sequence[int], count: int,
               need: int, hits: Sequence[int], revived: int, prompt_tokens: int,
               total_tokens: int, shared: int = 0, adapter: object | None = None, *,
               kept: tuple[int, int] = (0, 0)) -> bool:
        """``_admits`` in the pool less ``kept`` (blocks, seats): a best-effort request
        under ``--priority-headroom`` is admitted only while the state is safe without the
        headroom, hence in the whole pool too (safety is monotone in the resources)."""
        if kept == (0, 0):
            return self._admits(in_use, outstanding, ref_counts, count, need, hits, revived,
                                prompt_tokens, total_tokens, shared, adapter)
        whole = self.num_blocks, self.max_live
        self.num_blocks -= kept[0]
        if self.max_live is not None:
            self.max_live -= kept[1]
        try:
            return self._admits(in_use, outstanding, ref_counts, count, need, hits, revived,
                                prompt_tokens, total_tokens, shared, adapter)
        finally:
            self.num_blocks, self.max_live = whole

    def _admits(self, in_use: int, outstanding: int, ref_counts: Sequence[int], count: int,
                need: int, hits: Sequence[int], revived: int, prompt_tokens: int,
                total_tokens: int, shared: int, adapter: object | None) -> bool:
        """Whether ``count`` new reservations of ``total_tokens`` (prompt + cap), each
        drawing ``need`` blocks after pinning ``hits`` (``revived`` of them cached, held by
        none), may be admitted; all but the first will pin ``shared`` prompt blocks the
        first computes (each is checked as if it drew them, until it pins them:
        ``may_share``). They wait for seats and for a slot for ``adapter``. ``refusal``
        says why not."""
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
            key = None if adapter is None else id(adapter)
            new = [Claim(need, hits, adapter=key, seated=False) for _ in range(count)]
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
        changed = {reservation: _claim(reservation, _need(reservation) - 1, fresh=1)}
        margin = self._margin_after(in_use + 1, ref_counts, {}, [], changed)
        self._slack, self._spent = margin, 0
        return margin is not None

    def may_seat(self, reservation, in_use: int, outstanding: int,
                 ref_counts: Sequence[int]) -> bool:
        """Whether ``reservation``'s request may take a seat (and a slot for its adapter)
        now: not if that could leave a request that must finish first without one."""
        if in_use + outstanding <= self.num_blocks:
            return True  # every draw is granted: whoever runs finishes and frees its seat
        adapter = reservation.adapter
        seated = [r for r in self.live if r.seated]
        if (self.max_live is None or len(self.live) <= self.max_live) and (
                adapter is None or self.max_adapters is None
                or any(r.adapter is adapter for r in seated)):
            return True  # seats for all and no new slot: it only gains a seat of its own
        self._slack = None
        changed = {reservation: _claim(reservation, seated=True)}
        return self._safe_after(in_use, ref_counts, {}, [], changed)

    def head(self, in_use: int, outstanding: int):
        """Over-committed, a reservation that can get all it may still need now (its
        blocks from the unused ones, a seat and its adapter's slot if it waits): the
        engine runs it before anyone else (module docstring). The least need among them,
        one running first. In a safe state there always is one, and it can head a
        completion order: finishing only gives back, so the order the check found still
        works for the rest after it. O(live). None when every promise can be drawn at
        once (any order finishes), or when no one can (a bug: the stall watch tells)."""
        if in_use + outstanding <= self.num_blocks:
            return None
        unused = self.num_blocks - in_use
        seated = [r for r in self.live if r.seated]
        free_seat = self.max_live is None or len(seated) < self.max_live
        running = {id(r.adapter) for r in seated if r.adapter is not None}
        free_slot = self.max_adapters is None or len(running) < self.max_adapters
        best, best_key = None, None
        for reservation in self.live:
            need = _need(reservation)
            if need > unused:
                continue
            if not reservation.seated and not (free_seat and (
                    reservation.adapter is None or free_slot or id(reservation.adapter) in running)):
                continue
            key = (need, not reservation.seated)
            if best_key is None or key < best_key:
                best, best_key = reservation, key
        return best

    def admit(self, reservations: Sequence, prompt_tokens: int, total_tokens: int,
              shared: int = 0) -> None:
        self._slack = None
        for i, reservation in enumerate(reservations):
            self.live[reservation] = [prompt_tokens, total_tokens, shared if i else 0]
        if shared and len(reservations) > 1:
            self._sharers[reservations[0]] = list(reservations[1:])

    def advance(self, reservation, tokens: int) -> None:
        """``reservation`` now holds blocks for ``tokens`` tokens: it drew, so it is not paused."""
        self.paused.discard(reservation)
        timeline = self.live.get(reservation)
        if timeline is not None:
            timeline[0] = max(timeline[0], tokens)

    def forget(self, reservation) -> None:
        """``reservation`` was released. If it was projected as holding its request's shared
        prompt blocks, the next choice still sharing them is projected so from now."""
        self.live.pop(reservation, None)
        self.paused.discard(reservation)
        sharers = [r for r in self._sharers.pop(reservation, ()) if r in self.live]
        if sharers:
            self.live[sharers[0]][2] = 0
            self._sharers[sharers[0]] = sharers[1:]

    def pause(self, reservation) -> None:
        """``reservation`` was refused a draw: it waits, and nobody new is admitted."""
        self.paused.add(reservation)
        self.refused_draws += 1

    def may_pin(self, reservation, blocks: Sequence[int], in_use: int,
                ref_counts: Sequence[int]) -> bool:
        """Whether ``reservation`` may pin cached ``blocks`` in place of as many draws."""
        revived = sum(1 for block in blocks if ref_counts[block] == 0)
        changed = {reservation: _claim(reservation, _need(reservation) - len(blocks),
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
        changed = {reservation: _claim(reservation, reservation.draws_left,
                                       [*reservation.block_ids, *blocks])}
        self._slack = None
        if self._safe_after(pool.num_in_use, pool.ref_counts, dict.fromkeys(blocks, 1), [],
                            changed):
            return True
        self.live[reservation][2] = 0
        for sharers in self._sharers.values():
            if reservation in sharers:
                sharers.remove(reservation)
        return False

    def _safe_after(self, in_use: int, ref_counts: Sequence[int], pins: Mapping[int, int],
                    new: list[Claim], changed: Mapping) -> bool:
        return self._margin_after(in_use, ref_counts, pins, new, changed) is not None

    def _margin_after(self, in_use: int, ref_counts: Sequence[int], pins: Mapping[int, int],
                      new: list[Claim], changed: Mapping) -> int | None:
        claims = [changed.get(r) or _claim(r) for r in self.live]
        shared = self.pool.shared if self.pool is not None else None
        return completion_margin(self.num_blocks - in_use, claims + new, ref_counts, pins,
                                 shared, seats=self.max_live, slots=self.max_adapters)


def _claim(reservation, need: int | None = None, blocks: Sequence[int] | None = None,
           fresh: int = 0, seated: bool | None = None) -> Claim:
    """A live reservation as the check sees it, or as it would be after a change."""
    adapter = reservation.adapter
    return Claim(_need(reservation) if need is None else need,
                 reservation.block_ids if blocks is None else blocks, fresh,
                 None if adapter is None else id(adapter),  # by object, as the scheduler
                 reservation.seated if seated is None else seated)


def _need(reservation) -> int:
    """What a live reservation may still draw, counting the shared prompt blocks it awaits
    as draws (it may yet compute them itself: ``Overcommit.may_share``)."""
    return reservation.draws_left + reservation.awaited_blocks
