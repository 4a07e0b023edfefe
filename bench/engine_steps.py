"""Timing the engine's decode step in-process, shared by bench/decode_step.py and
bench/quantized.py: each setup (a named ``LLMEngine``) decodes ``batch`` 32-token prompts,
greedy with EOS ignored, and a run's figure is the median of its steps in a window after
the prefill; setups are interleaved within each round so that anything else on the machine
slows them alike."""

from __future__ import annotations

import statistics
import sys
import time


def step_ms(engine, batch: int, tag: str, *, max_tokens: int, steps: range) -> float:
    """The median wall time, in ms, of the engine steps numbered in ``steps`` while
    ``batch`` requests of ``max_tokens`` decode."""
    from kvledger.engine.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [5 + (i * 7 + j) % 900 for j in range(32)], params)
    times, step = [], 0
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        step += 1
        if step in steps:
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def interleaved(engines: dict, batches: tuple[int, ...], rounds: int, *, max_tokens: int,
                steps: range, progress: bool = False) -> dict[tuple[str, int], list[float]]:
    """``{(setup, batch): [ms per round]}``, the setups taking turns at each batch."""
    runs: dict[tuple[str, int], list[float]] = {}
    for round_ in range(rounds):
        for batch in batches:
            for name, engine in engines.items():
                ms = step_ms(engine, batch, f"{round_}-{batch}", max_tokens=max_tokens,
                             steps=steps)
                runs.setdefault((name, batch), []).append(ms)
                if progress:
                    print(f"round {round_ + 1}, batch {batch}, {name}: {ms:.1f} ms a step",
                          file=sys.stderr, flush=True)
    return runs
