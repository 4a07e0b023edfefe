"""``--admission safe`` makes progress, not only keeps its promise: on the real step loop
(``LLMEngine.step``, ``Scheduler``, ``KVLedger``; only the forward pass faked) some live
request advances every step, every admitted request finishes, and after every change the
state is safe by a brute-force check that shares no code with ``engine/kv/safety.py``.

The state machine covers what can leave the request able to finish unscheduled: LoRA
slots (1..3 of 2..4 adapters), ``n > 1`` choices sharing a prompt with owner aborts and
early finishes, prefix-cache hits and evictions, chunked prefills under a small token
budget, cancellations and tiny pools; once with admission's peak projection and once
without it (the guarantee must not rest on the projection). The deterministic cases
below are the deadlocks this was built against."""

from __future__ import annotations

import pytest
from _engine_helpers import assert_pool_empty
from _sim_engine import Adapter, brute_force_safe, sim_engine, submit
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvledger.engine.errors import PoolTooSmall
from kvledger.engine.kv import safety
from kvledger.engine.kv.ledger import KVLedger

PREFIXES = ([2, 3, 4, 5, 6, 7, 8, 9], [40] * 6, [11, 12, 13])


def _no_projection(monkeypatch) -> None:
    """Admission without its peak projection: only the check and the head stand."""
    monkeypatch.setattr(safety, "peak_blocks", lambda timelines, block_size: 0)


def run_until_idle(engine, max_steps: int = 2000) -> dict[str, str]:
    """Step until the engine is idle; the finish reason of each request by id. Asserts
    that every step with a request in the engine computed a token."""
    reasons = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return reasons
        ran = len(engine.runner.batches)
        for out in engine.step():
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        assert len(engine.runner.batches) > ran or not engine.scheduler.has_unfinished(), (
            f"a step with requests computed nothing: {engine.scheduler.describe()}")
    raise AssertionError(f"not idle after {max_steps} steps: {engine.scheduler.describe()}")


# -- the deadlocks this was built against --------------------------------------------


@pytest.mark.parametrize("projection", [True, False])
def test_a_request_for_another_adapter_is_not_admitted_over_committed_without_a_slot(
        tiny_llama_dir, monkeypatch, projection):
    """--max-loras 1: r1 (adapter b) takes the pool; r2 (adapter a) can finish first by
    blocks, but never gets a slot while r1 runs. The check counts the slot: r2 waits for
    admission instead of being admitted into a state where r1 pauses forever."""
    if not projection:
        _no_projection(monkeypatch)
    engine = sim_engine(tiny_llama_dir, num_blocks=6, block_size=1, max_num_seqs=4,
                        max_num_batched_tokens=4, max_loras=1)
    a, b = Adapter("a", 1), Adapter("b", 2)
    submit(engine, "r0", [2], 2, adapter=a)
    assert run_until_idle(engine) == {"r0": "length"}  # its block of [2] stays cached
    submit(engine, "r1", [7], 5, adapter=b)
    engine.step()
    assert submit(engine, "r2", [2, 3], 1, adapter=a) is None
    assert engine.ledger.overcommit.refusal == (
        "admitting it could leave an admitted request unable to reach its cap")
    assert run_until_idle(engine) == {"r1": "length"}
    assert submit(engine, "r2", [2, 3], 1, adapter=a) == ["r2"]
    assert run_until_idle(engine) == {"r2": "length"}
    assert_pool_empty(engine)


def test_a_paused_prompt_chunk_does_not_hold_the_token_budget(tiny_llama_dir, monkeypatch):
    """13 one-token blocks, 3 seats, 4 batched tokens, projection off: r1's surviving
    choice pauses mid-prompt; r2 (5 cached blocks, cap 1) is the one that can finish and
    must get the step's tokens, though r1's chunk came first."""
    _no_projection(monkeypatch)
    engine = sim_engine(tiny_llama_dir, num_blocks=13, block_size=1, max_num_seqs=3,
                        max_num_batched_tokens=4)
    prompt = [11, 12, 13, 14, 15, 16]
    submit(engine, "r0", prompt, 1)
    run_until_idle(engine)
    submit(engine, "r1", list(range(20, 30)), 1, n=2)
    engine.abort_request("r1-0")  # the client left: the second choice inherits the prompt
    assert [(out.request_id, out.finish_reason) for out in engine.step()] == [("r1-0", "abort")]
    assert submit(engine, "r2", prompt, 1) == ["r2"]
    assert run_until_idle(engine) == {"r1-1": "length", "r2": "length"}
    assert_pool_empty(engine)


