"""Planner-predicted vs measured device bytes per class, on a CUDA GPU.

    .venv/bin/python bench/gpu_memory_check.py [--model small-llama] [--dtype bfloat16]

Loads a built-in model on the GPU step by step and reads ``torch.cuda`` memory
statistics after each: weights (allocated after loading), activation peak (peak during
a profile step of ``max_num_batched_tokens``), KV pool (allocated by the pool), device
context (in use on the device but not held by torch's allocator). Then runs the
declared workload through the engine and checks the peak stayed within the plan.
Without a CUDA device it exits 2 with a one-line message.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-llama", help="built-in model name")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("error: gpu_memory_check needs a CUDA device, and torch sees none "
              f"(torch {torch.__version__}); run it on a GPU machine", file=sys.stderr)
        return 2

    from kvledger.engine.budget.plan import make_plan
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.llm_engine import LLMEngine
    from kvledger.engine.loader import load_model
    from kvledger.engine.make_model import write_model
    from kvledger.engine.model_config import ModelConfig
    from kvledger.engine.model_runner import TORCH_DTYPES, ModelRunner
    from kvledger.engine.sampling_params import SamplingParams

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.init()
    torch.zeros(1, device=device)  # create the context before measuring it
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_model(args.model, tmp))
        config = EngineConfig(model=model_dir, device="cuda", dtype=args.dtype,
                              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                              enforce_eager=True)
        plan = make_plan(config)
        print(f"{torch.cuda.get_device_name(device)}; {args.model} {plan.model_dtype}, "
              f"max_model_len {plan.max_model_len}, max_num_seqs {plan.max_num_seqs}, "
              f"max_num_batched_tokens {plan.max_num_batched_tokens}")

        allocated = torch.cuda.memory_allocated
        base = allocated(device)
        model = load_model(model_dir, ModelConfig.from_dir(model_dir),
                           TORCH_DTYPES[plan.model_dtype], device)
        torch.cuda.synchronize(device)
        weights = allocated(device) - base
        runner = ModelRunner(model, device, plan.max_model_len, plan.kv.block_size)
        activations = runner.profile(plan.max_num_batched_tokens, plan.max_model_len)
        before_pool = allocated(device)
        runner.allocate_kv_cache(plan.kv.num_blocks, plan.kv.dtype)
        kv_pool = allocated(device) - before_pool
        free, total = torch.cuda.mem_get_info(device)
        context = total - free - torch.cuda.memory_reserved(device)
        measured = {"weights": weights, "activations": activations, "kv_cache": kv_pool,
                    "context": context}
        print(f"{'class':<12}{'predicted':>16}{'measured':>16}{'measured/predicted':>20}")
        for name, value in measured.items():
            predicted = plan.classes[name]
            ratio = value / predicted if predicted else float("nan")
            print(f"{name:<12}{predicted:>16,}{value:>16,}{ratio:>20.3f}")
        del runner, model
        torch.cuda.empty_cache()

        # The declared workload end to end: every sequence at the full context.
        engine = LLMEngine.from_config(config)
        torch.cuda.reset_peak_memory_stats(device)
        rng = random.Random(0)
        vocab = engine.runner.config.vocab_size
        half = plan.max_model_len // 2
        for i in range(plan.max_num_seqs):
            engine.add_request(f"r{i}", [rng.randrange(6, vocab) for _ in range(half)],
                               SamplingParams(temperature=0, max_tokens=plan.max_model_len - half,
                                              ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        free, total = torch.cuda.mem_get_info(device)
        context = total - free - torch.cuda.memory_reserved(device)
        peak = torch.cuda.max_memory_allocated(device) - base + context
        print(f"workload at {plan.max_num_seqs} x {plan.max_model_len} tokens: peak "
              f"{peak:,} bytes (allocator peak + context) vs planned {engine.plan.required_bytes:,} "
              f"(measured re-plan); within plan: {peak <= engine.plan.required_bytes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
