"""LoRA adapters batched with the base model, on the CPU: tokens/s of one batch mixing 4
adapters and the base model against the same batch all on the base model, and against
the same requests run one adapter at a time (what serving without batched LoRA does:
one batch per adapter), in the same run.

    .venv/bin/python bench/lora.py [--model small-llama] [--rounds 3]

The workload: 10 requests of 32-token prompts and 16 greedy tokens (EOS ignored), 2 for
each of 4 rank-16 adapters on every projection and 2 for the base model. The engine runs
with ``--enable-lora --max-loras 4 --max-lora-rank 16``; "one at a time" is the same
engine with ``--max-loras 1``, whose scheduler lets one adapter into the batch at once
(the base requests ride along). Each setup runs ``--rounds`` times, interleaved so
anything else on the machine slows them alike; the figure is the best round (wall time of
the whole workload, prefill included). The claim, checked (exit 1, one line): the mixed
batch is faster than one adapter at a time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

ADAPTERS = 4
PER_SETUP = 2  # requests per adapter, and for the base model
PROMPT_TOKENS, MAX_TOKENS, RANK = 32, 16, 16


def make_llm(model_dir: str, max_loras: int):
    from kvledger.engine import LLM

    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=256, max_num_seqs=32,
               enable_prefix_caching=False, enable_lora=True, max_loras=max_loras,
               max_lora_rank=RANK)


def tokens_per_s(llm, loras: list) -> float:
    from kvledger.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [[5 + (i * 7 + j) % 900 for j in range(PROMPT_TOKENS)] for i in range(len(loras))]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - started
    return sum(len(o.token_ids) for o in outputs) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from _lora_helpers import write_adapter

    from kvledger.engine import LoRARequest
    from kvledger.engine.model.builtin import write_model

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = write_model(args.model, Path(scratch) / args.model)
        loras = [LoRARequest(f"a{i}", i + 1, str(write_adapter(
            Path(scratch) / f"a{i}", model_dir, rank=RANK, seed=i))) for i in range(ADAPTERS)]
        mixed_requests = [lora for lora in [None, *loras] for _ in range(PER_SETUP)]
        workloads = {"base alone": (ADAPTERS, [None] * len(mixed_requests)),
                     "4 adapters + base, one batch": (ADAPTERS, mixed_requests),
                     "one adapter at a time": (1, mixed_requests)}
        engines = {slots: make_llm(str(model_dir), slots) for slots in (1, ADAPTERS)}
        for llm in engines.values():  # warm up: first steps allocate and pack
            tokens_per_s(llm, [None, *loras])
        best: dict[str, float] = {}
        for round_ in range(args.rounds):
            for name, (slots, requests) in workloads.items():
                rate = tokens_per_s(engines[slots], requests)
                best[name] = max(best.get(name, 0.0), rate)
                print(f"round {round_ + 1}, {name}: {rate:.0f} tok/s", file=sys.stderr,
                      flush=True)
    base, mixed, serial = (best[n] for n in workloads)
    print(f"{args.model}, {len(mixed_requests)} requests x {MAX_TOKENS} tokens, rank {RANK}, "
          f"CPU, best of {args.rounds}")
    print(f"  base alone:                   {base:7.0f} tok/s")
    print(f"  4 adapters + base, one batch: {mixed:7.0f} tok/s  ({mixed / base:.2f}x base)")
    print(f"  one adapter at a time:        {serial:7.0f} tok/s  ({serial / base:.2f}x base)")
    print(f"  mixed batch vs one at a time: {mixed / serial:.2f}x")
    if mixed <= serial:
        print("FAILED: the mixed batch is not faster than one adapter at a time")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
