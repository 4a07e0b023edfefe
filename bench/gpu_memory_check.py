"""Planner-predicted vs measured device bytes per class, on a CUDA GPU.

    .venv/bin/python bench/gpu_memory_check.py [--model small-llama] [--dtype bfloat16]

Probes the device (NVML) before touching CUDA, plans, then loads a built-in model on
the GPU step by step and reads ``torch.cuda`` memory statistics after each: weights
(allocated after loading), activation peak (the engine's profile pass: a prefill step
and a mixed decode + chunk step at ``max_num_batched_tokens``), KV pool (allocated by
the pool), device context (the drop in free memory since the probe that torch's
allocator does not hold, as the engine measures it). Then runs a workload that fills
every sequence to the full context through the engine and checks the tensors' peak
stayed within the planned weights + activations + KV pool.

Two plans are held to account: the pre-load plan (``make_plan`` before anything is
loaded: what ``kvledger plan`` and the init container decide with) and the engine's
measured plan (the same, re-planned with the figures it measured at start-up). Each
measured class must be within the pre-load plan, and the workload's peak within both.
Weights, KV pool and peak are the bytes the tensors asked the caching allocator for
(``requested_bytes``), which is what a plan counts; what the allocator held on top at the
peak (its 512-byte rounding, a segment's unsplit remainder, cached blocks) must fit in the
safety margin the plan keeps free. Exit 0 when everything is within, 1 when anything
exceeds (or a request of the workload did not run to its length), 2 without a CUDA device
(a one-line message).
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

# The classes measured step by step against the pre-load plan (CUDA graphs: none, eager).
MEASURED_CLASSES = ("weights", "activations", "kv_cache", "context")
# What the allocator's peak holds: every class but the device context (not torch's).
PEAK_CLASSES = ("weights", "activations", "kv_cache")


@dataclass(frozen=True)
class Comparison:
    """One measured figure against what a plan set aside for it."""

    what: str  # a class name, or "peak"
    plan: str  # "pre-load" | "measured"
    planned_bytes: int
    measured_bytes: int

    @property
    def within(self) -> bool:
        return self.measured_bytes <= self.planned_bytes


def compare_classes(preload_classes: Mapping[str, int],
                    measured_bytes: Mapping[str, int]) -> list[Comparison]:
    """Each of ``MEASURED_CLASSES`` as measured against the pre-load plan's figure."""
    return [Comparison(name, "pre-load", preload_classes[name], measured_bytes[name])
            for name in MEASURED_CLASSES]


def compare_peak(preload_classes: Mapping[str, int], measured_plan_classes: Mapping[str, int],
                 peak_bytes: int) -> list[Comparison]:
    """The workload's allocator peak against ``PEAK_CLASSES`` of the pre-load plan and of
    the engine's measured plan."""
    return [Comparison("peak", plan, sum(classes[c] for c in PEAK_CLASSES), peak_bytes)
            for plan, classes in (("pre-load", preload_classes),
                                  ("measured", measured_plan_classes))]


def compare_allocator(margin_bytes: int, requested_peak: int, reserved_peak: int) -> Comparison:
    """What the caching allocator held beyond the tensors' bytes at the workload's peak,
    against the safety margin the plan keeps free of every class."""
    return Comparison("allocator", "margin", margin_bytes, reserved_peak - requested_peak)


def format_comparisons(comparisons: list[Comparison]) -> list[str]:
    """A table: a header line, then one line per comparison."""
    lines = [f"{'':<12}{'vs plan':<10}{'planned':>16}{'measured':>16}"
             f"{'measured/planned':>18}  within"]
    for c in comparisons:
        ratio = c.measured_bytes / c.planned_bytes if c.planned_bytes else float("nan")
        lines.append(f"{c.what:<12}{c.plan:<10}{c.planned_bytes:>16,}{c.measured_bytes:>16,}"
                     f"{ratio:>18.3f}  {'yes' if c.within else 'NO'}")
    return lines


