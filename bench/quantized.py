"""Quantized weights against float32 on the CPU: decode tokens/s and resident weight bytes
of the same built-in model run as it is (fp32, oneDNN's packed layers), with
``--quantization fp8`` (linear layers float8_e4m3fn, one scale per output channel,
dequantized per layer for each step: engine/model/fp8_linear.py), and as 4-bit GPTQ, AWQ
and compressed-tensors W4A16 checkpoints of the same weights (group size 128, packed by
tests/_int4_checkpoints.py; dequantized per layer for each step:
engine/model/int4_linear.py), in the same run.

    .venv/bin/python bench/quantized.py [--model small-llama] [--rounds 3] [--formats ...]

Each (format, batch) runs ``--rounds`` times, formats interleaved so anything else on the
machine slows them alike; a run's figure is the median of its decode steps 10-60 (32-token
prompts, greedy, EOS ignored; ``--max-tokens 30``: steps 10-20), the reported figure the best round (on a shared machine a
busy neighbour can slow one round several times over). The claims, checked (exit 1, one
line each): each quantized engine holds exactly the weight bytes its plan counts, at most
``BYTES_LIMIT[format]`` of the float32 engine's; tokens/s is printed as a ratio of
float32's (the CPU has no FP8 or int4 matmul here, so the dequantization is the price of
the memory saving).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests")]  # the 4-bit checkpoint writer, tests/_int4_checkpoints.py

from engine_steps import interleaved  # noqa: E402 - bench/ is on sys.path: this folder

BATCHES = (1, 8)
# quantized weights / fp32 weights (small-llama: embeddings and LM head stay fp32)
BYTES_LIMIT = {"fp8": 0.4, "gptq": 0.3, "awq": 0.3, "w4a16": 0.3}
FORMATS = ("fp32", "fp8", "gptq", "awq", "w4a16")
GROUP_SIZE = 128


def make_engine(model_dir: str, quantization: str | None):
    from kvledger.engine.core.engine import LLMEngine
    from kvledger.engine.settings.config import EngineConfig

    return LLMEngine.from_config(EngineConfig(
        model=model_dir, device="cpu", dtype="float32", max_model_len=512, max_num_seqs=16,
        block_size=32, num_gpu_blocks_override=512, enable_prefix_caching=False,
        quantization=quantization))


def planned_weights(model_dir: str, quantization: str | None) -> int:
    from kvledger.engine.planner.plan import make_plan
    from kvledger.engine.settings.config import EngineConfig

    return make_plan(EngineConfig(model=model_dir, device="cpu", dtype="float32",
                                  max_model_len=512, quantization=quantization)).classes["weights"]


def checkpoints(model_dir: Path, formats: list[str]) -> dict[str, tuple[str, str | None]]:
    """``{format: (model dir, --quantization)}``, the 4-bit ones written beside the model."""
    from _int4_checkpoints import write_int4

    out: dict[str, tuple[str, str | None]] = {}
    for fmt in formats:
        if fmt in ("fp32", "fp8"):
            out[fmt] = (str(model_dir), "fp8" if fmt == "fp8" else None)
        else:
            method = "compressed-tensors" if fmt == "w4a16" else fmt
            q_dir, _ = write_int4(model_dir, model_dir.parent / fmt, method,
                                  sym=fmt == "w4a16", group_size=GROUP_SIZE,
                                  desc_act=fmt == "gptq")
            out[fmt] = (str(q_dir), None)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=70,
                        help="tokens each request decodes; the window is steps 10 to this - 9")
    parser.add_argument("--formats", nargs="+", choices=FORMATS[1:], default=list(FORMATS[1:]),
                        help="the quantized formats to run beside fp32 (default: all)")
    args = parser.parse_args()
    import torch

    from kvledger.engine.model.builtin import write_model
    from kvledger.engine.model.loader import weights_bytes

    model_dir = write_model(args.model, Path(tempfile.mkdtemp(prefix="kvledger-bench-")) / "fp32")
    setups = checkpoints(model_dir, ["fp32", *args.formats])
    engines = {fmt: make_engine(path, q) for fmt, (path, q) in setups.items()}
    runs = interleaved(engines, BATCHES, args.rounds, max_tokens=args.max_tokens,
                       steps=range(10, args.max_tokens - 9), progress=True)
    ms = {key: min(values) for key, values in runs.items()}  # the least disturbed round
    held = {fmt: weights_bytes(engine.runner.model) for fmt, engine in engines.items()}
    print(f"model {args.model}, {torch.get_num_threads()} torch threads, decode step p50, "
          f"best of {args.rounds} rounds")
    print(f"{'format':>6} {'weights MiB':>11} {'x fp32':>7}"
          + "".join(f" {f'tok/s b={b}':>10} {'x fp32':>7}" for b in BATCHES))
    problems = []
    for fmt in engines:
        line = f"{fmt:>6} {held[fmt] / 2**20:>11.1f} {held[fmt] / held['fp32']:>6.2f}x"
        for batch in BATCHES:
            tok_s = batch / ms[(fmt, batch)] * 1000
            base = batch / ms[("fp32", batch)] * 1000
            line += f" {tok_s:>10.1f} {tok_s / base:>6.2f}x"
        print(line)
        if fmt == "fp32":
            continue
        planned = planned_weights(*setups[fmt])
        if held[fmt] != planned:
            problems.append(f"{fmt}: the engine holds {held[fmt]} bytes of weights, its plan "
                            f"counts {planned}")
        if held[fmt] > BYTES_LIMIT[fmt] * held["fp32"]:
            problems.append(f"{fmt}: weights are {held[fmt] / held['fp32']:.2f}x fp32's "
                            f"(limit {BYTES_LIMIT[fmt]}x)")
    for line in problems:
        print(f"quantized: FAILED: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
