"""``--admission safe``: the ledger over-commits the KV pool while every admitted request
can still reach its cap (the banker's algorithm, engine/kv/safety.py), the scheduler
pauses a request whose next block would break that, and nothing is preempted, recomputed
or left unable to finish."""

from __future__ import annotations

import random

import pytest
from _engine_helpers import assert_pool_empty, make_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.engine.errors import BadInput
from kvledger.engine.kv.banker import Claim, completion_order_exists
from kvledger.engine.kv.claims import blocks_for
from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.kv.safety import Overcommit, peak_blocks
from kvledger.engine.sampling.params import SamplingParams


def test_a_completion_order_is_found_by_taking_the_smallest_need_first():
    refs = [1] * 8
    # 2 unused: the one needing 2 finishes and gives back its 3 blocks, then the one needing 5.
    assert completion_order_exists(2, [Claim(5, [0, 1]), Claim(2, [2, 3, 4])], refs)
    assert not completion_order_exists(1, [Claim(5, [0, 1]), Claim(2, [2, 3, 4])], refs)


def test_a_shared_block_comes_back_with_its_last_holder():
    refs = [2, 1, 1]  # block 0 is held by both
    # After the first finishes only block 1 comes back: 1 + 1 = 2 < 3.
    assert not completion_order_exists(1, [Claim(1, [0, 1]), Claim(3, [0, 2])], refs)
    assert completion_order_exists(2, [Claim(1, [0, 1]), Claim(3, [0, 2])], refs)


def test_peak_blocks_counts_each_request_until_its_last_step():
    # 4 tokens a block. One from 16 to 20 tokens (4 steps), one from 0 to 20 (20 steps):
    # at the first's last step it holds 5 blocks and the other 1; later the other alone 5.
    assert peak_blocks([(16, 20), (0, 20)], 4) == 6
    assert peak_blocks([(4, 20), (0, 20)], 4) == 5 + 4  # the first ends as the second has 16


def test_safe_admits_what_reserving_refuses_and_pauses_a_draw_that_would_strand_someone():
    reserve, safe = KVLedger(8, 4), KVLedger(8, 4, overcommit=True)
    reserved, first = reserve.try_reserve(20), safe.try_reserve(20)  # 5 blocks each
    reserve.grow(reserved, 4)
    safe.grow(first, 4)
    # Run to their caps, they would hold 9 blocks at once: neither way admits.
    assert reserve.try_reserve(20) is None and safe.try_reserve(20) is None
    assert reserve.grow(reserved, 16) == 16 and safe.grow(first, 16) == 16
    assert reserve.try_reserve(20) is None  # 4 + 1 + 5 > 8 promised
    second = safe.try_reserve(20)  # the first is done before the second needs its third block
    assert second is not None and safe.reserved_blocks == 10 > safe.num_blocks
    # If the first stalls while the second runs ahead (a step it was not scheduled), the
    # second's third block leaves 1 unused, enough for the first's last one...
    assert safe.grow(second, 12) == 12
    # ...a fourth would leave none while each needs one more: refused, and it pauses.
    assert safe.grow(second, 13) == 12
    assert safe.paused_reservations == 1
    assert safe.try_reserve(4) is None  # nobody new while someone is paused
    assert safe.grow(first, 20) == 20  # the first draws all it may need, and finishes
    safe.release(first)
    assert safe.grow(second, 20) == 20 and safe.paused_reservations == 0
    safe.release(second)
    assert safe.used_blocks == safe.reserved_blocks == 0


def test_safe_over_commits_for_no_more_requests_than_the_engine_seats():
    roomy = KVLedger(100, 4, overcommit=True, max_live=2)
    # Every promise drawable at once (as reserving): any order finishes, seats or not.
    assert all(roomy.try_reserve(4) for _ in range(3))
    for seats, admitted in ((2, False), (3, True)):
        ledger = KVLedger(4, 4, overcommit=True, max_live=seats)
        first, _ = ledger.try_reserve(8), ledger.try_reserve(8)  # the whole pool
        ledger.grow(first, 8)  # at its cap: it is done after this step
        third = ledger.try_reserve(4)  # over-commits: the third needs a seat
        assert (third is not None) is admitted
        if not admitted:
            assert ledger.overcommit.refusal == (
                "2 requests are admitted, at most 2 over-committed (--max-num-seqs)")


