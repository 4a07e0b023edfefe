"""FP8 weights against float32 on the CPU: decode tokens/s and resident weight bytes of the
same built-in model run as it is (fp32, oneDNN's packed layers) and with
``--quantization fp8`` (linear layers float8_e4m3fn, one scale per output channel,
dequantized per layer for each step: engine/model/fp8_linear.py), in the same run.

    .venv/bin/python bench/fp8.py [--model small-llama] [--rounds 3]

Each (setup, batch) runs ``--rounds`` times, setups interleaved so anything else on the
machine slows both alike; a run's figure is the median of its decode steps 10-60 (32-token
prompts, greedy, EOS ignored), the reported figure the best round (on a shared machine a
busy neighbour can slow one round several times over). The claims,
checked (exit 1, one line each): the FP8 engine holds exactly the weight bytes its plan
counts, at most ``BYTES_LIMIT`` of the float32 engine's; its tokens/s is printed as a ratio
of float32's (the CPU has no FP8 matmul, so the dequantization is the price of the memory
saving there; on CUDA from compute capability 8.9 ``torch._scaled_mm`` runs instead).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from engine_steps import interleaved

BATCHES = (1, 8)
BYTES_LIMIT = 0.4  # fp8 weights / fp32 weights (small-llama: embeddings stay fp32)


def make_engine(model_dir: str, quantization: str | None):
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.core.engine import LLMEngine

    return LLMEngine.from_config(EngineConfig(
        model=model_dir, device="cpu", dtype="float32", max_model_len=512, max_num_seqs=16,
        block_size=32, num_gpu_blocks_override=512, enable_prefix_caching=False,
        quantization=quantization))


def planned_weights(model_dir: str, quantization: str | None) -> int:
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.planner.plan import make_plan

    return make_plan(EngineConfig(model=model_dir, device="cpu", dtype="float32",
                                  max_model_len=512, quantization=quantization)).classes["weights"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch

    from kvledger.engine.model.builtin import write_model
    from kvledger.engine.model.loader import weights_bytes

    model_dir = str(write_model(args.model, tempfile.mkdtemp(prefix="kvledger-bench-")))
    engines = {"fp32": make_engine(model_dir, None), "fp8": make_engine(model_dir, "fp8")}
    runs = interleaved(engines, BATCHES, args.rounds, max_tokens=70, steps=range(10, 61),
                       progress=True)
    ms = {key: min(values) for key, values in runs.items()}  # the least disturbed round
    held = {name: weights_bytes(engine.runner.model) for name, engine in engines.items()}
    print(f"model {args.model}, {torch.get_num_threads()} torch threads, decode step p50, "
          f"best of {args.rounds} rounds")
    print(f"weights: fp32 {held['fp32'] / 2**20:.1f} MiB, fp8 {held['fp8'] / 2**20:.1f} MiB "
          f"({held['fp8'] / held['fp32']:.2f}x)")
    print(f"{'batch':>5} {'fp32 tok/s':>11} {'fp8 tok/s':>10} {'fp8/fp32':>9}")
    for batch in BATCHES:
        fp32, fp8 = batch / ms[("fp32", batch)] * 1000, batch / ms[("fp8", batch)] * 1000
        print(f"{batch:>5} {fp32:>11.1f} {fp8:>10.1f} {fp8 / fp32:>8.2f}x")
    problems = []
    if held["fp8"] != planned_weights(model_dir, "fp8"):
        problems.append(f"the fp8 engine holds {held['fp8']} bytes of weights, its plan counts "
                        f"{planned_weights(model_dir, 'fp8')}")
    if held["fp8"] > BYTES_LIMIT * held["fp32"]:
        problems.append(f"fp8 weights are {held['fp8'] / held['fp32']:.2f}x fp32's "
                        f"(limit {BYTES_LIMIT}x)")
    for line in problems:
        print(f"fp8: FAILED: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
