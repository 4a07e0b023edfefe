"""``--max-num-seqs`` not given under a cap: the KV pool takes what the cap leaves and the
plan's concurrency is the whole ``max_model_len`` sequences it holds (vLLM's semantics),
bounded by vllm serve's default; declared, the pool must hold that many (on Llama-3-8B's
published shape, as a vLLM user launches it on a 24 GB card)."""

from __future__ import annotations

import json

import pytest
from published_models import published_shape, published_weights

from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.planner.plan_line import plan_figures
from kvledger.engine.planner.record import Measured
from kvledger.engine.planner.report import render_report
from kvledger.engine.settings.config import EngineConfig

GiB = 2**30
LLAMA_8B = published_shape("Llama-3-8B")
WEIGHTS_8B = published_weights("Llama-3-8B")
L4 = DeviceMemory("what-if", "L4", 24 * 10**9, 24 * 10**9, False)  # "24 GB"
GPU_24 = DeviceMemory("what-if", "RTX 4090", 24 * GiB, 24 * GiB, False)
H100 = DeviceMemory("what-if", "H100", 80 * GiB, 80 * GiB, False)
A100 = DeviceMemory("what-if", "A100-SXM4-80GB", 80 * GiB, 80 * GiB, False)
CPU = DeviceMemory("cpu", "cpu", 64 * GiB, 64 * GiB, False)
VLLM_LINE = dict(gpu_memory_utilization=0.9, max_model_len=8192)


def plan(device: DeviceMemory = GPU_24, measured: Measured | None = None, **flags):
    config = EngineConfig(model="/unused", **flags)
    return make_plan(config, device=device, measured=measured, shape=LLAMA_8B,
                     weights=WEIGHTS_8B)


def test_the_pool_decides_the_seats_where_vllm_runs_the_model() -> None:
    p = plan(**VLLM_LINE)
    assert p.fits and p.max_num_seqs_source == "kv-pool"
    assert p.kv.pool_mode == "cap"
    assert p.kv.sequences == p.kv.num_blocks // p.kv.blocks_per_seq
    assert 1 <= p.max_num_seqs == p.kv.sequences < 16
    # The largest: one seat more, declared, does not fit (its pool holds one fewer).
    assert plan(**VLLM_LINE, max_num_seqs=p.max_num_seqs).fits
    assert not plan(**VLLM_LINE, max_num_seqs=p.max_num_seqs + 1).fits


def test_the_plan_is_that_of_the_seats_it_states() -> None:
    """Activations and CUDA graphs grow with the seats: the derived plan is the declared
    plan at the same seats, figure for figure."""
    derived = plan(**VLLM_LINE)
    declared = plan(**VLLM_LINE, max_num_seqs=derived.max_num_seqs)
    assert derived.classes == declared.classes
    assert derived.kv.num_blocks == declared.kv.num_blocks
    assert derived.required_bytes <= derived.limit_bytes


def test_a_declared_max_num_seqs_keeps_its_promise() -> None:
    p = plan(**VLLM_LINE, max_num_seqs=16)
    assert not p.fits and p.max_num_seqs == 16 and p.max_num_seqs_source == "--max-num-seqs"
    assert p.kv.required_blocks == 16 * p.kv.blocks_per_seq
    assert "--max-num-seqs" in {r.flag for r in p.remedies}


def test_the_report_and_the_json_say_what_the_pool_holds() -> None:
    p = plan(**VLLM_LINE)
    text = render_report(p)
    assert (f"concurrency: KV pool holds {p.kv.sequences} sequences of 8192 tokens: "
            f"max_num_seqs {p.max_num_seqs} (--max-num-seqs not given)") in text
    figures = json.loads(json.dumps(plan_figures(p)))
    assert figures["max_num_seqs"] == p.max_num_seqs
    assert figures["max_num_seqs_source"] == "kv-pool"
    assert figures["kv"]["sequences"] == p.kv.sequences


