"""AsyncEngine: one stepping thread, per-request streams, aborts on close, no lost blocks."""

from __future__ import annotations

import asyncio
import threading

import pytest
import pytest_asyncio
from _server_helpers import make_llm

from kvledger.engine.core.async_engine import AsyncEngine, EngineDeadError
from kvledger.engine.errors import BadInput
from kvledger.engine.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


@pytest_asyncio.fixture
async def engine(llm):
    """A started AsyncEngine, stopped after the test however it ends."""
    running = AsyncEngine(llm)
    running.start()
    yield running
    await running.stop()


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def test_concurrent_streams_finish_and_measure_the_decode_rate(llm, engine):
    streams = [engine.generate(f"r{i}", [5 + i, 6, 7], _params(4 + i),
                               llm.ledger.try_reserve(3 + 4 + i)) for i in range(3)]
    for i, stream in enumerate(streams):
        outputs = [o async for o in stream]
        assert len(outputs[-1].token_ids) == 4 + i
        assert outputs[-1].finish_reason == "length"
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert engine.decode_tokens_per_s and engine.decode_tokens_per_s > 0
    assert llm.ledger.reserved_blocks == 0


async def test_closing_a_stream_early_aborts_the_request_and_frees_its_blocks(llm, engine):
    stream = engine.generate("long", [5, 6, 7], _params(200), llm.ledger.try_reserve(203))
    first = await stream.__anext__()
    assert not first.finished and llm.ledger.reserved_blocks > 0
    await stream.aclose()
    probe = engine.generate("after", [5], _params(1), llm.ledger.try_reserve(2))
    assert [o.finished async for o in probe][-1]  # the abort was applied by then
    assert llm.ledger.reserved_blocks == 0


async def test_bad_request_releases_its_reservation_and_stop_refuses_new_work(llm):
    engine = AsyncEngine(llm)
    engine.start()
    reservation = llm.ledger.try_reserve(10)
    with pytest.raises(BadInput):
        engine.generate("bad", [10**6], _params(1), reservation)
    assert reservation.released and llm.ledger.reserved_blocks == 0
    await engine.stop()
    with pytest.raises(EngineDeadError):
        engine.generate("late", [5], _params(1), None)


async def test_engine_death_releases_a_closed_stream_whose_abort_was_still_pending(
        tiny_llama_dir, monkeypatch):
    llm = make_llm(tiny_llama_dir)  # its own: this one is left dead
    engine = AsyncEngine(llm)
    engine.start()
    stream = engine.generate("long", [5, 6, 7], _params(200), llm.ledger.try_reserve(203))
    await stream.__anext__()
    closed = threading.Event()

    def dying_step():  # dies before it could apply the abort the closed stream left
        closed.wait(10)
        raise RuntimeError("injected engine death")

    monkeypatch.setattr(llm, "step", dying_step)
    await stream.aclose()  # the client went away: the abort waits for the next step
    closed.set()
    for _ in range(500):
        if engine.dead is not None:
            break
        await asyncio.sleep(0.01)
    assert isinstance(engine.dead, RuntimeError)
    assert (llm.ledger.reserved_blocks, llm.ledger.used_blocks) == (0, 0)
    assert not llm.has_unfinished_requests()


async def test_from_the_call_on_a_reservation_is_the_engines_even_when_refused(llm, engine):
    first = engine.generate("twice", [5, 6, 7], _params(50), llm.ledger.try_reserve(53))
    duplicate = llm.ledger.try_reserve(53)
    with pytest.raises(ValueError, match="duplicate"):  # refused before the engine saw it
        engine.generate("twice", [5, 6, 7], _params(50), duplicate)
    assert duplicate.released
    await first.aclose()
    await engine.stop()
    late = llm.ledger.try_reserve(10)
    with pytest.raises(EngineDeadError):
        engine.generate("late", [5], _params(1), late)
    assert late.released and llm.ledger.reserved_blocks == 0


async def test_an_engine_has_one_driver_at_a_time(llm, engine):
    """A second driver on a running engine is refused: both would step it and hand a
    request's outputs to whichever stepped, so the other's stream would wait forever."""
    second = AsyncEngine(llm)
    with pytest.raises(RuntimeError, match="already driven"):
        second.start()
    await engine.stop()
    second.start()  # the first let go
    try:
        stream = second.generate("next", [5, 6], _params(2), llm.ledger.try_reserve(4))
        assert [o.finished async for o in stream][-1]
    finally:
        await second.stop()
    assert llm.ledger.reserved_blocks == 0