def test_the_head_of_the_safe_order_is_seated_past_a_choice_awaiting_its_prompt(
        tiny_llama_dir, monkeypatch):
    """A choice awaiting the prompt its request's first choice computes no longer stops
    the line: the ledger's head behind it is seated and runs while the first choice is
    paused."""
    _no_projection(monkeypatch)
    engine = sim_engine(tiny_llama_dir, num_blocks=12, block_size=2, max_num_seqs=4,
                        max_num_batched_tokens=4)
    submit(engine, "big", list(range(30, 42)), 10, n=2)  # 11 + 6 blocks, 5 shared
    engine.step()
    assert submit(engine, "small", [50, 51], 2) == ["small"]
    assert run_until_idle(engine) == {"big-0": "length", "big-1": "length", "small": "length"}
    assert_pool_empty(engine)


def test_the_head_takes_its_tokens_first_from_the_back_of_the_line(tiny_llama_dir, monkeypatch):
    """Over-committed, ``KVLedger.head`` is a request whose need fits the unused blocks; the
    scheduler seats it and gives it its tokens before the requests ahead of it in line, so
    it progresses this step (in line order, ``a``'s prompt would take the whole budget)."""
    _no_projection(monkeypatch)
    engine = sim_engine(tiny_llama_dir, num_blocks=8, block_size=1, max_num_seqs=4,
                        max_num_batched_tokens=4)
    submit(engine, "long", [3, 4], 6)  # the whole pool
    engine.step()
    assert engine.ledger.head() is None  # nothing over-committed: any order finishes
    submit(engine, "a", [5, 6, 7], 1)
    submit(engine, "b", [9], 1)  # needs 2 blocks, the least: it can finish first
    assert engine.ledger.head() is engine.intake.pending_adds["b"].reservation
    finished = [out.request_id for out in engine.step() if out.finished]
    assert finished == ["b"]  # seated first, its prompt computed and its token sampled
    assert run_until_idle(engine) == {"a": "length", "long": "length"}
    assert_pool_empty(engine)


def test_a_choice_awaiting_its_prompt_does_not_stop_the_line(tiny_llama_dir):
    """Reserving (no head involved): while the first choice of an ``n=2`` request computes
    its prompt a chunk a step, the second waits for those blocks at the front of the line,
    and a request behind it starts at once rather than after the prompt."""
    engine = sim_engine(tiny_llama_dir, num_blocks=40, block_size=2, max_num_seqs=4,
                        max_num_batched_tokens=8, admission="reserve")
    submit(engine, "big", list(range(30, 42)), 4, n=2)  # 12 prompt tokens: 8, then 4
    engine.step()
    submit(engine, "small", [50, 51], 2)
    engine.step()  # big-1 still awaits the prompt as the line is seated
    assert engine.scheduler.running["small"].num_computed_tokens == 2
    assert run_until_idle(engine) == {"big-0": "length", "big-1": "length", "small": "length"}
    assert_pool_empty(engine)


def test_a_choice_awaiting_its_prompt_counts_those_blocks_and_never_heads(monkeypatch):
    """The second choice of an ``n=2`` request waits for the prompt blocks the first
    computes; should the first leave, it computes them itself, so its need counts them.
    It may not head the order with its own draws alone: the first choice, needing less,
    runs first."""
    _no_projection(monkeypatch)
    ledger = KVLedger(12, 1, overcommit=True, max_live=4)
    other = ledger.try_reserve(10)
    ledger.seat(other)
    ledger.grow(other, 4)
    first, second = ledger.try_reserve_each(6, 2, [1, 2, 3, 4, 5])  # 4 prompt blocks shared
    assert second.awaits_share and second.draws_left == 2 and second.awaited_blocks == 4
    ledger.seat(first)
    ledger.grow(first, 2)
    assert ledger.head() is first  # needs 4; the second needs 2 + the 4 it awaits