def test_one_sequence_that_does_not_fit_is_refused_with_remedies() -> None:
    flags = dict(gpu_memory_utilization=0.9, max_model_len=8192)
    small = DeviceMemory("what-if", "16 GB", 16 * 10**9, 16 * 10**9, False)
    p = plan(device=small, **flags)
    assert not p.fits and p.max_num_seqs == 1 and p.max_num_seqs_source == "kv-pool"
    assert p.kv.required_blocks == p.kv.blocks_per_seq
    remedies = {r.flag: r for r in p.remedies}
    assert "--max-num-seqs" not in remedies  # one seat is already the least
    tp = remedies["--tensor-parallel-size"]  # the weights alone leave no room: shard them
    sharded = plan(device=small, **flags, tensor_parallel_size=tp.value)
    assert sharded.fits and sharded.max_num_seqs >= 1
    assert tp.kv_bytes == sharded.classes["kv_cache"]
    text = render_report(p)
    assert text.startswith("error: engine requires")
    assert ("concurrency: --max-num-seqs not given: the KV pool left under the cap must hold "
            "one sequence of 8192 tokens") in text
    assert "one max_model_len=8192 sequence at least" in text


def test_a_refusal_remedy_for_the_context_is_the_largest_that_fits() -> None:
    flags = dict(memory_limit_bytes=18 * GiB, max_model_len=8192)
    p = plan(**flags)
    assert not p.fits and p.max_num_seqs == 1
    assert plan(**{**flags, "kv_cache_dtype": "fp8"}).fits
    best = {r.flag: r for r in p.remedies}["--max-model-len"].value
    assert plan(**{**flags, "max_model_len": best}).fits
    assert not plan(**{**flags, "max_model_len": best + 1}).fits


@pytest.mark.parametrize(("device", "bound"), [(GPU_24, 256), (H100, 1024), (A100, 256),
                                               (CPU, 128)])
def test_a_large_pool_is_bounded_by_vllm_serves_default(device, bound) -> None:
    p = plan(device=device, gpu_memory_utilization=0.9, max_model_len=64)
    assert p.fits and p.max_num_seqs == bound and p.kv.sequences > bound
    assert (f"max_num_seqs {bound} (--max-num-seqs not given; at most {bound}, vllm serve's "
            "default") in render_report(p)


def test_the_seats_are_never_more_than_a_step_holds() -> None:
    p = plan(gpu_memory_utilization=0.9, max_model_len=64, max_num_batched_tokens=100)
    assert p.fits and p.max_num_seqs == 100
    assert "(--max-num-seqs not given; at most 100, max_num_batched_tokens)" in render_report(p)


def test_the_seats_are_never_more_than_the_engine_profiled() -> None:
    """The engine re-plans with its measured activation peak: that peak holds for the
    seats it was profiled at, so the measured plan derives no more."""
    first = plan(gpu_memory_utilization=0.9, max_model_len=64)
    measured = Measured(activation_peak_bytes=first.classes["activations"], max_num_seqs=40)
    again = plan(measured=measured, gpu_memory_utilization=0.9, max_model_len=64)
    assert again.max_num_seqs == 40 and again.measured == ("activations",)


@pytest.mark.parametrize("flags", [dict(max_model_len=8192),
                                   dict(max_model_len=8192, memory_limit_bytes=22 * GiB,
                                        num_gpu_blocks_override=1024),
                                   dict(max_model_len=8192, memory_limit_bytes=22 * GiB,
                                        kv_cache_memory_bytes=2 * GiB)])
def test_without_a_cap_sizing_the_pool_the_default_is_16(flags) -> None:
    p = plan(device=H100, **flags)
    assert p.max_num_seqs == 16 and p.max_num_seqs_source == "default"
    assert "concurrency:" not in render_report(p)


def test_an_undeclared_max_num_seqs_renders_no_flag() -> None:
    config = EngineConfig(model="/m", max_model_len=8192, gpu_memory_utilization=0.9)
    assert config.max_num_seqs is None
    assert "--max-num-seqs" not in config.to_flags()
    declared = EngineConfig(model="/m", max_num_seqs=16)
    assert declared.to_flags()[-2:] == ["--max-num-seqs", "16"]
