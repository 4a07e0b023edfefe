"""The admission line's stall watch (``core/stall.py``'s ``LineWatch``), on admission's own
line over a real ledger and a clock of the test's: a line that waits while the engine
works is no stall; one that waits while the engine holds nothing is, once the thresholds
pass, and stays one across waiters whose wait runs out; an admission ends it."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvledger.engine.admission.line import Admission
from kvledger.engine.core.stall import LineWatch
from kvledger.engine.errors import KVCacheFull
from kvledger.engine.kv.ledger import KVLedger


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _setup(max_queue_wait_s):
    """A one-block pool held by a request the engine may or may not be running."""
    admission = Admission(KVLedger(1, 16), max_model_len=64, rng=random.Random(0),
                          max_queue_len=None, max_queue_wait_s=max_queue_wait_s)
    clock, idle = Clock(), {"engine": False}
    watch = LineWatch(admission, lambda: idle["engine"], min_checks=3, min_seconds=10.0,
                      clock=clock)
    return admission, watch, clock, idle


async def test_a_waiting_line_is_a_stall_only_while_the_engine_holds_nothing():
    admission, watch, clock, idle = _setup(None)
    holder = await admission.admit("holder", 8, 8)
    waiter = asyncio.create_task(admission.admit("waiter", 8, 8))
    await asyncio.sleep(0)
    assert admission.queue_length == 1
    for _ in range(10):  # the engine runs the holder: its blocks come back in time
        clock.now += 5
        assert not watch.observe()
    assert not watch.stalled
    idle["engine"] = True  # it holds nothing, yet the holder's blocks are never given back
    became = []
    for _ in range(3):
        clock.now += 5
        became.append(watch.observe())
    assert became == [False, False, True] and watch.stalled and watch.stalls == 1
    assert "1 requests wait in line and none has been admitted for 10.0 s" in watch.describe()
    assert not watch.observe()  # said once
    admission.give_back(holder.reservations)
    admission.done(holder)  # the line moves: the waiter is admitted
    await waiter
    assert not watch.observe() and not watch.stalled and watch.stuck_checks == 0


async def test_waiters_whose_wait_runs_out_do_not_hide_a_stuck_line():
    """With --max-queue-wait each waiter leaves with a 429 before the next comes: the line
    is empty between them, but it never moved, so the count goes on."""
    admission, watch, clock, idle = _setup(0.01)
    await admission.admit("holder", 8, 8)
    idle["engine"] = True
    for i in range(3):
        waiter = asyncio.create_task(admission.admit(f"w{i}", 8, 8))
        await asyncio.sleep(0)
        clock.now += 6
        watch.observe()
        with pytest.raises(KVCacheFull):
            await waiter
        assert admission.queue_length == 0
        watch.observe()  # an empty line: nothing counted, nothing forgotten
    assert watch.stalled and watch.stuck_checks == 3
