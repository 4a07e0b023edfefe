"""LLMEngine: admission against the ledger, continuous batching limits, stopping rules,
aborts from another thread, and start-up refusals."""

from __future__ import annotations

import itertools
import threading

import pytest
from _engine_helpers import assert_pool_empty, drain, make_engine

from kvledger.engine.errors import AdmissionRejected, BadInput, DoesNotFit, PromptTooLong
from kvledger.engine.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir)


def test_pool_is_sized_by_the_plan_and_the_plan_is_the_measured_one(engine):
    assert engine.ledger.num_blocks == engine.plan.kv.num_blocks == 4 * 128 // 16
    assert "weights" in engine.plan.measured
    assert engine.runner.kv_cache.shape[3] == engine.plan.kv.num_blocks


def test_max_tokens_ends_with_length_and_releases_everything(engine):
    engine.add_request("a", [5, 6, 7], GREEDY)
    final = drain(engine)
    assert len(final["a"].token_ids) == 8 and final["a"].finish_reason == "length"
    assert final["a"].text == engine.tokenizer.decode(final["a"].token_ids)
    assert_pool_empty(engine)


def test_unset_max_tokens_means_up_to_the_context_limit(engine):
    engine.add_request("ctx", [5] * 100, SamplingParams(temperature=0, ignore_eos=True))
    assert engine.ledger.reserved_blocks == 128 // 16
    final = drain(engine)
    assert len(final["ctx"].token_ids) == 28 and final["ctx"].finish_reason == "length"
    assert_pool_empty(engine)


def test_greedy_is_deterministic_and_independent_of_batch_company(engine):
    engine.add_request("alone", [9, 10, 11, 12], GREEDY)
    alone = drain(engine)["alone"].token_ids
    for i in range(4):
        engine.add_request(f"crowd-{i}", [9, 10, 11, 12] if i == 2 else [20 + i] * (3 + 7 * i), GREEDY)
    assert drain(engine)["crowd-2"].token_ids == alone


def test_seeded_sampling_reproduces_regardless_of_batch(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12,
                            ignore_eos=True)
    engine.add_request("s1", [3, 4, 5], params)
    first = drain(engine)["s1"].token_ids
    engine.add_request("other", [8] * 20, SamplingParams(temperature=1.0, max_tokens=12))
    engine.add_request("s2", [3, 4, 5], params)
    assert drain(engine)["s2"].token_ids == first
    engine.add_request("s3", [3, 4, 5], SamplingParams(temperature=1.0, seed=99, max_tokens=12,
                                                        ignore_eos=True))
    assert drain(engine)["s3"].token_ids != first


def test_stop_token_ids_and_eos_stop_with_the_token_kept(engine):
    engine.add_request("probe", [40, 41, 42], GREEDY)
    tokens = drain(engine)["probe"].token_ids
    engine.add_request("stop-id", [40, 41, 42], SamplingParams(
        temperature=0, max_tokens=8, stop_token_ids=[tokens[2]], ignore_eos=True))
    out = drain(engine)["stop-id"]
    assert out.token_ids == tokens[:tokens.index(tokens[2]) + 1] and out.finish_reason == "stop"

    eos = sorted(engine.tokenizer.eos_token_ids)[0]
    engine.tokenizer.eos_token_ids.add(tokens[1])  # pretend the 2nd token is an EOS
    try:
        engine.add_request("eos", [40, 41, 42], SamplingParams(temperature=0, max_tokens=8))
        engine.add_request("ignore", [40, 41, 42], SamplingParams(temperature=0, max_tokens=8,
                                                                   ignore_eos=True))
        final = drain(engine)
    finally:
        engine.tokenizer.eos_token_ids.discard(tokens[1])
    assert eos in engine.tokenizer.eos_token_ids
    assert final["eos"].finish_reason == "stop" and final["eos"].token_ids[-1] == tokens[1]
    assert final["ignore"].token_ids == tokens


def test_stop_string_is_cut_from_the_text(engine):
    engine.add_request("probe", [60, 61], GREEDY)
    probe = drain(engine)["probe"]
    stop = probe.text[3:6]
    assert len(stop) == 3
    engine.add_request("stop", [60, 61], SamplingParams(temperature=0, max_tokens=8, stop=stop,
                                                         ignore_eos=True))
    streamed = []
    out = drain(engine, lambda outs: streamed.extend(o.text for o in outs))["stop"]
    assert out.finish_reason == "stop" and out.text == probe.text[:probe.text.index(stop)]
    # Streamed text only grows, and never shows what the stop string later cut.
    assert all(a == b[:len(a)] for a, b in itertools.pairwise(streamed)) and streamed[-1] == out.text
    assert_pool_empty(engine)


def test_prompt_at_or_over_the_context_is_refused_without_a_reservation(engine):
    with pytest.raises(PromptTooLong):
        engine.add_request("long", [5] * 128, GREEDY)
    with pytest.raises(BadInput, match="exceed the context"):
        engine.add_request("cap", [5] * 100, SamplingParams(max_tokens=29))
    with pytest.raises(BadInput):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(BadInput):
        engine.add_request("oov", [10**6], GREEDY)
    assert_pool_empty(engine)
    assert not engine.has_unfinished_requests()


