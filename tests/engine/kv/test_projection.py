"""The pool's projected holdings and the soonest start of a waiting request (backfilling's
plan), checked against counting every step."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.engine.kv.claims import blocks_for
from kvledger.engine.kv.projection import Projection
from kvledger.engine.kv.safety import peak_blocks

REQUESTS = st.lists(st.tuples(st.integers(0, 60), st.integers(1, 60), st.integers(0, 40)),
                    max_size=6)  # tokens written, tokens still to write, the step it starts


def _held(tokens: int, total: int, start: int, step: int, block_size: int) -> int:
    """Blocks a request from ``tokens`` written to ``total`` holds at ``step``, from ``start``."""
    tokens = min(tokens, total - 1)
    if not start <= step < start + total - tokens:
        return 0
    return blocks_for(tokens + step - start + 1, block_size)


def _by_step(requests, block_size, horizon):
    return [sum(_held(tokens, total, start, step, block_size) for tokens, total, start in requests)
            for step in range(horizon)]


@settings(max_examples=200, deadline=None)
@given(requests=REQUESTS, block_size=st.sampled_from([1, 3, 16]))
def test_holdings_equal_counting_every_step(requests, block_size):
    requests = [(tokens, tokens + left, start) for tokens, left, start in requests]
    plan = Projection(1000, block_size, grows=True, held_beyond=2)
    for tokens, total, start in requests:
        plan.place(start, tokens, total)
    held = plan.holdings()
    assert list(held) == [2 + blocks for blocks in _by_step(requests, block_size, len(held))]
    at_once = [(tokens, total) for tokens, total, start in requests if start == 0]
    if len(at_once) == len(requests) and requests:
        assert held.max() == 2 + peak_blocks(at_once, block_size)


@settings(max_examples=300, deadline=None)
@given(requests=REQUESTS, block_size=st.sampled_from([1, 4, 16]),
       num_blocks=st.integers(1, 30), prompt=st.integers(0, 60), cap=st.integers(1, 80),
       count=st.sampled_from([1, 2]))
def test_the_soonest_start_is_the_first_step_at_which_it_fits_to_its_cap(
        requests, block_size, num_blocks, prompt, cap, count):
    requests = [(tokens, tokens + left, start) for tokens, left, start in requests]
    plan = Projection(num_blocks, block_size, grows=True)
    for tokens, total, start in requests:
        plan.place(start, tokens, total)
    total = prompt + cap
    got = plan.soonest_start(prompt, total, count)
    if count * blocks_for(total, block_size) > num_blocks:
        assert got is None
        return
    held = _by_step(requests, block_size, 300)
    expected = next(start for start in range(200)
                    if all(held[step] + count * _held(prompt, total, start, step, block_size)
                           <= num_blocks for step in range(start, start + cap)))
    assert got == expected


@settings(max_examples=200, deadline=None)
@given(flat=st.lists(st.tuples(st.integers(1, 10), st.integers(0, 60)), max_size=6),
       beyond=st.integers(0, 5), blocks=st.integers(1, 20), life=st.integers(1, 60))
def test_reserving_a_request_holds_its_blocks_from_its_start_to_its_cap(flat, beyond, blocks,
                                                                          life):
    plan = Projection(20, 16, grows=False, held_beyond=beyond)
    plan.add_flat([b for b, _ in flat], [steps for _, steps in flat])
    got = plan.soonest_start(0, life, blocks=blocks)
    if beyond + blocks > 20:
        assert got is None
        return
    held = [beyond + sum(b for b, steps in flat if step < steps) for step in range(200)]
    assert got == next(start for start in range(100)
                       if all(held[step] + blocks <= 20 for step in range(start, start + life)))
    plan.place(got, 0, life, blocks=blocks)
    assert max(plan.holdings(), default=beyond) <= 20 or max(held) > 20


def test_a_request_goes_where_the_pool_has_room_for_it_until_its_cap():
    """A pool of 6 blocks of 4 tokens, two running requests: one from 10 to 20 tokens (3
    blocks, 4 from step 2, 5 from step 6), one from 2 to 6 (1 block, 2 at steps 2-3, gone
    at 4). A request of 4 tokens (1 block) fits from step 4, one of 8 (2 blocks from its
    5th step) from step 6; once that one is placed there, the 4-token one fits at 10."""
    plan = Projection(6, 4, grows=True)
    plan.add_growing([(10, 20, 0), (2, 6, 0)])
    assert list(plan.holdings()) == [4, 4, 6, 6, 4, 4, 5, 5, 5, 5]
    assert plan.soonest_start(0, 4) == 4
    assert plan.soonest_start(0, 8) == 6
    plan.place(6, 0, 8)
    assert list(plan.holdings()[6:]) == [6, 6, 6, 6, 2, 2, 2, 2]
    assert plan.soonest_start(0, 4) == 10
    assert plan.soonest_start(0, 7 * 4) is None  # more than the pool
