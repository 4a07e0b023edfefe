"""Decode throughput at --tensor-parallel-size 2 against 1, on the CPU (issue 23).

Both engines run in this process one after the other on the built-in ``small-llama``
(fp32, 8 layers, hidden 512), the same prompts, greedy: 8 sequences of 64 new tokens.
Prints tokens/s of each, the ratio tp=2 / tp=1, the cores and the load average (the
ratio depends on both: tp=1 runs torch's threads in one process, tp=2 half of them in
each of two, and every layer adds two all-reduces over gloo). The figure is reported,
not tuned. Exits 1 unless the tokens of
both runs are equal (the claim is correctness; the ratio is a measurement).

    .venv/bin/python bench/tp_throughput.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvledger.engine.llm import LLM
from kvledger.engine.model.builtin import write_model
from kvledger.engine.sampling.params import SamplingParams

PROMPTS = [[1 + k, 17, 33 + k, 5, 9] for k in range(8)]
PARAMS = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


def run(model_dir: Path, tp: int = 1, *, during: Callable[[LLM], Any] | None = None,
        **flags: Any) -> tuple[float, list[list[int]]]:
    """tokens/s and the greedy tokens of one engine (``flags`` to ``LLM``); ``during(llm)``
    runs once the work is done, before the ranks stop."""
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=256,
              tensor_parallel_size=tp, **flags)
    try:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0))  # warm up
        started = time.perf_counter()
        outs = llm.generate(PROMPTS, PARAMS)
        elapsed = time.perf_counter() - started
        if during is not None:
            during(llm)
    finally:
        ranks = getattr(llm.engine.runner, "ranks", None)
        if ranks is not None:
            ranks.stop()
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / elapsed, tokens


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model("small-llama", Path(tmp) / "small-llama")
        one, tokens_one = run(model_dir, 1)
        two, tokens_two = run(model_dir, 2)
    load = os.getloadavg()[0]
    print(f"small-llama fp32, {len(PROMPTS)} sequences x {PARAMS.max_tokens} tokens, CPU: "
          f"{os.cpu_count()} cores, load average {load:.1f} (torch threads: tp=1 all of "
          "them in one process, tp=2 half each)")
    print(f"tp=1: {one:.1f} tokens/s")
    print(f"tp=2: {two:.1f} tokens/s ({two / one:.2f}x tp=1)")
    return same_tokens("tp=2", tokens_two, "tp=1", tokens_one)


def same_tokens(name: str, tokens: list[list[int]], base: str,
                base_tokens: list[list[int]]) -> int:
    """The exit status: 0 when both runs' greedy tokens are equal (said either way)."""
    if tokens != base_tokens:
        print(f"FAIL: {name}'s greedy tokens differ from {base}'s")
        return 1
    print(f"{name}'s greedy tokens equal {base}'s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