def test_admission_waits_while_a_request_is_paused(tiny_llama_dir, monkeypatch):
    """A paused request is not kept waiting by newcomers: nothing is admitted while it is
    paused, even a request the check and the projection would both allow."""
    _no_projection(monkeypatch)
    ledger = sim_engine(tiny_llama_dir, num_blocks=8, block_size=4, max_num_seqs=4,
                        max_num_batched_tokens=8).ledger
    first, second = ledger.try_reserve(20), ledger.try_reserve(20)
    ledger.grow(first, 16)
    assert ledger.grow(second, 13) == 12  # refused: it pauses
    assert ledger.paused_reservations == 1
    # One token of two blocks' room: safe whatever else holds, yet refused.
    ledger.overcommit.paused.clear()
    assert ledger.try_reserve(1) is not None
    ledger.overcommit.pause(second)
    assert ledger.try_reserve(1) is None
    assert ledger.overcommit.refusal == "a running request is paused for its next KV block"


# -- the state machine ---------------------------------------------------------------


class SafeProgress(RuleBasedStateMachine):
    """Random traffic through the real step loop. Invariants after every rule: the state
    is safe (brute force), the pool is not over-used, every running sequence holds the
    blocks of its computed tokens; every step with requests computes a token; at the
    end every admitted request finishes and the ledger is back at zero."""

    engine = None

    @initialize(blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4]),
                seats=st.integers(1, 4), extra_budget=st.integers(0, 6),
                loras=st.sampled_from([None, (1, 2), (1, 3), (2, 3), (2, 4), (3, 4)]),
                caching=st.booleans(), eos_rate=st.sampled_from([0.0, 0.2]),
                seed=st.integers(0, 2**16), headroom=st.sampled_from([0.0, 0.0, 0.25, 0.5]))
    def build(self, blocks, block_size, seats, extra_budget, loras, caching, eos_rate, seed,
              headroom):
        max_loras, adapters = loras or (None, 0)
        if seats < 2:
            headroom = 0.0  # it always leaves best-effort requests a seat
        self.engine = sim_engine(self.model_dir, num_blocks=blocks, block_size=block_size,
                                 max_num_seqs=seats, max_num_batched_tokens=seats + extra_budget,
                                 max_loras=max_loras, prefix_caching=caching,
                                 eos_rate=eos_rate, seed=seed, priority_headroom=headroom)
        self.adapters = [None] + [Adapter(f"a{i}", i + 1) for i in range(adapters)]
        self.live: set[str] = set()
        self.admitted = 0
        self.finished: dict[str, str] = {}
        self.idle_steps = 0

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(20, 90), max_size=6),
          cap=st.integers(1, 12), n=st.sampled_from([1, 1, 2, 3]), adapter=st.integers(0, 4),
          ignore_eos=st.booleans(), priority=st.sampled_from([0, 10]))
    def submit(self, prefix, tail, cap, n, adapter, ignore_eos, priority):
        engine = self.engine
        prompt = [*prefix, *tail]
        kept = engine.headroom.kept_from(priority)
        try:
            engine.ledger.check_fits(len(prompt) + cap, n, len(prompt), share=True,
                                     kept_blocks=kept[0])
        except PoolTooSmall:
            return
        paused = engine.ledger.paused_reservations
        ids = submit(engine, f"r{self.admitted}", prompt, cap, n=n, ignore_eos=ignore_eos,
                     adapter=self.adapters[adapter % len(self.adapters)], priority=priority)
        if ids is not None:
            assert not paused, "admitted while a request was paused"
            self.admitted += 1
            self.live.update(ids)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        self.engine.abort_request(request_id)

    @rule()
    def step(self):
        engine = self.engine
        ran = len(engine.runner.batches)
        # With nothing to apply first, the head the step will run is the ledger's now.
        quiet = not engine.intake.pending_adds and not engine.intake.pending_aborts
        head = engine.ledger.head() if quiet else None
        before = head and next(s.num_computed_tokens for s in engine.scheduler._seq_of.values()
                               if s.reservation is head)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in self.finished, "finished twice"
                self.finished[out.request_id] = out.finish_reason
                self.live.discard(out.request_id)
        if engine.scheduler.has_unfinished() and len(engine.runner.batches) == ran:
            self.idle_steps += 1
        else:
            self.idle_steps = 0
        assert self.idle_steps == 0, f"no request progressed: {engine.scheduler.describe()}"
        if head is not None and not head.released:  # it finished, or computed a token
            seq = engine.scheduler._seq_of[head]
            assert seq.num_computed_tokens > before, "the head did not progress"

    @invariant()
    def safe_and_within_the_pool(self):
        engine = self.engine
        if engine is None:
            return
        ledger = engine.ledger
        assert 0 <= ledger.used_blocks <= ledger.num_blocks
        for seq in engine.scheduler.running.values():
            assert len(seq.block_ids) * ledger.block_size >= seq.num_computed_tokens
        assert brute_force_safe(engine), f"unsafe: {engine.scheduler.describe()}"

    def teardown(self):
        engine = self.engine
        if engine is None:
            return
        for request_id, reason in run_until_idle(engine).items():
            self.finished[request_id] = reason
            self.live.discard(request_id)
        assert not self.live, f"admitted and never finished: {sorted(self.live)}"
        assert set(self.finished.values()) <= {"length", "stop", "abort"}
        assert_pool_empty(engine)
        assert engine.ledger.paused_reservations == 0 and not engine.ledger.overcommit.live


