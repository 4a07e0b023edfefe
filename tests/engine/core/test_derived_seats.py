"""An engine under ``--memory-limit`` with ``--max-num-seqs`` not given runs with the
concurrency its KV pool holds (planner/seats.py): the scheduler's seats and the ledger's
live reservations are the plan's ``max_num_seqs``, and no step runs more."""

from __future__ import annotations

import pytest
from _engine_helpers import assert_pool_empty, drain

from kvledger.engine.core.engine import LLMEngine
from kvledger.engine.core.runner import ModelRunner
from kvledger.engine.errors import DoesNotFit
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.settings.config import EngineConfig

MAX_MODEL_LEN = 1024
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def limit_holding(model_dir, sequences: int) -> tuple[int, int]:
    """A --memory-limit whose pool holds ``sequences`` full-context sequences at that many
    seats (planned, as the engine's pre-flight plans it), and those seats' activations."""
    config = EngineConfig(model=str(model_dir), device="cpu", max_model_len=MAX_MODEL_LEN,
                          max_num_seqs=sequences, memory_limit_bytes=2**30)
    plan = make_plan(config)
    non_kv = plan.required_bytes - plan.classes["kv_cache"]
    return non_kv + sequences * plan.kv.bytes_per_seq, plan.classes["activations"]


def engine(model_dir, limit: int) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(
        model=str(model_dir), device="cpu", max_model_len=MAX_MODEL_LEN,
        memory_limit_bytes=limit))


def test_the_engine_runs_with_the_seats_its_pool_holds(tiny_llama_dir, monkeypatch):
    limit, activations = limit_holding(tiny_llama_dir, 3)
    # The profile measures what the planner estimated: both plans derive the same seats.
    monkeypatch.setattr(ModelRunner, "profile", lambda self, *a: activations)
    e = engine(tiny_llama_dir, limit)
    assert (e.plan.max_num_seqs, e.plan.max_num_seqs_source) == (3, "kv-pool")
    assert e.plan.kv.sequences == 3 and e.plan.config.max_num_seqs is None
    assert e.scheduler.max_num_seqs == 3
    assert e.ledger.overcommit.max_live == 3
    running = []
    for i in range(8):
        e.add_request(f"r{i}", [5 + i] * 10, GREEDY)
    final = drain(e, on_step=lambda _: running.append(len(e.scheduler.running)))
    assert len(final) == 8 and max(running) == 3
    assert all(len(out.token_ids) == 12 for out in final.values())
    assert_pool_empty(e)


def test_a_measured_peak_above_the_estimate_takes_seats_away(tiny_llama_dir, monkeypatch):
    limit, activations = limit_holding(tiny_llama_dir, 3)
    per_seq = make_plan(EngineConfig(model=str(tiny_llama_dir), device="cpu",
                                     max_model_len=MAX_MODEL_LEN)).kv.bytes_per_seq
    monkeypatch.setattr(ModelRunner, "profile", lambda self, *a: activations + 2 * per_seq)
    e = engine(tiny_llama_dir, limit)
    assert e.plan.max_num_seqs == e.scheduler.max_num_seqs == 1
    assert "activations" in e.plan.measured


def test_a_declared_max_num_seqs_the_pool_cannot_hold_is_refused(tiny_llama_dir):
    limit, _ = limit_holding(tiny_llama_dir, 3)
    with pytest.raises(DoesNotFit) as info:
        LLMEngine.from_config(EngineConfig(
            model=str(tiny_llama_dir), device="cpu", max_model_len=MAX_MODEL_LEN,
            max_num_seqs=8, memory_limit_bytes=limit))
    assert info.value.plan.max_num_seqs == 8 and not info.value.plan.fits
    assert "--max-num-seqs" in {r.flag for r in info.value.plan.remedies}


def test_not_one_sequence_is_refused_before_anything_loads(tiny_llama_dir, monkeypatch):
    limit, _ = limit_holding(tiny_llama_dir, 1)
    monkeypatch.setattr(ModelRunner, "profile", lambda self, *a: pytest.fail("loaded"))
    with pytest.raises(DoesNotFit) as info:
        engine(tiny_llama_dir, limit - 2**20)
    assert info.value.plan.max_num_seqs == 1 and not info.value.plan.fits
    assert "must hold one sequence of 1024 tokens" in info.value.report
