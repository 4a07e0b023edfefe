"""The runtime guard in the engine loop: a fault fails the requests it touches, never the
engine. Faults are injected where a real one would rise: one sequence's sampling or
detokenizing, and the batched forward pass (as ``torch.OutOfMemoryError``)."""

from __future__ import annotations

import pytest
import torch
from _engine_helpers import assert_pool_empty, drain, make_engine

from kvledger.engine.core.engine import MAX_CONSECUTIVE_FAILED_STEPS, EngineFailed
from kvledger.engine.sampling.params import SamplingParams

PROMPTS = {f"r{i}": [5 + i, 17, 40 + 3 * i, 9] * (1 + i % 3) for i in range(6)}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3-moe"])
def model_dir(request, make_model_dir):
    """A dense model, and one whose experts are chosen per token of the step's batch."""
    return make_model_dir(request.param)


@pytest.fixture
def engine(model_dir):
    return make_engine(model_dir, max_num_seqs=8)


@pytest.fixture(scope="module")
def reference(model_dir) -> dict:
    """Every request's tokens when nothing fails."""
    clean = make_engine(model_dir, max_num_seqs=8)
    for request_id, prompt in PROMPTS.items():
        clean.add_request(request_id, prompt, SAMPLED if request_id == "r1" else GREEDY)
    return {rid: out.token_ids for rid, out in drain(clean).items()}


def add_all(engine) -> None:
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, SAMPLED if request_id == "r1" else GREEDY)


def assert_others_exact(final: dict, reference: dict, failed: set[str]) -> None:
    for request_id, out in final.items():
        if request_id in failed:
            continue
        assert out.finish_reason == "length" and out.error is None
        assert out.token_ids == reference[request_id], request_id


def test_a_sampling_fault_fails_that_request_alone(engine, reference, monkeypatch):
    real = engine.sampler

    def sampler(logits, seqs):
        if any(seq.request_id == "r1" and len(seq.output_token_ids) == 3 for seq in seqs):
            raise RuntimeError("injected sampling fault")
        return real(logits, seqs)

    monkeypatch.setattr(engine, "sampler", sampler)
    add_all(engine)
    final = drain(engine)
    assert final["r1"].finish_reason == "error"
    assert "sampling failed: RuntimeError: injected sampling fault" in final["r1"].error
    assert final["r1"].token_ids == reference["r1"][:3]  # what it had before the fault
    assert_others_exact(final, reference, {"r1"})
    assert_pool_empty(engine)


def test_a_sampling_fault_partway_through_the_batch_does_not_redraw_seeded_bystanders(
        engine, monkeypatch):
    """The batched sampler fails after a seeded row drew; the rows retried alone must draw
    what they would have drawn in the batch, so the seeded request equals its solo run."""
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    faulty = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    short, long = [5, 17, 40, 9], [6, 17, 43, 9] * 3  # decodes go shortest context first
    engine.add_request("alone", short, seeded)
    solo = drain(engine)["alone"].token_ids
    real_sample_row = engine.sampler._sample_row
    calls: list[str] = []       # the rows drawn, in order
    faults: list[list[str]] = []  # the rows drawn before each injected fault

    def sample_row(logits, seq):
        if seq.request_id == "faulty" and len(seq.output_token_ids) == 3:
            faults.append(list(calls))
            raise RuntimeError("injected fault after the seeded row drew")
        calls.append(seq.request_id)
        return real_sample_row(logits, seq)

    monkeypatch.setattr(engine.sampler, "_sample_row", sample_row)
    engine.add_request("seeded", short, seeded)
    engine.add_request("faulty", long, faulty)
    final = drain(engine)
    # In the batched call the seeded row drew just before the faulty one raised.
    assert faults and faults[0][-1] == "seeded"
    assert final["faulty"].finish_reason == "error"
    assert final["seeded"].finish_reason == "length"
    assert final["seeded"].token_ids == solo
    assert_pool_empty(engine)


class _DeadEndMatcher:
    """A grammar's state that allows anything for ``steps`` tokens, then nothing: what a
    client's grammar does when it can be started but not finished."""

    def __init__(self, steps: int) -> None:
        self.steps, self.dead_end, self.is_terminated = steps, False, False

    def fill_mask(self, row) -> None:
        if self.steps == 0:
            self.dead_end = True  # the library allows nothing: the row is left raw

    def apply_mask(self, row) -> None:  # allows anything until its dead end
        pass

    def accept(self, token_id: int) -> bool:
        if self.steps == 0:
            return False
        self.steps -= 1
        return True


class _DeadEndGrammar:
    def matcher(self):
        return _DeadEndMatcher(3)


