"""Decode on the CPU beside a busy process: kvledger's tokens/s alone and with one process
spinning on a core, under each OpenMP setting a user can choose in the pod's env.

    .venv/bin/python bench/cpu_contention.py [--model small-llama] [--sequences 3]
        [--tokens 200] [--nice 0]

Each setting runs in a fresh process (libgomp reads its variables once, at start-up): an
offline engine (``--device cpu``, fp32) decodes ``--sequences`` 32-token prompts, greedy
with EOS ignored, ``--tokens`` each after a 32-token warm-up; the figure is the output
tokens over the wall time of the measured batch. "beside a busy process" starts a Python
loop (at ``--nice``) before that process and stops it after. Settings: torch's default
(one thread per usable core, libgomp spinning at its barriers), ``OMP_NUM_THREADS=1``,
``OMP_WAIT_POLICY=PASSIVE``, and ``GOMP_SPINCOUNT`` 10,000 and 1,000. Figures only (no
claims): docs/serving.md#on-a-cpu says what they mean for a pod's env.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

SETTINGS = {
    "default": {},
    "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
    "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"},
}
OMP_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
BUSY = "while True: pass"


def decode_tokens_per_s(model_dir: str, sequences: int, tokens: int) -> float:
    """This process's figure (run by the child processes)."""
    from kvledger.engine.llm import LLM
    from kvledger.engine.sampling.params import SamplingParams

    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=512,
              max_num_seqs=max(8, sequences), block_size=32, num_gpu_blocks_override=256,
              enable_prefix_caching=False)
    prompts = [[10 + i + j for j in range(32)] for i in range(sequences)]
    llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    started = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0,
                                                   ignore_eos=True))
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def measure(model_dir: str, setting: dict[str, str], busy: bool, args) -> float:
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARIABLES} | setting
    spinner = (subprocess.Popen(["nice", "-n", str(args.nice), sys.executable, "-c", BUSY])
               if busy else None)
    try:
        child = subprocess.run(
            [sys.executable, __file__, "--child", model_dir, "--sequences", str(args.sequences),
             "--tokens", str(args.tokens)], env=env, capture_output=True, text=True, check=True)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return float(child.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--sequences", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--nice", type=int, default=0, help="the busy process's niceness")
    parser.add_argument("--child", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(f"{decode_tokens_per_s(args.child, args.sequences, args.tokens):.3f}")
        return 0
    from kvledger.engine.model.builtin import write_model

    model_dir = str(write_model(args.model, tempfile.mkdtemp(prefix="kvledger-bench-")))
    print(f"{args.model} fp32, {args.sequences} sequences decoding, {os.cpu_count()} CPUs; "
          f"tokens/s alone and beside a busy process at nice {args.nice}")
    print(f"{'setting':<26} {'alone':>8} {'beside':>8} {'beside/alone':>13}")
    for name, setting in SETTINGS.items():
        alone = measure(model_dir, setting, False, args)
        beside = measure(model_dir, setting, True, args)
        print(f"{name:<26} {alone:>8.1f} {beside:>8.1f} {beside / alone:>12.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