def test_admission_is_rejected_when_prompt_plus_cap_does_not_fit(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_gpu_blocks_override=10, admission="reserve")
    engine.add_request("big", [5] * 60, SamplingParams(max_tokens=68))  # 8 blocks
    with pytest.raises(AdmissionRejected) as info:
        engine.add_request("next", [5] * 20, SamplingParams(max_tokens=20))  # 3 blocks
    assert (info.value.needed_blocks, info.value.free_blocks) == (3, 2)
    engine.add_request("small", [5] * 20, SamplingParams(max_tokens=12, ignore_eos=True))
    assert engine.ledger.reserved_blocks == 10
    engine.abort_request("big")
    assert engine.ledger.reserved_blocks == 2  # a pending request's blocks return at once
    drain(engine)
    assert_pool_empty(engine)


def test_batch_limits_are_respected_and_long_prompts_are_chunked(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=3, max_num_batched_tokens=40,
                         num_gpu_blocks_override=200)
    for i in range(7):
        engine.add_request(f"r{i}", [7 + i] * (50 + i), SamplingParams(temperature=0, max_tokens=4 + i,
                                                                       ignore_eos=True))
    batches = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        batches.append(batch)
        assert len(engine.scheduler.running) <= 3
        assert sum(c.length for c in batch.prefills) + len(batch.decodes) <= 40
        return batch

    engine.scheduler.schedule = recording_schedule
    final = drain(engine)
    assert sorted(final) == [f"r{i}" for i in range(7)]
    assert [len(final[f"r{i}"].token_ids) for i in range(7)] == [4 + i for i in range(7)]
    assert max(len(b.decodes) + len(b.prefills) for b in batches) == 3
    assert any(c.start > 0 for b in batches for c in b.prefills)  # prompts of 50+ in 40-token steps
    assert any(b.prefills and b.decodes for b in batches)  # prefill and decode in one step
    assert_pool_empty(engine)

    # The same requests, each alone with a whole-prompt budget, give the same tokens.
    whole = make_engine(tiny_llama_dir, max_num_seqs=1, num_gpu_blocks_override=200)
    for i in range(7):
        whole.add_request(f"r{i}", [7 + i] * (50 + i), SamplingParams(temperature=0, max_tokens=4 + i,
                                                                      ignore_eos=True))
    assert {k: v.token_ids for k, v in drain(whole).items()} == {k: v.token_ids for k, v in final.items()}


def test_abort_of_a_running_request_frees_its_blocks_at_the_next_step(engine):
    engine.add_request("victim", [5] * 30, SamplingParams(temperature=0, ignore_eos=True))
    engine.add_request("bystander", [6] * 10, GREEDY)
    engine.step()
    assert engine.ledger.used_blocks > 0
    engine.abort_request("victim")
    engine.abort_request("victim")  # idempotent
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["victim"].finished and outputs["victim"].finish_reason == "abort"
    assert engine.ledger.reserved_blocks == engine.ledger.blocks_for(10 + 8)
    final = drain(engine)
    assert final["bystander"].finish_reason == "length" and "victim" not in final
    engine.abort_request("victim")  # after it is gone: nothing happens
    assert_pool_empty(engine)
    assert not engine.has_unfinished_requests()


def test_requests_added_and_aborted_from_another_thread_while_stepping(engine):
    stop = threading.Event()
    results, errors = {}, []

    def loop():
        try:
            while not stop.is_set() or engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    worker = threading.Thread(target=loop)
    worker.start()
    for i in range(12):
        engine.add_request(f"t{i}", [30 + i] * (5 + i), SamplingParams(temperature=0, max_tokens=20,
                                                                       ignore_eos=True))
        if i % 3 == 0:
            engine.abort_request(f"t{i}")
    stop.set()
    worker.join(timeout=60)
    assert not errors and not worker.is_alive()
    assert sorted(results) == sorted(f"t{i}" for i in range(12))
    for i in range(12):
        expected = "abort" if i % 3 == 0 else "length"
        assert results[f"t{i}"].finish_reason == expected
    assert_pool_empty(engine)


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("dup", [5, 6], GREEDY)
    with pytest.raises(BadInput, match="already in use"):
        engine.add_request("dup", [5, 6], GREEDY)
    theirs = engine.ledger.try_reserve(10)
    with pytest.raises(BadInput, match="already in use"):
        engine.add_request("dup", [5, 6], GREEDY, reservation=theirs)
    assert theirs.released  # a refused request's reservation is given back
    drain(engine)
    engine.add_request("dup", [5, 6], GREEDY)  # free again once finished
    drain(engine)
    small = engine.ledger.try_reserve(1)
    with pytest.raises(BadInput, match="reservation holds 1 blocks"):
        engine.add_request("big", [5] * 20, GREEDY, reservation=small)
    assert small.released
    assert_pool_empty(engine)


