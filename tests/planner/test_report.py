"""The text of ``kvledger plan``: layout like the issue's sample, numbers from the plan."""

from __future__ import annotations

import re

from published_models import published_shape

from kvledger.engine.checkpoint.contents import WeightsInfo
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.planner.report import format_size, render_report
from kvledger.engine.settings.config import EngineConfig

GiB = 2**30
SHAPE = published_shape("Qwen2.5-32B-Instruct")
WEIGHTS = WeightsInfo(int(61.2 * GiB), 771, "BF16", (), {"BF16": int(61.2 * GiB)})
H100 = DeviceMemory("what-if", "H100", 80 * GiB, 80 * GiB, False)


def report(device: DeviceMemory = H100, **flags) -> tuple[object, str]:
    p = make_plan(EngineConfig(model="/x", **flags), device=device, shape=SHAPE, weights=WEIGHTS)
    return p, render_report(p)


def test_format_size() -> None:
    assert format_size(int(83.94 * GiB)) == "83.9 GiB"
    assert format_size(0) == "0.0 GiB"
    assert format_size(3 * 2**20) == "3.0 MiB"
    assert format_size(4096) == "4.0 KiB"


def test_refusal_layout_matches_the_sample() -> None:
    p, text = report(memory_limit_bytes=76 * GiB, max_model_len=16384, max_num_seqs=4,
                     max_num_batched_tokens=16384)
    lines = text.splitlines()
    assert lines[0] == (f"error: engine requires {format_size(p.required_bytes)}, limit is 76.0 GiB "
                        f"(short by {format_size(p.short_by_bytes)})")
    assert lines[1] == "  weights          61.2 GiB   (bf16, 64 layers)"
    assert re.fullmatch(r"  activations {7}\d\.\d GiB   \(peak @ max_num_batched_tokens=16384\)",
                        lines[2])
    assert lines[3] == ("  KV cache         16.0 GiB   (max_model_len=16384 x max_num_seqs=4, "
                        "bf16)")
    assert lines[4].startswith("  cuda graphs ") and lines[5].startswith("  cuda context ")
    start = lines.index("  to fit within 76.0 GiB, try one of:")
    remedy_lines = lines[start + 1:start + 1 + len(p.remedies)]
    # No "a smaller quantization": kvledger's engine serves unquantized checkpoints only.
    assert [ln.split()[0] for ln in remedy_lines] == ["--max-model-len", "--max-num-seqs",
                                                      "--kv-cache-dtype",
                                                      "--tensor-parallel-size"]
    assert lines[start + 1 + len(p.remedies)].startswith("  limit: ")
    for remedy, line in zip(p.remedies, remedy_lines, strict=True):
        note = f"{remedy.note}, " if remedy.note else ""
        assert line == f"    {remedy.flag + ' ' + str(remedy.value):<26}({note}KV -> " \
                       f"{format_size(remedy.kv_bytes)})"


def test_fits_report() -> None:
    p, text = report(max_model_len=4096, max_num_seqs=2)
    assert p.fits
    assert text.startswith(f"fits: engine requires {format_size(p.required_bytes)}, limit is "
                           f"{format_size(p.limit_bytes)}")
    assert "try one of" not in text
    assert "limit: free memory less a 1.6 GiB safety margin (H100" in text


def test_nothing_fits_says_so() -> None:
    _, text = report(memory_limit_bytes=10 * GiB, max_model_len=4096, max_num_seqs=16)
    assert "no single change of flags fits within 10.0 GiB: the weights alone are 61.2 GiB" in text


def test_explicit_pool_too_small_headline() -> None:
    p, text = report(num_gpu_blocks_override=8, max_model_len=4096)
    assert not p.fits
    assert text.splitlines()[0] == ("error: the KV pool of 8 blocks (--num-gpu-blocks-override) "
                                    "cannot hold one max_model_len=4096 sequence (256 blocks of "
                                    "16 tokens)")
    assert "    --num-gpu-blocks-override 256 (KV -> " in text  # a space after a long flag
    kv_row = next(line for line in text.splitlines() if line.startswith("  KV cache"))
    assert kv_row.endswith("(256 blocks for one max_model_len sequence; "
                           "--num-gpu-blocks-override gives 8, bf16)")
    assert format_size(p.kv.num_blocks * p.kv.bytes_per_block) in kv_row


