"""Each rule a request meets has one owner the others call: the context cap
(``output_cap``), "fits the pool" (``KVLedger.check_fits``), the model's token ids
(``LLMEngine.check_prompt``/``check_params``), all applied once by ``check_request``; and a
reservation handed to the engine is released by the engine, refused or finished."""

from __future__ import annotations

import pytest
from _engine_helpers import assert_pool_empty, drain, make_engine

from kvledger.engine import LLM
from kvledger.engine.core.engine import LLMEngine
from kvledger.engine.core.request import output_cap
from kvledger.engine.errors import BadInput, CapTooLarge, PoolTooSmall, PromptTooLong
from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir)  # context 128, 8 blocks of 16


def test_the_cap_is_the_requested_one_or_the_rest_of_the_context():
    assert output_cap(100, 30, None) == 70
    assert output_cap(100, 30, 70) == 70
    assert output_cap(100, 30, 5) == 5
    assert output_cap(100, 99, None) == 1


def test_a_full_prompt_is_too_long_and_a_cap_over_the_room_too_large():
    for prompt_tokens in (100, 101):
        with pytest.raises(PromptTooLong) as info:
            output_cap(100, prompt_tokens, 1)
        assert (info.value.prompt_tokens, info.value.max_model_len) == (prompt_tokens, 100)
    with pytest.raises(CapTooLarge) as info:
        output_cap(100, 60, 41)
    assert (info.value.prompt_tokens, info.value.max_tokens, info.value.room_tokens) == (60, 41, 40)
    assert isinstance(info.value, BadInput) and "exceed the context" in str(info.value)


def test_fits_the_pool_counts_a_shared_prompt_once_and_nothing_cached():
    ledger = KVLedger(10, 16, enable_prefix_caching=True)
    assert ledger.check_fits(160) == 10
    with pytest.raises(PoolTooSmall) as info:
        ledger.check_fits(161)
    assert (info.value.needed_blocks, info.value.pool_blocks) == (11, 10)
    # Two choices of 96 tokens (6 blocks each) whose 49-token prompt has 3 full blocks.
    with pytest.raises(PoolTooSmall):
        ledger.check_fits(96, 2, 49)
    assert ledger.check_fits(96, 2, 49, share=True) == 12 - 3
    held = ledger.try_reserve(160)
    assert ledger.check_fits(160) == 10  # a verdict on the request, not on the moment
    ledger.release(held)


def test_check_request_applies_every_rule_and_returns_the_cap(engine):
    request = engine.check_request([5] * 100, SamplingParams(temperature=0))
    assert (request.prompt_token_ids, request.cap_tokens, request.num_tokens) == ([5] * 100, 28, 128)
    with pytest.raises(BadInput, match="empty"):
        engine.check_request([], GREEDY)
    with pytest.raises(BadInput, match="logit_bias"):
        engine.check_request([5], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(PromptTooLong):
        engine.check_request([5] * 128, GREEDY)
    # A planned pool always holds one whole context; an engine built on a smaller ledger
    # (as bench/admission.py builds them) still refuses what could never fit it.
    small = LLMEngine(engine.config, engine.plan, engine.tokenizer, engine.runner, KVLedger(4, 16))
    with pytest.raises(PoolTooSmall, match="a prompt needs 5 KV blocks; the pool has 4"):
        small.check_request([5] * 60, SamplingParams(max_tokens=8))
    assert_pool_empty(engine)


def test_a_checked_request_is_taken_as_it_is(engine, monkeypatch):
    request = engine.check_request([5, 6, 7], GREEDY)

    def again(*_):
        raise AssertionError("checked twice")

    monkeypatch.setattr(engine, "check_prompt", again)
    monkeypatch.setattr(engine, "check_params", again)
    engine.add_request("checked", request)
    assert drain(engine)["checked"].finish_reason == "length"
    assert_pool_empty(engine)


def test_a_refused_request_has_its_reservation_released_by_the_engine(engine):
    request = engine.check_request([5, 6, 7], GREEDY)
    engine.add_request("one", request)
    given = engine.ledger.try_reserve(request.num_tokens, request.prompt_token_ids)
    with pytest.raises(BadInput, match="already in use"):
        engine.add_request("one", request, reservation=given)
    assert given.released
    short = engine.ledger.try_reserve(16)  # one block; 20 + 8 tokens need two
    with pytest.raises(BadInput, match="reservation holds"):
        engine.add_request("two", engine.check_request([5] * 20, GREEDY), reservation=short)
    assert short.released
    drain(engine)
    assert_pool_empty(engine)


def test_abort_all_releases_a_request_a_failed_step_left_out_of_the_queues(engine):
    engine.add_request("lost", [5] * 10, GREEDY)
    engine.step()
    engine.scheduler.running.clear()  # as a step that raised half-way might leave it
    assert engine.ledger.reserved_blocks > 0
    engine.abort_all()
    assert_pool_empty(engine)
    assert not engine.has_unfinished_requests()


def test_llm_checks_every_prompt_before_anything_runs(tiny_llama_dir, monkeypatch):
    llm = LLM(str(tiny_llama_dir), max_model_len=96, device="cpu", num_gpu_blocks_override=12)
    steps = []
    monkeypatch.setattr(llm.engine, "step", lambda: steps.append(1) or [])
    for bad in ([5] * 96, [], [10**6]):  # the prompt after a good one
        with pytest.raises(BadInput):
            llm.generate([[5, 6], bad], GREEDY)
    assert not steps and llm.engine.ledger.reserved_blocks == 0
    assert not llm.engine.has_unfinished_requests()
