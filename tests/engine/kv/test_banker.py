"""The banker's check (engine/kv/banker.py) against a brute-force search over every
completion order: blocks (shared ones come back with their last holder), seats and LoRA
adapter slots (one comes back with the last running request of its adapter)."""

from __future__ import annotations

from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.engine.kv.banker import Claim, completion_margin, completion_order_exists


def brute_force(unused: int, claims: list[Claim], ref_counts: list[int],
                seats: int | None, slots: int | None) -> bool:
    holders: dict[int, set[int]] = {}
    for i, claim in enumerate(claims):
        for block in claim.blocks:
            holders.setdefault(block, set()).add(i)

    @cache
    def finishes(done: frozenset[int]) -> bool:
        if len(done) == len(claims):
            return True
        back = sum(1 for block, held in holders.items()
                   if held <= done and ref_counts[block] == len(held))
        busy = [i for i, c in enumerate(claims) if c.seated and i not in done]
        running = {claims[i].adapter for i in busy if claims[i].adapter is not None}
        for i, claim in enumerate(claims):
            if i in done or claim.need > unused + back:
                continue
            if not claim.seated and ((seats is not None and len(busy) >= seats) or (
                    slots is not None and claim.adapter is not None
                    and claim.adapter not in running and len(running) >= slots)):
                continue
            if finishes(done | {i}):
                return True
        return False

    return finishes(frozenset())


@st.composite
def states(draw):
    blocks = draw(st.integers(0, 8))
    count = draw(st.integers(1, 6))
    claims = []
    for _ in range(count):
        held = draw(st.lists(st.integers(0, blocks - 1), unique=True, max_size=4)) if blocks else []
        claims.append(Claim(draw(st.integers(0, 8)), held, 0,
                            draw(st.sampled_from([None, 0, 1, 2])), draw(st.booleans())))
    # Each block's holders are the claims listing it, plus sometimes one outside (a block
    # that never comes back).
    refs = [sum(b in c.blocks for c in claims) + draw(st.sampled_from([0, 0, 1]))
            for b in range(blocks)]
    seated = sum(c.seated for c in claims)
    running = len({c.adapter for c in claims if c.seated and c.adapter is not None})
    seats = draw(st.one_of(st.none(), st.integers(seated, seated + 2)))
    slots = draw(st.one_of(st.none(), st.integers(max(running, 1), running + 2)))
    return draw(st.integers(0, 10)), claims, refs, seats, slots


@settings(max_examples=1500, deadline=None)
@given(states())
def test_the_greedy_check_agrees_with_every_order(state):
    unused, claims, refs, seats, slots = state
    assert completion_order_exists(unused, claims, refs, seats=seats, slots=slots) == (
        brute_force(unused, claims, refs, seats, slots))


def test_a_waiting_request_needs_its_adapters_slot_on_its_turn():
    """One slot, held by a paused request of adapter a (needs 5, holds 2); b's request
    (needs 2, holds 2) could finish first by blocks and give back enough for a's, but has
    no slot until a's request gives it back: not safe. With two slots it is (margin 0:
    b finds 1 block beyond its need, a none); with 5 unused blocks a finishes first."""
    paused, waiting = Claim(5, [0, 1], adapter="a"), Claim(2, [2, 3], adapter="b", seated=False)
    refs = [1, 1, 1, 1]
    assert not completion_order_exists(3, [paused, waiting], refs, slots=1)
    assert completion_margin(3, [paused, waiting], refs, slots=2) == 0
    assert completion_order_exists(5, [paused, waiting], refs, slots=1)
    assert not completion_order_exists(3, [paused, waiting], refs, seats=1)  # nor a seat
