"""The banker's check behind safe over-commitment (``safety.py``): given what each live
request holds and may still need, is there an order in which every one can finish? Pure
arithmetic on blocks, seats and LoRA adapter slots; no pool, no lock.

Finishing only gives resources back, so any request that can get what it needs may go
first without harming the others, and the check is greedy: with blocks alone it is a
sort (the least need first); a waiting request that finds no free seat or slot on its
turn is set aside until a finished one gives one back (then every one set aside can go,
since blocks only grow). A block several requests hold (a cached prefix) comes back with
the last of them; a slot comes back with the last running request of its adapter.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass


@dataclass
class Claim:
    """A live request as the check sees it: ``need`` more blocks it may draw, the
    ``blocks`` it holds (shared ones too), ``fresh`` blocks it would hold only it; its
    LoRA ``adapter`` (None: the base model) and whether it is ``seated`` (running: it holds
    a seat and its adapter's slot), else it waits for both."""

    need: int
    blocks: Sequence[int] = ()
    fresh: int = 0
    adapter: Hashable | None = None
    seated: bool = True


def completion_margin(unused_blocks: int, claims: Sequence[Claim], ref_counts: Sequence[int],
                      pins: Mapping[int, int] | None = None, shared: set[int] | None = None,
                      *, seats: int | None = None, slots: int | None = None) -> int | None:
    """The least slack of the completion order: the fewest blocks any claim would find
    beyond its need on its turn, or None when no order lets every claim finish (the state
    is not safe; see the module docstring). ``unused_blocks``: free and cached
    (evictable) blocks; ``ref_counts``: each block's holders now, plus ``pins`` more;
    ``shared``: the blocks held more than once (the pool keeps them; found when None);
    ``seats`` and ``slots``: the engine's seats and adapter slots in all (None: no limit).

    One draw lowers every claim's slack by at most one (the claims before the drawer in
    the order find one block fewer; the drawer needs one fewer; those after it get the
    block back with it) and changes no seat or slot, so a state whose margin is ``m``
    stays safe for ``m`` more draws by anyone, in any order, with nothing checked
    (``Overcommit.may_draw``)."""
    pins = pins or {}
    groups = _SharedBlocks(claims, ref_counts, pins, shared)
    keys = groups.keys
    seating = _Seating(claims, seats, slots)
    followed = seating.followed  # the hot path checks no seat nor slot when none is needed
    available = margin = unused_blocks
    order = sorted(range(len(claims)), key=lambda i: claims[i].need)
    aside: list[int] = []  # their blocks are there, a seat or a slot is not (yet)
    at = 0
    while at < len(order) or aside:
        ready = next((k for k, i in enumerate(aside) if seating.can_start(claims[i])),
                     None) if aside else None
        if ready is not None:
            index = aside.pop(ready)
        elif at == len(order) or claims[order[at]].need > available:
            return None  # nobody can finish: the rest need more than will ever come back
        else:
            index, at = order[at], at + 1
            if followed and not seating.can_start(claims[index]):
                aside.append(index)
                continue
        claim, key = claims[index], keys[index]
        margin = min(margin, available - claim.need)
        # What it drew (``fresh``: its own until it releases it) and what it alone holds.
        available += claim.fresh + len(claim.blocks) - len(key)
        if key:
            available += groups.release(key)
        if followed:
            seating.finish(claim)
    return margin


class _SharedBlocks:
    """Claims holding the same shared blocks (one system prompt's) form a group: as its
    last member finishes, the group gives back those blocks whose every hold it was. A
    block only one claim holds is counted with that claim, not followed."""

    def __init__(self, claims: Sequence[Claim], ref_counts: Sequence[int],
                 pins: Mapping[int, int], shared: set[int] | None) -> None:
        if shared is None:
            shared = {block for claim in claims for block in claim.blocks
                      if ref_counts[block] > 1}
        several = shared.union(pins) if pins else shared  # the rest have one claim alone
        self.ref_counts, self.pins = ref_counts, pins
        self.keys = [frozenset(several.intersection(c.blocks)) if several else _NONE
                     for c in claims]
        self.members = Counter(self.keys)
        self.left = dict(self.members)
        self.holders: dict[int, int] = {}

    def release(self, key: frozenset[int]) -> int:
        """A member of group ``key`` finished: the blocks that come back (none until its
        last member has)."""
        self.left[key] -= 1
        if self.left[key]:
            return 0
        back = 0
        for block in key:
            held = (self.holders.get(block, self.ref_counts[block] + self.pins.get(block, 0))
                    - self.members[key])
            self.holders[block] = held
            back += held == 0
        return back


class _Seating:
    """Seats and adapter slots: a seated claim gives its seat back, and its adapter's slot
    with the last seated claim of that adapter; one waiting takes them only for its own
    turn. With no claim waiting, nobody needs them, and they are not followed."""

    def __init__(self, claims: Sequence[Claim], seats: int | None, slots: int | None) -> None:
        self.followed = (seats is not None or slots is not None) and not all(
            c.seated for c in claims)
        self.free_seats = None if seats is None else seats - sum(1 for c in claims if c.seated)
        self.running = Counter(c.adapter for c in claims if c.seated and c.adapter is not None
                               ) if self.followed else Counter()
        self.free_slots = None if slots is None else slots - len(self.running)

    def can_start(self, claim: Claim) -> bool:
        return claim.seated or (
            (self.free_seats is None or self.free_seats > 0)
            and (claim.adapter is None or self.free_slots is None or self.free_slots > 0
                 or self.running[claim.adapter] > 0))

    def finish(self, claim: Claim) -> None:
        if not claim.seated:
            return
        if self.free_seats is not None:
            self.free_seats += 1
        if claim.adapter is not None:
            self.running[claim.adapter] -= 1
            if not self.running[claim.adapter] and self.free_slots is not None:
                self.free_slots += 1


_NONE: frozenset[int] = frozenset()


def completion_order_exists(unused_blocks: int, claims: Sequence[Claim],
                            ref_counts: Sequence[int], pins: Mapping[int, int] | None = None,
                            **resources: int | None) -> bool:
    """Whether every claim can reach its cap in some order (see the module docstring)."""
    return completion_margin(unused_blocks, claims, ref_counts, pins, **resources) is not None
