"""What one decode step costs as the batch grows: the engine's step time with 1, 2, 3, 4,
8, 16 and 32 sequences decoding, with the CPU's linear layers on oneDNN's packed weights
(engine/model/cpu_linear.py; the engine's default where its start-up measurement finds
them faster, forced here), on ``nn.Linear`` (MKL), and packed with each
layer's q/k/v and gate/up apart instead of fused (engine/model/fusion.py), in the same run.

    .venv/bin/python bench/decode_step.py [--model small-llama] [--rounds 3]

Each (setup, batch) runs ``--rounds`` times, setups interleaved so that anything else on
the machine slows both alike; a run's figure is the median of its decode steps 20-120
(prefill done, 32-token prompts, greedy, EOS ignored), the reported figure the median of
the rounds. The claims, checked (exit 1, one line each): a step with 3 sequences costs at
most 1.3x a step with 1 (reading the weights dominates, so it should stay nearly flat;
MKL's small-batch products made it 1.5-1.7x), and the packed layers are faster than
``nn.Linear`` at every batch size. What fusing the projections saves is shown, not judged.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile

from engine_steps import interleaved

BATCHES = (1, 2, 3, 4, 8, 16, 32)
FLAT_LIMIT = 1.3  # step(3) / step(1)


def make_engine(model_dir: str, packed: bool, fused: bool = True):
    from kvledger.engine.core import runner
    from kvledger.engine.core.engine import LLMEngine
    from kvledger.engine.settings.config import EngineConfig

    if packed:  # every linear layer packed, whatever the start-up measurement would say
        runner.pack_linears = functools.partial(runner.pack_linears, measure=False)
    else:  # every linear layer on nn.Linear
        runner.pack_linears = lambda model, device: 0
    if not fused:  # q/k/v and gate/up as separate layers
        runner.fuse_projections = lambda model: 0
    try:
        return LLMEngine.from_config(EngineConfig(
            model=model_dir, device="cpu", max_model_len=512, max_num_seqs=32,
            block_size=32, num_gpu_blocks_override=1024, enable_prefix_caching=False))
    finally:
        from kvledger.engine.model.cpu_linear import pack_linears
        from kvledger.engine.model.fusion import fuse_projections

        runner.pack_linears, runner.fuse_projections = pack_linears, fuse_projections


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch

    from kvledger.engine.model.builtin import write_model

    model_dir = str(write_model(args.model, tempfile.mkdtemp(prefix="kvledger-bench-")))
    engines = {"packed (oneDNN)": make_engine(model_dir, True),
               "nn.Linear (MKL)": make_engine(model_dir, False),
               "packed, apart": make_engine(model_dir, True, fused=False)}
    runs = interleaved(engines, BATCHES, args.rounds, max_tokens=130, steps=range(20, 121))
    ms = {key: statistics.median(values) for key, values in runs.items()}
    print(f"model {args.model}, {torch.get_num_threads()} torch threads, fp32, decode step "
          f"p50 (ms) over {args.rounds} rounds")
    print(f"{'batch':>5} {'packed ms':>10} {'tok/s':>8} {'nn.Linear ms':>13} {'tok/s':>8} "
          f"{'ratio':>6} {'apart ms':>9} {'fused saves':>12}")
    names = list(engines)
    for batch in BATCHES:
        packed, dense, apart = (ms[(name, batch)] for name in names)
        print(f"{batch:>5} {packed:>10.2f} {batch / packed * 1000:>8.1f} {dense:>13.2f} "
              f"{batch / dense * 1000:>8.1f} {dense / packed:>5.2f}x {apart:>9.2f} "
              f"{100 * (apart - packed) / apart:>11.1f}%")
    problems = []
    flat = ms[(names[0], 3)] / ms[(names[0], 1)]
    print(f"step(3) / step(1): packed {flat:.2f}x, nn.Linear "
          f"{ms[(names[1], 3)] / ms[(names[1], 1)]:.2f}x (claim: packed <= {FLAT_LIMIT}x)")
    if flat > FLAT_LIMIT:
        problems.append(f"a step of 3 sequences costs {flat:.2f}x a step of 1 (limit {FLAT_LIMIT}x)")
    slower = [b for b in BATCHES if ms[(names[0], b)] >= ms[(names[1], b)]]
    if slower:
        problems.append(f"the packed layers were not faster at batch {slower}")
    for line in problems:
        print(f"decode_step: FAILED: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