def verdict(comparisons: list[Comparison]) -> str:
    """One line: ``within plan: yes``, or ``within plan: NO:`` and whatever exceeded."""
    def against(c: Comparison) -> str:
        return "the plan's safety margin" if c.plan == "margin" else f"the {c.plan} plan"

    over = [f"{c.what} over {against(c)} by {c.measured_bytes - c.planned_bytes:,} bytes"
            for c in comparisons if not c.within]
    return "within plan: yes" if not over else f"within plan: NO: {'; '.join(over)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="small-llama", help="built-in model name")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("error: gpu_memory_check needs a CUDA device, and torch sees none "
              f"(torch {torch.__version__}); run it on a GPU machine", file=sys.stderr)
        return 2

    from kvledger.engine.checkpoint.model_config import ModelConfig
    from kvledger.engine.core.engine import LLMEngine
    from kvledger.engine.core.runner import TORCH_DTYPES, ModelRunner
    from kvledger.engine.core.startup import context_bytes
    from kvledger.engine.model.builtin import write_model
    from kvledger.engine.model.loader import load_model
    from kvledger.engine.planner.device import probe_device
    from kvledger.engine.planner.plan import make_plan
    from kvledger.engine.sampling.params import SamplingParams
    from kvledger.engine.settings.config import EngineConfig

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_model(args.model, tmp))
        config = EngineConfig(model=model_dir, device="cuda", dtype=args.dtype,
                              kv_cache_dtype=args.kv_cache_dtype,
                              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              enforce_eager=True)
        probed = probe_device(config)  # before this process creates a CUDA context
        plan = make_plan(config, device=probed)  # the pre-load plan: no measured figures
        device = torch.device("cuda", torch.cuda.current_device())
        print(f"{torch.cuda.get_device_name(device)} (probed: {probed.kind}, {probed.name}, "
              f"free {probed.free_bytes:,} of {probed.total_bytes:,}, unified {probed.unified}); "
              f"torch {torch.__version__}")
        print(f"{args.model} {plan.model_dtype}, KV {plan.kv.dtype}, max_model_len "
              f"{plan.max_model_len}, max_num_seqs {plan.max_num_seqs}, max_num_batched_tokens "
              f"{plan.max_num_batched_tokens}, {plan.kv.num_blocks} blocks")

        allocated = torch.cuda.memory_allocated

        def requested(key: str = "current") -> int:
            """Bytes the live tensors asked for (``peak``: since the last reset)."""
            return torch.cuda.memory_stats(device)[f"requested_bytes.all.{key}"]

        base, base_reserved = requested(), torch.cuda.memory_reserved(device)
        model = load_model(model_dir, ModelConfig.from_dir(model_dir),
                           TORCH_DTYPES[plan.model_dtype], device)
        torch.cuda.synchronize(device)
        weights = requested() - base
        weights_held = allocated(device) - base
        runner = ModelRunner(model, device, plan.max_model_len, plan.kv.block_size)
        activations = runner.profile(plan.max_num_batched_tokens, plan.max_model_len,
                                     plan.max_num_seqs, plan.kv.dtype)
        before_pool = requested()
        runner.allocate_kv_cache(plan.kv.num_blocks, plan.kv.dtype)
        kv_pool = requested() - before_pool
        context = context_bytes(device, probed, config)
        free, total = torch.cuda.mem_get_info(device)
        measured = {"weights": weights, "activations": activations, "kv_cache": kv_pool,
                    "context": context}
        class_checks = compare_classes(plan.classes, measured)
        for line in format_comparisons(class_checks):
            print(line)
        print(f"(cudaMemGetInfo: total - free - reserved = "
              f"{total - free - torch.cuda.memory_reserved(device):,}; the weights as the "
              f"allocator holds them: {weights_held:,})")
        del runner, model
        torch.cuda.empty_cache()

        # Every sequence to the full context, prompts of uneven length (some chunked).
        print("engine start-up (its own predicted vs measured log):")
        logging.basicConfig(level=logging.INFO, format="  %(message)s")
        engine = LLMEngine.from_config(config)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        rng = random.Random(0)
        vocab = engine.runner.config.vocab_size
        for i in range(plan.max_num_seqs):
            n = rng.randrange(plan.max_model_len // 4, plan.max_model_len - 1)
            engine.add_request(f"r{i}", [rng.randrange(6, vocab) for _ in range(n)],
                               SamplingParams(temperature=0, max_tokens=plan.max_model_len - n,
                                              ignore_eos=True))
        steps = 0
        short = []  # requests that did not run to their length (an error, say out of memory)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.finish_reason != "length":
                    short.append(f"{out.request_id}: {out.finish_reason} "
                                 f"{getattr(out, 'error', None) or ''}".rstrip())
            steps += 1
        torch.cuda.synchronize(device)
        peak = requested("peak") - base
        reserved_peak = torch.cuda.max_memory_reserved(device) - base_reserved
        print(f"workload: {plan.max_num_seqs} sequences to {plan.max_model_len} tokens in {steps} "
              f"steps; tensors' peak {peak:,} (allocated peak "
              f"{torch.cuda.max_memory_allocated(device) - base:,}, reserved peak "
              f"{reserved_peak:,})")
        if short:
            print(f"{len(short)} requests did not run to their length: {'; '.join(short[:4])}")
        peak_checks = compare_peak(plan.classes, engine.plan.classes, peak)
        peak_checks.append(compare_allocator(plan.margin_bytes, peak, reserved_peak))
        for line in format_comparisons(peak_checks):
            print(line)
    comparisons = class_checks + peak_checks
    print(verdict(comparisons))
    return 0 if all(c.within for c in comparisons) and not short else 1


if __name__ == "__main__":
    sys.exit(main())
