"""Precedence, the KV pool, vLLM's formula, remedies and measured figures (on
Llama-3-8B's published shape; MLA and hybrid layouts: test_vllm_pool.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from budget_checkpoints import write_checkpoint
from published_models import published_shape, published_weights
from safetensors.torch import load_file, save_file

from kvledger.engine.checkpoint.contents import ModelShape, WeightsInfo
from kvledger.engine.errors import BadInput
from kvledger.engine.planner import estimates
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.planner.limit import largest_utilization
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.planner.record import CLASSES, Measured
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.config_values import DEFAULT_GRAMMAR_CACHE_BYTES

GiB = 2**30
MiB = 2**20
# Llama-3-8B's shape, with its real bf16 weight bytes (16,060,522,496 in 291 tensors).
LLAMA_8B = published_shape("Llama-3-8B")
WEIGHTS_8B = published_weights("Llama-3-8B")
GPU_80 = DeviceMemory("what-if", "H100", 80 * GiB, 79 * GiB, False)


def plan(device: DeviceMemory = GPU_80, measured: Measured | None = None,
         shape: ModelShape = LLAMA_8B, weights: WeightsInfo = WEIGHTS_8B, **flags):
    config = EngineConfig(model="/unused", **flags)
    return make_plan(config, device=device, measured=measured, shape=shape, weights=weights)


def block_bytes(shape: ModelShape = LLAMA_8B, block_size: int = 16, dtype_bytes: int = 2) -> int:
    return 2 * block_size * shape.num_kv_heads * shape.head_dim * dtype_bytes * shape.num_layers


def test_no_cap_limit_is_free_memory_less_margin_and_pool_is_the_workload() -> None:
    p = plan(max_model_len=4096, max_num_seqs=8)
    margin = max(512 * 2**20, int(80 * GiB * 0.02))
    assert (p.limit_bytes, p.limit_source, p.margin_bytes) == (79 * GiB - margin, "free-memory", margin)
    assert p.kv.pool_mode == "workload"
    assert p.kv.num_blocks == 8 * 4096 // 16
    assert p.classes["kv_cache"] == p.kv.num_blocks * block_bytes()
    assert p.required_bytes == sum(p.classes.values())
    assert set(p.classes) == set(CLASSES)
    assert p.fits and p.short_by_bytes == 0


def test_unified_pool_keeps_a_wider_margin() -> None:
    unified = DeviceMemory("what-if", "GB10", 128 * GiB, 120 * GiB, True)
    p = plan(device=unified, max_model_len=4096)
    assert p.margin_bytes == int(128 * GiB * 0.10)
    assert p.limit_bytes == 120 * GiB - p.margin_bytes
    assert p.unified_memory
    discrete = plan(device=dataclasses.replace(unified, unified=False), max_model_len=4096)
    assert discrete.limit_bytes > p.limit_bytes
    assert plan(device=DeviceMemory("what-if", "x", 16 * GiB, 16 * GiB, True),
                max_model_len=4096).margin_bytes == 4 * GiB


def test_memory_limit_caps_and_pool_takes_all_that_is_left() -> None:
    p = plan(memory_limit_bytes=40 * GiB, max_model_len=4096, max_num_seqs=8)
    assert (p.limit_bytes, p.limit_source, p.kv.pool_mode) == (40 * GiB, "--memory-limit", "cap")
    non_kv = p.required_bytes - p.classes["kv_cache"]
    assert p.kv.num_blocks == (40 * GiB - non_kv) // block_bytes()
    assert p.fits and p.required_bytes <= p.limit_bytes


def test_utilization_caps_a_fraction_of_total() -> None:
    p = plan(gpu_memory_utilization=0.5, max_model_len=4096)
    assert (p.limit_bytes, p.limit_source) == (40 * GiB, "--gpu-memory-utilization")


@pytest.mark.parametrize(("limit", "util", "expect_bytes", "expect_source"), [
    (30 * GiB, 0.5, 30 * GiB, "--memory-limit"),
    (50 * GiB, 0.5, 40 * GiB, "--gpu-memory-utilization"),
])
def test_two_caps_the_smallest_wins(limit, util, expect_bytes, expect_source) -> None:
    p = plan(memory_limit_bytes=limit, gpu_memory_utilization=util, max_model_len=4096)
    assert (p.limit_bytes, p.limit_source) == (expect_bytes, expect_source)


def test_override_without_cap_needs_one_sequence_under_free_memory() -> None:
    p = plan(num_gpu_blocks_override=300, max_model_len=4096, max_num_seqs=64)
    assert p.kv.pool_mode == "override" and p.kv.num_blocks == 300
    assert p.kv.required_blocks == 256  # one 4096-token sequence, not 64 of them
    assert p.classes["kv_cache"] == 300 * block_bytes()
    assert p.limit_source == "free-memory" and p.fits


def test_override_with_cap_must_fit_under_the_cap() -> None:
    ok = plan(num_gpu_blocks_override=1000, memory_limit_bytes=24 * GiB, max_model_len=4096)
    assert ok.kv.num_blocks == 1000 and ok.fits
    too_big = plan(num_gpu_blocks_override=100_000, memory_limit_bytes=24 * GiB, max_model_len=4096)
    assert not too_big.fits and too_big.short_by_bytes == too_big.required_bytes - 24 * GiB


def test_override_smaller_than_one_sequence_does_not_fit() -> None:
    p = plan(num_gpu_blocks_override=10, max_model_len=4096)
    assert not p.fits and p.short_by_bytes == 0
    assert [(r.flag, r.value) for r in p.remedies] == [("--max-model-len", 160),
                                                       ("--num-gpu-blocks-override", 256)]


def test_kv_cache_memory_bytes_sizes_the_pool() -> None:
    p = plan(kv_cache_memory_bytes=4 * GiB, memory_limit_bytes=40 * GiB, max_model_len=4096)
    assert p.kv.pool_mode == "kv-cache-memory-bytes"
    assert p.kv.num_blocks == 4 * GiB // block_bytes()
    assert p.limit_bytes == 40 * GiB and p.fits
    override = plan(kv_cache_memory_bytes=4 * GiB, num_gpu_blocks_override=7, max_model_len=64)
    assert override.kv.num_blocks == 7  # the override wins over the byte count


@pytest.mark.parametrize("util", [0.3, 0.5, 0.9, 1.0])
def test_pool_matches_vllm_formula(util: float) -> None:
    """vLLM: available = total * util - weights - activation peak - non-torch; blocks =
    available // bytes_per_block."""
    measured = Measured(weights_bytes=15 * GiB + 123, activation_peak_bytes=2 * GiB + 7,
                        context_bytes=GiB // 2, cuda_graph_bytes=GiB // 3)
    for m in (measured, None):
        p = plan(gpu_memory_utilization=util, measured=m, max_model_len=1024, max_num_seqs=4)
        c = p.classes
        available = int(80 * GiB * util) - c["weights"] - c["activations"] - (
            c["context"] + c["cuda_graphs"])
        assert p.kv.num_blocks == max(available // block_bytes(), p.kv.required_blocks)
        if m is not None:
            assert (c["weights"], c["activations"]) == (15 * GiB + 123, 2 * GiB + 7)
            assert p.kv.num_blocks == (int(80 * GiB * util) - 15 * GiB - 123 - 2 * GiB - 7
                                       - GiB // 2 - GiB // 3) // block_bytes()


def test_kv_block_bytes_follow_dtype_and_round_to_whole_blocks() -> None:
    p = plan(max_model_len=17, max_num_seqs=3)
    assert p.kv.blocks_per_seq == 2 and p.kv.num_blocks == 6
    assert p.kv.bytes_per_block == block_bytes() and p.kv.bytes_per_token == block_bytes() // 16
    assert plan(max_model_len=17, kv_cache_dtype="fp8").kv.bytes_per_block == block_bytes(dtype_bytes=1)
    assert plan(max_model_len=17, dtype="float32").kv.bytes_per_block == block_bytes(dtype_bytes=4)
    assert plan(max_model_len=17, dtype="float32", kv_cache_dtype="bfloat16").kv.dtype == "bfloat16"
    assert plan(max_model_len=17, block_size=32).kv.bytes_per_block == block_bytes(block_size=32)


def test_cuda_graphs_are_planned_for_the_sizes_the_flags_capture() -> None:
    """vLLM's --cudagraph-capture-sizes and --max-cudagraph-capture-size choose the sizes;
    a size above --max-num-seqs is never reached, so never captured nor planned."""
    assert estimates.capture_sizes(64) == [1, 2, 4, *range(8, 65, 8)]
    assert plan(max_num_seqs=64).classes["cuda_graphs"] == estimates.cuda_graph_bytes(LLAMA_8B, 11)
    given = plan(max_num_seqs=64, cudagraph_capture_sizes=(32, 1, 8, 128))
    assert given.classes["cuda_graphs"] == estimates.cuda_graph_bytes(LLAMA_8B, 3)
    capped = plan(max_num_seqs=64, max_cudagraph_capture_size=16)
    assert capped.classes["cuda_graphs"] == estimates.cuda_graph_bytes(LLAMA_8B, 5)
    assert plan(max_num_seqs=64, cudagraph_capture_sizes=(128,)).classes["cuda_graphs"] == 0


def test_explicit_dtype_casts_floating_weights_only() -> None:
    mixed = WeightsInfo(total_bytes=1000 + 64, num_tensors=2, dtype="BF16", files=(),
                        bytes_by_dtype={"BF16": 1000, "I32": 64})
    assert plan(weights=mixed, max_model_len=64).classes["weights"] == 1064
    assert plan(weights=mixed, max_model_len=64, dtype="float32").classes["weights"] == 2064


def test_defaults_and_estimates() -> None:
    p = plan()
    assert p.max_model_len == 8192 and p.max_num_batched_tokens == 8192
    assert plan(max_model_len=1024).max_num_batched_tokens == 2048
    # A GPU's attention reads the decodes and the later chunks in place: nothing gathered ...
    assert p.classes["activations"] == estimates.activation_peak_bytes(
        LLAMA_8B, 2, 8192, 16, context_tokens=8192, kv_dtype_bytes=2,
        gathered_sequences=0) + 32 * MiB
    # ... but with --attention-backend TORCH_SDPA every sequence's K and V are gathered.
    assert plan(attention_backend="TORCH_SDPA").classes["activations"] == (
        estimates.activation_peak_bytes(LLAMA_8B, 2, 8192, 16, context_tokens=8192,
                                        kv_dtype_bytes=2) + 32 * MiB)
    assert p.classes["cuda_graphs"] == estimates.cuda_graph_bytes(LLAMA_8B, 5) > 0  # 1 2 4 8 16
    assert p.classes["context"] == estimates.CUDA_CONTEXT_BYTES
    assert plan(enforce_eager=True).classes["cuda_graphs"] == 0
    cpu = plan(device=DeviceMemory("cpu", "host", 64 * GiB, 60 * GiB, False))
    assert cpu.classes["cuda_graphs"] == 0
    # The host's memory holds the compiled grammars too: counted where it is the device's.
    assert cpu.classes["context"] == estimates.CPU_CONTEXT_BYTES + DEFAULT_GRAMMAR_CACHE_BYTES
    small = plan(device=DeviceMemory("cpu", "host", 64 * GiB, 60 * GiB, False),
                 grammar_cache_bytes=2**20)
    assert small.classes["context"] == estimates.CPU_CONTEXT_BYTES + 2**20
    unified = plan(device=DeviceMemory("cuda", "nvml", 128 * GiB, 120 * GiB, True))
    assert unified.classes["context"] == estimates.CUDA_CONTEXT_BYTES + DEFAULT_GRAMMAR_CACHE_BYTES


def test_measured_figures_replace_estimates() -> None:
    m = Measured(weights_bytes=1, activation_peak_bytes=2, context_bytes=3, cuda_graph_bytes=4)
    p = plan(measured=m, max_model_len=64)
    assert [p.classes[k] for k in ("weights", "activations", "context", "cuda_graphs")] == [1, 2, 3, 4]
    assert set(p.measured) == {"weights", "activations", "context", "cuda_graphs"}


def test_max_model_len_above_the_model_is_bad_input() -> None:
    with pytest.raises(BadInput, match="max_position_embeddings"):
        plan(max_model_len=8193)


def test_unified_pool_warns_about_utilization() -> None:
    unified = DeviceMemory("what-if", "GB10", 128 * GiB, 120 * GiB, True)
    p = plan(device=unified, gpu_memory_utilization=0.9, max_model_len=4096)
    assert any("unified memory pool" in w and "WHOLE pool" in w for w in p.warnings)
    assert not any("unified" in w for w in plan(gpu_memory_utilization=0.9).warnings)
    assert not any("unified" in w for w in plan(device=unified, memory_limit_bytes=GiB * 40).warnings)


# --- a cap above free memory ------------------------------------------------------------------

GPU_20_FREE = DeviceMemory("what-if", "H100", 80 * GiB, 20 * GiB, False)


def test_a_utilization_above_free_memory_does_not_fit() -> None:
    """vLLM refuses to start when total x utilization is more than the free memory; so
    does the plan (it used to say "fits" with a warning)."""
    p = plan(device=GPU_20_FREE, gpu_memory_utilization=0.9, max_model_len=1024, max_num_seqs=4)
    assert p.limit_bytes == int(80 * GiB * 0.9) and p.cap_above_free
    assert not p.fits and p.required_bytes <= p.limit_bytes and p.warnings == []
    (remedy,) = p.remedies
    assert (remedy.flag, remedy.value, remedy.also) == ("--gpu-memory-utilization", 0.25, ())
    lowered = plan(device=GPU_20_FREE, gpu_memory_utilization=0.25, max_model_len=1024,
                   max_num_seqs=4)
    assert lowered.fits and lowered.limit_bytes == 20 * GiB
    assert remedy.kv_bytes == lowered.classes["kv_cache"]
    assert not plan(device=GPU_20_FREE, gpu_memory_utilization=0.26, max_model_len=1024).fits


def test_a_memory_limit_above_free_memory_does_not_fit() -> None:
    p = plan(device=GPU_20_FREE, memory_limit_bytes=30 * GiB, max_model_len=1024)
    assert p.cap_above_free and not p.fits
    assert [(r.flag, r.value) for r in p.remedies] == [("--memory-limit", 20 * GiB)]
    assert plan(device=GPU_20_FREE, memory_limit_bytes=20 * GiB, max_model_len=1024).fits
    # The smallest cap decides: a utilization above free memory under a smaller limit fits.
    assert plan(device=GPU_20_FREE, memory_limit_bytes=19 * GiB, gpu_memory_utilization=0.9,
                max_model_len=1024).fits


def test_under_a_lowered_cap_the_other_remedies_come_with_it() -> None:
    flags = dict(gpu_memory_utilization=0.95, max_model_len=8192, max_num_seqs=64)
    p = plan(device=GPU_20_FREE, **flags)
    assert p.cap_above_free and p.remedies
    assert all(r.also == (("--gpu-memory-utilization", 0.25),) for r in p.remedies)
    best = next(r.value for r in p.remedies if r.flag == "--max-model-len")
    lowered = {**flags, "gpu_memory_utilization": 0.25}
    assert plan(device=GPU_20_FREE, **{**lowered, "max_model_len": best}).fits
    assert not plan(device=GPU_20_FREE, **{**lowered, "max_model_len": best + 1}).fits


@pytest.mark.parametrize(("total", "free", "largest"), [
    (80 * GiB, 20 * GiB, 0.25),
    (80 * GiB, 20 * GiB - 1, 0.24),  # rounded down, never above free
    (10**12 + 7, 29 * 10**10, 0.28),
    # free / total is exactly 0.54, but total x 0.54 in floating point is a byte above free
    (14_073_748_835_532_900, 7_599_824_371_187_766, 0.53),
    (80 * GiB, 80 * GiB, 1.0),
    (80 * GiB, 500 * 2**20, 0.0),  # under 1%: none
])
def test_largest_utilization_within_free_memory(total, free, largest) -> None:
    device = DeviceMemory("what-if", "x", total, free, False)
    assert largest_utilization(device) == largest
    assert int(total * largest) <= free
    if largest < 1.0:
        assert int(total * round(largest + 0.01, 2)) > free


# --- remedies -------------------------------------------------------------------------------

def refused(**flags):
    p = plan(**flags)
    assert not p.fits
    return p, {r.flag: r for r in p.remedies}


def test_remedy_max_model_len_is_the_largest_that_fits() -> None:
    flags = dict(memory_limit_bytes=24 * GiB, max_model_len=8192, max_num_seqs=16)
    _, remedies = refused(**flags)
    best = remedies["--max-model-len"].value
    assert plan(**{**flags, "max_model_len": best}).fits
    assert not plan(**{**flags, "max_model_len": best + 1}).fits
    assert remedies["--max-model-len"].kv_bytes == plan(
        **{**flags, "max_model_len": best}).classes["kv_cache"]


def test_remedy_max_num_seqs_is_the_largest_that_fits() -> None:
    flags = dict(memory_limit_bytes=24 * GiB, max_model_len=8192, max_num_seqs=16)
    _, remedies = refused(**flags)
    best = remedies["--max-num-seqs"].value
    assert 1 <= best < 16
    assert plan(**{**flags, "max_num_seqs": best}).fits
    assert not plan(**{**flags, "max_num_seqs": best + 1}).fits


def test_fp8_offered_only_when_it_closes_the_gap() -> None:
    _, remedies = refused(memory_limit_bytes=24 * GiB, max_model_len=8192, max_num_seqs=16)
    assert "--kv-cache-dtype" not in remedies  # 16 x 8192 in fp8 is still 8 GiB: not enough
    flags = dict(memory_limit_bytes=30 * GiB, max_model_len=8192, max_num_seqs=16)
    fp8 = refused(**flags)[1]["--kv-cache-dtype"]
    with_fp8 = plan(**flags, kv_cache_dtype="fp8")
    assert fp8.value == "fp8" and with_fp8.fits and fp8.kv_bytes == with_fp8.classes["kv_cache"]
    assert with_fp8.kv.bytes_per_block == block_bytes(dtype_bytes=1)
    _, remedies = refused(memory_limit_bytes=22 * GiB, max_model_len=8192, max_num_seqs=16,
                          kv_cache_dtype="fp8")
    assert "--kv-cache-dtype" not in remedies  # already one byte


def test_no_remedy_changes_the_weights() -> None:
    """Only smaller weights could fit these (the engine serves unquantized checkpoints
    only, so "a smaller quantization" is not offered): only the same weights over more
    GPUs are, re-planned (each GPU under the same --memory-limit)."""
    flags = dict(memory_limit_bytes=16 * GiB, max_model_len=1024, max_num_seqs=1,
                 enforce_eager=True)
    p, remedies = refused(**flags)
    assert set(remedies) == {"--tensor-parallel-size"}
    assert plan(**flags, tensor_parallel_size=remedies["--tensor-parallel-size"].value).fits
    assert p.classes["weights"] * 2 >= p.required_bytes
    _, remedies = refused(memory_limit_bytes=12 * GiB, max_model_len=8192, max_num_seqs=8)
    assert set(remedies) == {"--tensor-parallel-size"}


def test_smaller_step_offered_when_activations_dominate_and_is_the_largest_that_fits() -> None:
    # A step of 1M tokens: activations of ~hundreds of GiB, nothing else can close the gap
    # (the report used to say "no single change of flags fits").
    flags = dict(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=1_000_000)
    p, remedies = refused(**flags)
    assert p.classes["activations"] * 2 >= p.required_bytes
    step = remedies["--max-num-batched-tokens"]
    assert 8 <= step.value < 1_000_000 and step.note.startswith("activations -> ")
    assert plan(**{**flags, "max_num_batched_tokens": step.value}).fits
    assert not plan(**{**flags, "max_num_batched_tokens": step.value + 1}).fits
    # Not offered when the activations are a small part and another change helps.
    _, remedies = refused(memory_limit_bytes=24 * GiB, max_model_len=8192, max_num_seqs=16)
    assert "--max-num-batched-tokens" not in remedies


def test_enforce_eager_offered_when_graphs_tip_the_balance() -> None:
    flags = dict(max_model_len=256, max_num_seqs=256)
    eager = plan(**flags, enforce_eager=True)
    margin = estimates.safety_margin_bytes(80 * GiB, False)
    tight = DeviceMemory("what-if", "x", 80 * GiB, eager.required_bytes + margin, False)
    p = plan(device=tight, **flags)
    assert not p.fits and p.short_by_bytes == p.classes["cuda_graphs"]
    remedy = next(r for r in p.remedies if r.flag == "--enforce-eager")
    assert remedy.value is None and remedy.kv_bytes == eager.classes["kv_cache"]


def test_remedies_are_only_computed_for_refusals() -> None:
    assert plan(max_model_len=4096).remedies == []
    assert plan(max_model_len=4096).to_json()["remedies"] == []


def test_plan_json_keys() -> None:
    doc = plan(memory_limit_bytes=24 * GiB, max_model_len=8192).to_json()
    for key in ("fits", "limit_bytes", "required_bytes", "short_by_bytes", "limit_source",
                "classes", "kv", "remedies", "unified_memory"):
        assert key in doc
    assert set(doc["classes"]) == set(CLASSES)
    assert set(doc["kv"]) >= {"block_size", "num_blocks", "bytes_per_block", "bytes_per_token",
                              "dtype"}
    assert all(set(r) >= {"flag", "value", "kv_bytes"} for r in doc["remedies"])
    assert all(isinstance(v, int) for v in doc["classes"].values())
    assert math.isclose(doc["required_bytes"], sum(doc["classes"].values()))


@pytest.mark.parametrize(("flag", "torch_dtype"), [("auto", "bfloat16"), ("float32", "float32"),
                                                   ("half", "float16")])
def test_weights_class_equals_tensors_loaded_in_the_model_dtype(tmp_path, flag, torch_dtype) -> None:
    # A what-if architecture: kvledger's engine refuses a non-float tensor (model.loadable).
    write_checkpoint(tmp_path, shards=2, architectures=["Gemma2ForCausalLM"])
    loaded = {}
    for shard in tmp_path.glob("*.safetensors"):
        loaded |= load_file(str(shard))
    loaded["scale.int8"] = torch.ones(10, dtype=torch.int8)  # not cast: quantized payloads
    save_file({"scale.int8": loaded["scale.int8"]}, str(tmp_path / "extra.safetensors"))
    (tmp_path / "model.safetensors.index.json").unlink()  # plain glob of every file
    target = getattr(torch, torch_dtype)
    expected = sum((t.to(target) if t.is_floating_point() else t).nbytes for t in loaded.values())
    p = make_plan(EngineConfig(model=str(tmp_path), dtype=flag), device=GPU_80)
    assert p.classes["weights"] == expected
    assert p.model_dtype == torch_dtype


F32_WEIGHTS = dataclasses.replace(WEIGHTS_8B, dtype="F32", total_bytes=WEIGHTS_8B.total_bytes * 2,
                                  bytes_by_dtype={"F32": WEIGHTS_8B.total_bytes * 2})
F32_8B = dataclasses.replace(LLAMA_8B, torch_dtype="float32")


@pytest.mark.parametrize(("device", "flag", "expected"), [
    (GPU_80, "auto", "bfloat16"),  # vLLM's --dtype auto: half precision on a GPU
    (dataclasses.replace(GPU_80, kind="cuda", bfloat16=False), "auto", "float16"),  # a V100
    (DeviceMemory("cpu", "host", 64 * GiB, 60 * GiB, False), "auto", "float32"),
    (GPU_80, "float32", "float32"),  # asked for
])
def test_a_float32_checkpoint_runs_in_half_precision_on_a_gpu(device, flag, expected) -> None:
    p = plan(device=device, shape=F32_8B, weights=F32_WEIGHTS, dtype=flag, max_model_len=1024)
    assert p.model_dtype == p.kv.dtype == expected
    assert p.classes["weights"] == WEIGHTS_8B.total_bytes * estimates.DTYPE_BYTES[expected] // 2
    # A 16-bit checkpoint is run as stored.
    assert plan(device=device, max_model_len=1024).model_dtype == "bfloat16"


def test_activation_formula_by_hand() -> None:
    tiny = ModelShape("LlamaForCausalLM", 2, 4, 2, 16, 64, 128, 256, 512, "bfloat16")
    qkv = (4 + 2 * 2) * 16
    per_token = max(4 * 64 + qkv + 3 * 128,  # 768 elements: the MLP's time
                    2 * 64 + 4 * qkv + 2 * 16)  # 672: attention's
    step = 100 * per_token * 2  # 100 tokens in bf16
    logits = 4 * 256 * 4 * 2  # 4 sequences' last tokens, float32 logits + probabilities
    gather = 4 * 32 * 2 * 16 * 2 * (2 + 1)  # 4 seqs x 32 tokens, K and V, bf16 + fp8 copy
    masks = 100 * 32 + 4 * 32 * 2  # a chunk's bool mask over 32 tokens, 4 additive in bf16
    assert estimates.activation_peak_bytes(tiny, 2, 100, 4, context_tokens=32,
                                           kv_dtype_bytes=1) == step + logits + gather + masks
    assert step + logits + gather + masks == 189824
    assert estimates.activation_peak_bytes(tiny, 2, 100, 4) == step + logits
    # Attention's peak wins where the heads are wide beside the MLP.
    wide = dataclasses.replace(tiny, num_attention_heads=16, num_kv_heads=8, head_dim=32)
    assert estimates.activation_peak_bytes(wide, 2, 100, 4) == \
        100 * (2 * 64 + 4 * (16 + 2 * 8) * 32 + 2 * 32) * 2 + logits


def test_a_gpu_plan_counts_cublas_workspace() -> None:
    """torch takes cuBLAS's workspace from its allocator at the first matmul and keeps it:
    32 MiB measured on an H200 beside the profiled step (bench/gpu_checks.sh)."""
    assert estimates.matmul_workspace_bytes("cuda", {}) == 32 * MiB
    assert estimates.matmul_workspace_bytes("what-if", {}) == 32 * MiB
    assert estimates.matmul_workspace_bytes("cpu", {}) == 0
    older = {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}  # torch's default before Hopper
    assert estimates.matmul_workspace_bytes("cuda", older) == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert estimates.matmul_workspace_bytes("cuda", {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    for unreadable in (":4096", "4096:8", ":a:8", ""):  # torch's own default then
        assert estimates.matmul_workspace_bytes(
            "cuda", {"CUBLAS_WORKSPACE_CONFIG": unreadable}) == 32 * MiB
    gpu = plan(max_model_len=1024, attention_backend="TORCH_SDPA")  # the CPU's attention
    cpu = plan(max_model_len=1024, device=DeviceMemory("cpu", "host", 64 * GiB, 64 * GiB, True))
    assert gpu.classes["activations"] - cpu.classes["activations"] == 32 * MiB
