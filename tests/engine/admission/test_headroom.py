"""Headroom without preemption (``--priority-headroom``): best-effort requests never take
the kept blocks or seats, an urgent request takes them at once, and nothing admitted can
strand (tests/engine/kv/test_safe_progress.py runs the same with random traffic)."""

from __future__ import annotations

import pytest
from _sim_engine import sim_engine, submit

from kvledger.engine.admission.headroom import NO_HEADROOM, Headroom
from kvledger.engine.errors import BadInput, PoolTooSmall
from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.server.api_errors import admission_error
from kvledger.engine.settings.config import EngineConfig

BEST_EFFORT, URGENT = 10, 0


def test_the_share_rounds_up_and_leaves_best_effort_a_block_and_a_seat():
    assert Headroom.of(0.1, 0, 32, 8) == Headroom(4, 1, 0)
    assert Headroom.of(0.99, 0, 4, 2) == Headroom(3, 1, 0)
    assert Headroom.of(0.0, 0, 32, 8) is NO_HEADROOM
    assert Headroom(4, 1, 0).kept_from(0) == (0, 0)
    assert Headroom(4, 1, 0).kept_from(-3) == (0, 0)
    assert Headroom(4, 1, 0).kept_from(1) == (4, 1)


@pytest.mark.parametrize("overcommit, tokens", [(False, 32), (True, 48)])
def test_best_effort_stops_short_of_the_kept_blocks_and_urgent_takes_them(overcommit, tokens):
    """Four best-effort promises of 2 blocks in a pool of 10, 2 of them kept. Reserving,
    a fifth of 2 blocks would take the kept ones. Over-committing (each request projected
    writing a token a step), a fifth of 3 blocks is safe in the whole pool (peak 10) but
    not without the kept blocks (peak 10 > 8): refused to best-effort, granted to urgent."""
    ledger = KVLedger(10, 16, overcommit=overcommit, max_live=16)
    kept = Headroom(2, 0, URGENT).kept_from(BEST_EFFORT)
    held = [ledger.try_reserve_each(32, 1, kept=kept) for _ in range(4)]  # 2 blocks each
    assert all(held)
    assert ledger.try_reserve_each(tokens, 1, kept=kept) is None  # it needs the kept blocks
    assert ledger.try_reserve_each(tokens, 1) is not None          # urgent: it may


def test_a_best_effort_request_larger_than_the_pool_less_the_headroom_is_a_400():
    ledger = KVLedger(10, 16)
    assert ledger.check_fits(160) == 10  # urgent: the whole pool
    with pytest.raises(PoolTooSmall) as info:
        ledger.check_fits(160, kept_blocks=2)
    answer = admission_error(info.value)
    assert answer.status == 400 and "2 are kept for more urgent requests" in answer.message


def test_the_kept_seat_seats_an_urgent_request_at_the_next_step(tiny_llama_dir):
    engine = sim_engine(tiny_llama_dir, num_blocks=64, block_size=16, max_num_seqs=4,
                        max_num_batched_tokens=64, priority_headroom=0.25)
    assert engine.headroom == Headroom(16, 1, 0)
    for i in range(5):  # small: the blocks allow all of them, the seats three
        assert submit(engine, f"b{i}", [5, 6, 7], 20, priority=BEST_EFFORT)
    engine.step()
    assert sorted(engine.scheduler.running) == ["b0", "b1", "b2"]
    assert submit(engine, "u", [5, 6, 7], 20, priority=URGENT)
    engine.step()
    assert "u" in engine.scheduler.running  # past b3 and b4, which arrived first
    assert [s.request_id for s in engine.scheduler.waiting] == ["b3", "b4"]


def test_without_headroom_the_urgent_request_waits_for_a_seat(tiny_llama_dir):
    engine = sim_engine(tiny_llama_dir, num_blocks=64, block_size=16, max_num_seqs=4,
                        max_num_batched_tokens=64)
    for i in range(5):
        assert submit(engine, f"b{i}", [5, 6, 7], 20)
    engine.step()
    assert submit(engine, "u", [5, 6, 7], 20)
    engine.step()
    assert "u" not in engine.scheduler.running and len(engine.scheduler.running) == 4


def test_the_headroom_needs_the_priority_policy(tiny_llama_dir):
    with pytest.raises(BadInput, match="--scheduling-policy priority"):
        EngineConfig(model=str(tiny_llama_dir), priority_headroom=0.1)
    with pytest.raises(BadInput, match=r"share in \[0, 1\)"):
        EngineConfig(model=str(tiny_llama_dir), scheduling_policy="priority",
                     priority_headroom=1.0)