def test_run_that_does_not_fit_is_refused_with_the_planner_report(tiny_llama_dir):
    with pytest.raises(DoesNotFit) as info:
        make_engine(tiny_llama_dir, memory_limit_bytes=1_000_000)
    assert "weights" in info.value.report and info.value.plan is not None
    assert not info.value.plan.fits


def test_unsupported_architecture_is_refused_by_name(tmp_path, tiny_llama_dir):
    import json
    import shutil

    model_dir = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInput, match="unsupported architecture GPT2LMHeadModel"):
        make_engine(model_dir)


def test_abort_all_releases_every_request_without_stepping(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    engine.add_request("running", [5] * 10, GREEDY)
    engine.step()
    engine.add_request("pending", [6] * 10, GREEDY)
    engine.abort_all()
    assert_pool_empty(engine)
    assert not engine.has_unfinished_requests()
    engine.add_request("running", [5] * 10, GREEDY)  # ids are free again
    assert drain(engine)["running"].finish_reason == "length"


def test_an_interrupted_generate_releases_its_blocks(tiny_llama_dir, monkeypatch):
    from kvledger.engine.llm import LLM

    llm = LLM(str(tiny_llama_dir), max_model_len=128, max_num_seqs=4, device="cpu")
    real_step, calls = llm.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5] * 10] * 6, GREEDY)
    assert_pool_empty(llm.engine)
    assert not llm.engine.has_unfinished_requests()


def test_a_run_that_fits_on_paper_but_not_as_measured_is_refused(tiny_llama_dir, monkeypatch):
    from kvledger.engine.core.runner import ModelRunner

    # The estimate fits in 1 GiB; a profile step that peaks at 4 GiB does not.
    monkeypatch.setattr(ModelRunner, "profile", lambda self, *a: 4 * 2**30)
    with pytest.raises(DoesNotFit) as info:
        make_engine(tiny_llama_dir, memory_limit_bytes=2**30)
    assert info.value.plan.classes["activations"] == 4 * 2**30
    assert "activations" in info.value.plan.measured and not info.value.plan.fits


def test_decode_groups_cut_padding_and_cover_every_sequence():
    from kvledger.engine.core.step_attention import _group_bounds

    assert _group_bounds([]) == [] and _group_bounds([3]) == [1] and _group_bounds([5] * 6) == [6]
    assert _group_bounds([1, 1, 1, 1, 10, 10]) == [4, 6]
    widths = sorted([2, 3, 4, 5, 8, 9, 12, 14, 20, 24] * 3)
    ends = _group_bounds(widths)
    assert ends == sorted(set(ends)) and ends[-1] == len(widths) and len(ends) <= 4
    padded = sum((end - start) * widths[end - 1] for start, end in zip([0, *ends[:-1]], ends, strict=True))
    assert padded < 0.7 * len(widths) * widths[-1]


def test_many_lengths_decoded_in_groups_match_each_run_alone(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=8, block_size=4)
    prompts = {f"g{n}": [7 + n] * n for n in (1, 3, 9, 17, 30, 44, 60, 75)}
    alone = {}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
        alone[rid] = drain(engine)[rid].token_ids
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    together = drain(engine)
    assert {rid: out.token_ids for rid, out in together.items()} == alone


@pytest.mark.parametrize("admission", ["reserve", "safe"])
def test_random_adds_aborts_and_steps_never_over_commit_and_drain_to_zero(tiny_llama_dir,
                                                                           admission):
    """Reserving, the promises never exceed the pool; over-committing (safe), the blocks
    held never do. Either way the accounts add up and the pool drains to zero."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    engine = make_engine(tiny_llama_dir, max_num_seqs=3, max_num_batched_tokens=48,
                         num_gpu_blocks_override=20, block_size=8, admission=admission)
    action = st.one_of(
        st.tuples(st.just("add"), st.integers(1, 60), st.integers(1, 40)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.just(0)),
        st.tuples(st.just("step"), st.just(0), st.just(0)),
    )

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(action, min_size=1, max_size=25))
    def run(actions):
        ids = []
        for kind, a, b in actions:
            if kind == "add":
                rid = f"q{len(ids)}"
                try:
                    engine.add_request(rid, [5 + a % 7] * a, SamplingParams(temperature=0, max_tokens=b,
                                                                            ignore_eos=True))
                    ids.append(rid)
                except (AdmissionRejected, BadInput):
                    pass
            elif kind == "abort" and ids:
                engine.abort_request(ids[a % len(ids)])
            else:
                engine.step()
            ledger = engine.ledger
            held = ledger.reserved_blocks if admission == "reserve" else ledger.used_blocks
            assert held <= ledger.num_blocks
            live = (list(engine.scheduler.running.values()) + list(engine.scheduler.waiting)
                    + list(engine.intake.pending_adds.values()))
            assert all(s.reservation.used_blocks <= s.reservation.num_blocks for s in live)
            # Prompts repeat, so cached prefix blocks are shared: each counts once.
            assert ledger.used_blocks == len({b for s in live for b in s.block_ids})
            assert ledger.reserved_blocks == ledger.used_blocks + sum(
                s.reservation.draws_left for s in live)
        drain(engine)
        assert_pool_empty(engine)

    run()