def test_unified_warning_and_cpu_labels() -> None:
    gb10 = DeviceMemory("what-if", "GB10", 128 * GiB, 120 * GiB, True)
    _, text = report(device=gb10, gpu_memory_utilization=0.9, max_model_len=4096)
    assert "\nwarning: --gpu-memory-utilization 0.9 on a unified memory pool" in text
    assert "unified pool" in text
    cpu = DeviceMemory("cpu", "host memory", 256 * GiB, 250 * GiB, False)
    _, text = report(device=cpu, max_model_len=4096)
    assert "  runtime context " in text and "(none on the CPU)" in text


def test_a_cap_above_free_memory_is_refused_with_the_largest_utilization() -> None:
    busy = DeviceMemory("what-if", "H100", 80 * GiB, 20 * GiB, False)
    p, text = report(device=busy, gpu_memory_utilization=0.9, max_model_len=4096, max_num_seqs=2)
    lines = text.splitlines()
    assert lines[0] == ("error: the limit (--gpu-memory-utilization 0.9 x 80.0 GiB = 72.0 GiB) is "
                        "more than the device's free memory (20.0 GiB): the engine cannot "
                        "allocate it, and vLLM refuses to start; the largest "
                        "--gpu-memory-utilization within it is 0.25 (20.0 GiB free of 80.0 GiB)")
    # Only smaller weights fit 20 GiB: the model over 4 GPUs, each under the lowered cap.
    assert ("    --tensor-parallel-size 4 --gpu-memory-utilization 0.25 (per GPU, x 4 GPUs: "
            "weights -> 15.3 GiB each, KV -> 2.9 GiB)") in lines
    assert not any(line.startswith("warning: ") for line in lines)
    roomy = DeviceMemory("what-if", "H200", 141 * GiB, 100 * GiB, False)
    p, text = report(device=roomy, memory_limit_bytes=120 * GiB, max_model_len=4096)
    lines = text.splitlines()
    assert lines[0].startswith("error: the limit (--memory-limit 120.0 GiB) is more than the "
                               "device's free memory (100.0 GiB)")
    assert lines[0].endswith("device's free memory (100.0 GiB): the engine cannot allocate it; "
                             "the largest --gpu-memory-utilization within it is 0.7 "
                             "(100.0 GiB free of 141.0 GiB)")
    start = lines.index("  to fit within 100.0 GiB, try one of:")
    assert lines[start + 1] == (f"    --memory-limit {100 * GiB} (KV -> "
                                f"{format_size(p.remedies[0].kv_bytes)})")


def test_a_remedy_under_a_lowered_cap_names_both_flags() -> None:
    busy = DeviceMemory("what-if", "H200", 141 * GiB, 100 * GiB, False)
    p, text = report(device=busy, gpu_memory_utilization=0.95, max_model_len=32768,
                     max_num_seqs=16)
    remedy = next(r for r in p.remedies if r.flag == "--max-model-len")
    assert remedy.also == (("--gpu-memory-utilization", 0.7),)
    assert (f"    --max-model-len {remedy.value} --gpu-memory-utilization 0.7 (KV -> "
            f"{format_size(remedy.kv_bytes)})") in text.splitlines()


def test_the_report_says_why_a_float32_checkpoint_runs_in_half_precision(tmp_path) -> None:
    from budget_checkpoints import write_checkpoint

    write_checkpoint(tmp_path, torch_dtype="float32")
    config = EngineConfig(model=str(tmp_path), max_model_len=256)
    gpu = render_report(make_plan(config, device=H100))
    assert "  weights " in gpu and "(bf16, 2 layers)" in gpu
    assert ("  dtype: the float32 checkpoint runs in bfloat16 on a GPU, as vLLM's --dtype auto "
            "runs it (bfloat16 where the GPU computes in it); --dtype float32 keeps float32"
            ) in gpu.splitlines()
    old = DeviceMemory("cuda", "Tesla V100", 32 * GiB, 32 * GiB, False, bfloat16=False)
    assert "runs in float16 on a GPU, as vLLM's --dtype auto runs it (this GPU does not compute " \
           "in bfloat16)" in render_report(make_plan(config, device=old))
    cpu = render_report(make_plan(config, device=DeviceMemory("cpu", "host", 8 * GiB, 8 * GiB,
                                                              False)))
    assert "(fp32, 2 layers)" in cpu and "dtype:" not in cpu