@settings(max_examples=200, deadline=None)
@given(timelines=st.lists(st.tuples(st.integers(0, 70), st.integers(1, 60)), max_size=12),
       block_size=st.sampled_from([1, 4, 16]))
def test_peak_blocks_sweep_equals_counting_every_step(timelines, block_size):
    timelines = [(start, start + length) for start, length in timelines]
    timelines.append((30, 30))  # at its cap: it holds its 30 tokens for one more step
    by_step = 0
    for step in range(61):  # at each step, every request still writing holds its blocks
        by_step = max(by_step, sum(blocks_for(min(start + step + 1, total), block_size)
                                   for start, total in timelines
                                   if max(total - start, 1) > step))
    assert peak_blocks(timelines, block_size) == by_step


def _simulate(seed: int, caching: bool) -> list[int]:
    """Requests arrive at random; each step every live one asks for a slot for its next
    token, oldest first. Returns what each grow gave, in order; asserts that some request
    advances each step and all of them finish."""
    rng = random.Random(seed)
    block_size, ledger = 4, KVLedger(12, 4, enable_prefix_caching=caching, overcommit=True,
                                     max_live=6)
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [7] * 6, [11, 12]]
    live, arrivals, steps, grown = [], 40, 0, []
    while arrivals or live:
        if arrivals and rng.random() < 0.6:
            prompt = [*rng.choice(prefixes), rng.randrange(20, 90)]
            total = len(prompt) + rng.randrange(1, 30)
            reservation = ledger.try_reserve(min(total, ledger.num_blocks * block_size), prompt)
            if reservation is not None:
                arrivals -= 1
                tokens = reservation.num_cached_tokens
                live.append([reservation, prompt, min(total, ledger.num_blocks * block_size),
                             tokens])
        advanced = False
        for entry in list(live):
            reservation, prompt, total, tokens = entry
            held = ledger.grow(reservation, tokens + 1)
            grown.append(held)
            if held > tokens:
                entry[3] = tokens + 1
                advanced = True
                ledger.prefix_cache.register(reservation, prompt + [0] * total, min(entry[3], len(prompt)))
            if entry[3] == total:
                ledger.release(reservation)
                live.remove(entry)
        assert ledger.used_blocks <= ledger.num_blocks
        assert advanced or not live, "no live request could advance: the state was not safe"
        steps += 1
        assert steps < 5000
    assert ledger.used_blocks == 0 and ledger.paused_reservations == 0
    return grown


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), caching=st.booleans())
def test_every_admitted_request_reaches_its_cap_without_a_failed_draw(seed, caching):
    _simulate(seed, caching)


def _simulate_choices(seed: int) -> tuple[int, int]:
    """Requests of 1-3 choices (``n``) that share their prompt's blocks: the first computes
    them, the others wait, then pin them (``share_prompt``) unless that would be unsafe,
    in which case they compute their own. Each step every running choice asks for its next
    token. Returns how many choices shared and how many were refused the share."""
    rng = random.Random(seed)
    block_size, ledger = 4, KVLedger(14, 4, overcommit=True, max_live=6)
    live, arrivals, steps, shared, refused = [], 30, 0, 0, 0
    while arrivals or live:
        if arrivals and rng.random() < 0.5:
            prompt = [rng.randrange(1, 90) for _ in range(rng.randrange(9, 21))]
            total, count = len(prompt) + rng.randrange(1, 16), rng.randrange(1, 4)
            reservations = ledger.try_reserve_each(total, count, prompt)
            if reservations is not None:
                arrivals -= 1
                live += [[r, total, 0] for r in reservations]
        advanced = False
        for entry in list(live):
            reservation, total, tokens = entry
            if reservation.awaits_share:
                continue
            tokens = entry[2] = max(tokens, reservation.num_cached_tokens)
            if ledger.grow(reservation, tokens + 1) > tokens:
                entry[2], advanced = tokens + 1, True
                share = reservation.share
                if share and share.owner is reservation and entry[2] >= share.end * block_size:
                    waiting = len(share.waiting)
                    handed = ledger.share_prompt(reservation)
                    shared, refused = shared + len(handed), refused + waiting - len(handed)
            if entry[2] == total:
                ledger.release(reservation)
                live.remove(entry)
        assert ledger.used_blocks <= ledger.num_blocks
        assert advanced or not live, "no running choice could advance: the state was not safe"
        steps += 1
        assert steps < 5000
    assert ledger.used_blocks == 0 and ledger.reserved_blocks == 0
    return shared, refused