def test_a_grammar_dead_end_finishes_the_request_as_grammar_not_as_a_fault(
        engine, reference, caplog):
    add_all(engine)
    engine.add_request("dead", [7, 8, 9], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, grammar=_DeadEndGrammar()))
    with caplog.at_level("WARNING", logger="kvledger.engine"):
        final = drain(engine)
    assert final["dead"].finish_reason == "grammar" and final["dead"].error is None
    assert len(final["dead"].token_ids) == 3  # what the grammar allowed
    assert not caplog.records  # a client's constraint: nothing logged as a failure
    assert_others_exact(final, reference, {"dead"})
    assert_pool_empty(engine)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bad_words_that_take_every_allowed_token_finish_it_as_grammar(
        engine, reference, caplog, temperature):
    """Once its output begins a bad word for each allowed token, no token is left: it
    finishes there, as at a grammar's dead end, and never writes (nor reports) a token
    outside the allowed ones, which the raw logits it falls back to would give."""
    add_all(engine)
    engine.add_request("banned", [7, 8, 9], SamplingParams(
        temperature=temperature, seed=3, max_tokens=12, ignore_eos=True,
        allowed_token_ids=[70, 71], bad_words_token_ids=[[70, 70], [70, 71], [71, 70, 71]]))
    reported = []
    with caplog.at_level("WARNING", logger="kvledger.engine"):
        final = drain(engine, lambda outputs: reported.extend(
            out.new_token_ids for out in outputs if out.request_id == "banned"))
    out = final["banned"]
    assert out.finish_reason == "grammar" and out.error is None
    assert set(out.token_ids) <= {70, 71} and out.token_ids[-1] == 70  # 70: both banned
    assert [t for new in reported for t in new] == out.token_ids
    assert not caplog.records
    assert_others_exact(final, reference, {"banned"})
    assert_pool_empty(engine)


def test_a_detokenizer_fault_fails_that_request_alone(engine, reference, monkeypatch):
    real = engine.tokenizer.detokenizer

    def detokenizer(prompt_ids, *args):
        inner = real(prompt_ids, *args)
        if prompt_ids != PROMPTS["r4"]:
            return inner

        class Faulty:
            def add(self, token_id):
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

        return Faulty()

    monkeypatch.setattr(engine.tokenizer, "detokenizer", detokenizer)
    add_all(engine)
    final = drain(engine)
    assert final["r4"].finish_reason == "error"
    assert final["r4"].error.startswith("postprocessing failed: UnicodeDecodeError")
    assert_others_exact(final, reference, {"r4"})
    assert_pool_empty(engine)


def test_an_out_of_memory_step_fails_its_requests_and_the_engine_goes_on(
        engine, reference, monkeypatch):
    real = engine.runner.execute
    calls = {"n": 0}

    def execute(batch):
        calls["n"] += 1
        if calls["n"] == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(batch)

    monkeypatch.setattr(engine.runner, "execute", execute)
    first = {"r0", "r1", "r2"}
    for request_id in sorted(first):
        engine.add_request(request_id, PROMPTS[request_id],
                           SAMPLED if request_id == "r1" else GREEDY)
    final = {}
    for _ in range(4):  # the fourth step's forward pass runs out of memory
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert {rid for rid, o in final.items() if o.finish_reason == "error"} == first
    assert all("forward pass failed: OutOfMemoryError" in final[r].error for r in first)
    assert_pool_empty(engine)
    assert engine.consecutive_failed_steps == 1
    # Requests that come after run as if nothing happened, and the count starts over.
    for request_id in ("r3", "r4", "r5"):
        engine.add_request(request_id, PROMPTS[request_id], GREEDY)
    later = drain(engine)
    assert_others_exact(later, reference, set())
    assert engine.consecutive_failed_steps == 0
    assert_pool_empty(engine)


def test_repeated_failed_steps_mean_the_engine_is_broken(engine, monkeypatch):
    def execute(batch):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(engine.runner, "execute", execute)
    failed = []
    for attempt in range(MAX_CONSECUTIVE_FAILED_STEPS - 1):
        engine.add_request(f"x{attempt}", [5, 6, 7], GREEDY)
        failed += [o for o in engine.step() if o.finish_reason == "error"]
    assert [o.request_id for o in failed] == [f"x{i}" for i in range(len(failed))]
    engine.add_request("last", [5, 6, 7], GREEDY)
    with pytest.raises(EngineFailed, match=f"{MAX_CONSECUTIVE_FAILED_STEPS} forward passes"):
        engine.step()
    assert_pool_empty(engine)  # even the step that gave up released what it failed