@pytest.mark.parametrize("projection", [True, False])
def test_safe_admission_progresses_on_the_real_step_loop(tiny_llama_dir, monkeypatch,
                                                         projection):
    if not projection:
        _no_projection(monkeypatch)
    monkeypatch.setattr(SafeProgress, "model_dir", tiny_llama_dir, raising=False)
    run_state_machine_as_test(SafeProgress, settings=settings(
        max_examples=150, stateful_step_count=60, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow]))


def test_a_seat_that_takes_the_last_slot_needed_first_is_refused():
    """Two slots, adapter A running: the base request w can finish now and gives back its
    block; then v (adapter E, waiting) can, giving back its three; only then x (adapter C)
    and p. Seating x first takes the last slot while v still needs one: refused. Seating v
    is safe."""

    class Held:
        awaited_blocks = 0

        def __init__(self, need, blocks, adapter, seated):
            self.draws_left, self.block_ids = need, blocks
            self.adapter, self.seated = adapter, seated

    class Pool:
        num_in_use, ref_counts, shared = 7, [1] * 7 + [0] * 3, set()

    a, c, e = object(), object(), object()
    p, w = Held(6, [0, 1, 2], a, True), Held(1, [3], None, True)
    v, x = Held(2, [4, 5, 6], e, False), Held(5, [], c, False)
    safety_ = safety.Overcommit(10, 1, None, Pool(), max_adapters=2)
    safety_.admit([p, w, v, x], 0, 0)
    assert safety_.head(7, 14) is w  # the least need that can start now
    assert not safety_.may_seat(x, 7, 14, Pool.ref_counts)
    assert safety_.may_seat(v, 7, 14, Pool.ref_counts)
    v.seated = True
    assert safety_.may_seat(x, 7, 14, Pool.ref_counts)  # v gives its slot back in time


def test_the_projection_counts_shared_prompt_blocks_once_with_a_holder_that_stays():
    """Admission projects the choices of an ``n > 1`` request as holding their shared
    prompt blocks once (the first choice computes them). When the one projected as
    holding them goes (aborted, or finished first), the next still sharing them is
    projected as holding them: before, the survivors were each projected short by them."""
    ledger = KVLedger(40, 4, overcommit=True)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks shared
    first, second, third = ledger.try_reserve_each(20, 3, prompt)
    assert sorted(ledger.timelines()) == [(13, 20, 0), (13, 20, 3), (13, 20, 3)]
    ledger.release(first)  # the client of choice 0 left
    assert sorted(ledger.timelines()) == [(13, 20, 0), (13, 20, 3)]
    assert second.share.owner is second  # it computes them now: the projection agrees
    assert ledger.overcommit.live[second][2] == 0
    ledger.grow(second, 14)
    assert ledger.share_prompt(second) == [third]
    ledger.release(second)  # finished first: the third holds the blocks alone
    assert ledger.timelines() == [(13, 20, 0)]
    ledger.release(third)
    assert ledger.used_blocks == ledger.reserved_blocks == 0