def test_choices_share_their_prompt_over_committed_and_all_reach_their_caps():
    results = [_simulate_choices(seed) for seed in range(40)]
    assert sum(shared for shared, _ in results) > 0


def test_a_share_that_would_strand_a_request_is_refused_and_that_choice_draws_its_own():
    """The first choice O holds the 2 shared prompt blocks and needs 1 more; Y holds 3 and
    needs 3; W awaits the share and then needs 4; 1 block unused. Checked as if W drew the
    2 itself, O finishes, gives them back, Y and then W finish. Pinned by W too, they come
    back only after both: Y, needing 3 of 1 unused, cannot be served. One step later (Y
    needs 1) the share is safe."""

    class Held:
        awaited_blocks, adapter, seated = 0, None, True

        def __init__(self, need, blocks):
            self.draws_left, self.block_ids = need, blocks

    class Pool:
        num_in_use, ref_counts, shared = 5, [1, 1, 1, 1, 1, 0], set()

    first, other, waiting = Held(1, [0, 1]), Held(3, [2, 3, 4]), Held(4, [])
    safety = Overcommit(6, 4, None, Pool())
    safety.admit([first, other, waiting], 9, 20, shared=2)
    assert not safety.may_share(waiting, [0, 1])
    assert safety.live[waiting][2] == 0  # projected as drawing its own
    other.draws_left = 1
    assert safety.may_share(waiting, [0, 1])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), caching=st.booleans())
def test_draws_granted_on_the_margin_are_those_a_full_check_grants(seed, caching):
    """A draw within the margin of the last full check is granted unchecked; every
    decision is the one checking each draw in full would make."""
    fast = _simulate(seed, caching)
    may_draw = Overcommit.may_draw

    def always_checked(self, *args):
        self._slack = None
        return may_draw(self, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Overcommit, "may_draw", always_checked)
        assert _simulate(seed, caching) == fast


def test_a_margin_of_m_grants_m_draws_before_checking_again():
    safety, full_checks = Overcommit(10, 4, None), []
    check = safety._margin_after
    safety._margin_after = lambda *args: full_checks.append(1) or check(*args)

    class Held:  # a reservation as the check sees it
        awaited_blocks, adapter, seated = 0, None, True

        def __init__(self, need, blocks):
            self.draws_left, self.block_ids = need, blocks

    big, small = Held(6, [0, 1]), Held(2, [2, 3])
    safety.admit([big, small], 0, 0)
    refs = [1] * 4 + [0] * 6
    # 6 unused: after small's draw (5 unused, needs 1) margin min(5 - 1, 5 + 3 - 6) = 2.
    assert safety.may_draw(small, 4, 8, refs) and len(full_checks) == 1
    small.draws_left, small.block_ids = 1, [2, 3, 4]
    assert safety.may_draw(big, 5, 7, [*refs, 1]) and safety.may_draw(big, 6, 6, refs + [1] * 2)
    assert len(full_checks) == 1  # the two draws the margin covered
    big.draws_left, big.block_ids = 4, [0, 1, 5, 6]
    # Margin spent: checked. After big's draw 2 unused; small (needs 1) gives back 3, then
    # big needs 3 of 2 + 3: safe.
    assert safety.may_draw(big, 7, 5, [1] * 7 + [0] * 3) and len(full_checks) == 2


def test_admission_must_be_reserve_or_safe(tiny_llama_dir):
    with pytest.raises(BadInput, match="--admission must be one of reserve, safe"):
        make_engine(tiny_llama_dir, admission="bank")


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    flags = dict(num_gpu_blocks_override=12, block_size=8, max_num_seqs=8, max_model_len=96)
    return (make_engine(tiny_llama_dir, admission="reserve", **flags),
            make_engine(tiny_llama_dir, admission="safe", **flags))


def _run(engine, requests):
    """Admit what the ledger takes, step, repeat; the outputs and the mean number of
    sequences running per step."""
    pending, steps, running = list(requests), 0, 0

    def admit():
        while pending:
            request_id, prompt, params = pending[0]
            request = engine.check_request(prompt, params)
            reservation = engine.ledger.try_reserve(request.num_tokens, prompt)
            if reservation is None:
                return
            engine.add_request(request_id, request, reservation=reservation)
            pending.pop(0)

    outputs = {}
    while pending or engine.has_unfinished_requests():
        admit()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        steps += 1
        running += len(engine.scheduler.running)
    return outputs, running / steps


