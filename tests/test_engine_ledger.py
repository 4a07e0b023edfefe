"""The KV reservation ledger: never over-commits, hands out blocks lazily, always returns
to zero. Property tests drive random interleavings of reserve / grow / finish / abort."""

from __future__ import annotations

import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvledger.engine.errors import BadInput
from kvledger.engine.ledger import KVLedger


def test_reservation_covers_prompt_plus_cap_rounded_up_to_blocks():
    ledger = KVLedger(num_blocks=10, block_size=16)
    assert ledger.blocks_for(1) == 1 and ledger.blocks_for(16) == 1 and ledger.blocks_for(17) == 2
    r = ledger.try_reserve(33)
    assert r.num_blocks == 3 and r.used_blocks == 0
    assert (ledger.reserved_blocks, ledger.used_blocks, ledger.free_blocks) == (3, 0, 7)


def test_try_reserve_returns_none_when_it_does_not_fit_and_changes_nothing():
    ledger = KVLedger(num_blocks=4, block_size=16)
    first = ledger.try_reserve(48)
    assert ledger.try_reserve(17) is None
    assert ledger.reserved_blocks == 3
    assert ledger.try_reserve(16) is not None
    ledger.release(first)
    assert ledger.reserved_blocks == 1


def test_blocks_are_handed_out_lazily_and_never_beyond_the_reservation():
    ledger = KVLedger(num_blocks=8, block_size=4)
    r = ledger.try_reserve(10)  # 3 blocks
    ledger.grow(r, 1)
    assert r.used_blocks == 1 and ledger.used_blocks == 1
    ledger.grow(r, 8)
    assert r.used_blocks == 2 and len(set(r.block_ids)) == 2
    ledger.grow(r, 12)
    assert r.used_blocks == 3
    with pytest.raises(RuntimeError):
        ledger.grow(r, 13)


def test_release_is_idempotent_and_returns_blocks():
    ledger = KVLedger(num_blocks=2, block_size=4)
    r = ledger.try_reserve(8)
    ledger.grow(r, 8)
    ledger.release(r)
    ledger.release(r)
    assert (ledger.reserved_blocks, ledger.used_blocks, ledger.free_blocks) == (0, 0, 2)
    with pytest.raises(RuntimeError):
        ledger.grow(r, 1)


def test_bad_sizes_are_refused():
    with pytest.raises(BadInput):
        KVLedger(num_blocks=0, block_size=16)
    with pytest.raises(BadInput):
        KVLedger(num_blocks=4, block_size=16).try_reserve(0)


def test_concurrent_reserve_and_release_never_over_commit():
    ledger = KVLedger(num_blocks=50, block_size=1)
    peak = []

    def worker():
        for _ in range(2000):
            r = ledger.try_reserve(3)
            if r is not None:
                peak.append(ledger.reserved_blocks)
                ledger.grow(r, 3)
                ledger.release(r)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(peak) <= 50
    assert (ledger.reserved_blocks, ledger.used_blocks) == (0, 0)


class LedgerMachine(RuleBasedStateMachine):
    """Requests are admitted, grow token by token, finish or are aborted, in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = KVLedger(num_blocks=12, block_size=4)
        self.live: dict[int, tuple] = {}  # id -> (reservation, capacity_tokens, tokens_written)
        self.next_id = 0

    @rule(prompt=st.integers(1, 30), cap=st.integers(1, 30))
    def reserve(self, prompt, cap):
        free_before = self.ledger.free_blocks
        r = self.ledger.try_reserve(prompt + cap)
        fits = self.ledger.blocks_for(prompt + cap) <= free_before
        assert (r is not None) == fits
        if r is not None:
            self.live[self.next_id] = (r, prompt + cap, 0)
            self.next_id += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.integers(1, 12))
    def grow(self, data, tokens):
        key = data.draw(st.sampled_from(sorted(self.live)))
        r, capacity, written = self.live[key]
        written = min(capacity, written + tokens)
        self.ledger.grow(r, written)
        assert r.used_blocks == self.ledger.blocks_for(written)
        self.live[key] = (r, capacity, written)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), twice=st.booleans())
    def finish_or_abort(self, data, twice):
        key = data.draw(st.sampled_from(sorted(self.live)))
        r, _, _ = self.live.pop(key)
        self.ledger.release(r)
        if twice:  # an abort racing a finish
            self.ledger.release(r)

    @invariant()
    def never_over_committed(self):
        reservations = [r for r, _, _ in self.live.values()]
        assert self.ledger.reserved_blocks == sum(r.num_blocks for r in reservations)
        assert self.ledger.reserved_blocks <= self.ledger.num_blocks
        assert all(r.used_blocks <= r.num_blocks for r in reservations)
        assert self.ledger.used_blocks == sum(r.used_blocks for r in reservations)
        handed_out = [b for r in reservations for b in r.block_ids]
        assert len(handed_out) == len(set(handed_out))  # no block in two places

    def teardown(self):
        for r, _, _ in self.live.values():
            self.ledger.release(r)
        assert (self.ledger.reserved_blocks, self.ledger.used_blocks) == (0, 0)
        assert self.ledger.free_blocks == self.ledger.num_blocks


TestLedgerInterleavings = LedgerMachine.TestCase
TestLedgerInterleavings.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_try_reserve_each_is_all_or_none():
    ledger = KVLedger(10, 16)
    three = ledger.try_reserve_each(40, 3)          # 3 blocks each
    assert [r.num_blocks for r in three] == [3, 3, 3] and ledger.reserved_blocks == 9
    assert ledger.try_reserve_each(16, 2) is None   # 2 blocks, 1 free: nothing taken
    assert ledger.reserved_blocks == 9
    for reservation in three:
        ledger.release(reservation)
    assert ledger.reserved_blocks == 0