def test_safe_runs_more_at_once_and_gives_the_same_greedy_tokens(engines):
    reserve, safe = engines
    rng = random.Random(7)
    requests = [(f"r{i}", [rng.randrange(3, 200) for _ in range(rng.randrange(4, 20))],
                 SamplingParams(temperature=0, max_tokens=rng.choice([8, 24, 48]), ignore_eos=True))
                for i in range(12)]
    reserved, reserve_running = _run(reserve, requests)
    overcommitted, safe_running = _run(safe, requests)
    assert {k: v.token_ids for k, v in overcommitted.items()} == {
        k: v.token_ids for k, v in reserved.items()}
    assert all(out.finish_reason == "length" for out in overcommitted.values())
    assert safe_running > 1.2 * reserve_running
    assert_pool_empty(safe)
    assert safe.ledger.paused_reservations == 0


def test_a_sequence_refused_its_next_block_sits_out_and_its_tokens_do_not_change(
        tiny_llama_dir, monkeypatch):
    """The scheduler's side of a refused draw (the ledger's is tested above): for six
    steps the ledger grants "b" no new block, so its prefill chunk shrinks to the blocks it
    holds and then its decodes wait; every output still equals an undisturbed run's."""
    flags = dict(num_gpu_blocks_override=40, block_size=8, max_num_seqs=4, max_model_len=96,
                 max_num_batched_tokens=16)
    prompts = {"a": list(range(3, 30)), "b": list(range(40, 70)), "c": [5, 6, 7]}
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def run(engine, refuse_steps=()):
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, params)
        grow, step, held_back = engine.ledger.grow, [0], []

        def grow_unless_refused(reservation, num_tokens):
            b = engine.scheduler.running.get("b")
            if step[0] in refuse_steps and b is not None and reservation is b.reservation:
                held = len(reservation.block_ids) * engine.ledger.block_size
                if held < num_tokens:
                    held_back.append(step[0])
                    return held
            return grow(reservation, num_tokens)

        monkeypatch.setattr(engine.ledger, "grow", grow_unless_refused)
        outputs, tokens_of_b = {}, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.token_ids
            b = engine.scheduler.running.get("b")
            tokens_of_b.append(b.num_computed_tokens if b else None)
            step[0] += 1
        monkeypatch.undo()
        return outputs, tokens_of_b, held_back

    expected, _, _ = run(make_engine(tiny_llama_dir, **flags))
    engine = make_engine(tiny_llama_dir, **flags)
    outputs, progress, held_back = run(engine, refuse_steps=range(1, 7))
    assert outputs == expected
    assert held_back  # b was refused blocks it needed...
    assert progress[1:7] == [0] * 6 and progress[7] > 0  # ...sat out, then went on
    assert_pool_empty(engine)


def test_the_early_429_is_not_taken_when_free_blocks_do_not_decide():
    """Reserving, a pool whose free blocks cannot hold the least a request could claim is
    refused before tokenizing; over-committing, admission asks other questions, so the
    request is tokenized and tried."""
    from kvledger.engine.admission.line import Admission

    for overcommit, early in ((False, True), (True, False)):
        ledger = KVLedger(10, 16, overcommit=overcommit)
        held = ledger.try_reserve(144)  # 9 of 10 blocks promised
        admission = Admission(ledger, max_model_len=160, max_queue_len=0)
        assert (admission.early_rejection(20, 40) is not None) is early
        ledger.release(held)


def test_a_choice_refused_its_share_computes_its_prompt_and_the_ledger_balances():
    ledger = KVLedger(40, 4, overcommit=True)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks shared
    owner, refused, sharing = ledger.try_reserve_each(20, 3, prompt)
    before = ledger.reserved_blocks  # 5 + 2 x (5 - 3)
    assert before == 9 and refused.awaits_share
    ledger.grow(owner, 14)
    ledger.overcommit.may_share = lambda reservation, blocks: reservation is not refused
    assert ledger.share_prompt(owner) == [sharing]
    assert refused.share is None and not refused.awaits_share and refused.block_ids == []
    assert refused.draws_left == 5 and ledger.reserved_blocks == before + 3
    assert sharing.block_ids == owner.block_ids[:3] and sharing.num_cached_tokens == 12
    for reservation in (owner, refused, sharing):
        assert ledger.grow(reservation, 20) == 20
        ledger.release(reservation)
    assert ledger.used_blocks == ledger.reserved_blocks == 0
