"""The memory promise on the CPU, where nothing is measured at start: the plan the
pre-flight makes (what a pod's memory limit is checked against) against the process's
own memory while the engine serves its heaviest workload.

    .venv/bin/python bench/cpu_memory_check.py [--model small-llama] [--dtype float32]
        [--max-model-len 1024] [--max-num-seqs 16] [--max-num-batched-tokens N] [--json OUT]

A process of its own imports torch and kvledger, starts the engine on the CPU
(``LLMEngine.from_config``: plan, load, allocate the pool), then runs every sequence to the
full context (prompts of uneven length, some chunked, so that steps mix a prompt's later
chunk with decodes, the heaviest steps the CPU's attention path has), while a thread reads
``/proc/self/status`` every 2 ms: ``RssAnon``, the process's own memory (what it copies,
packs, allocates and computes), and ``RssFile``, the checkpoint's pages it maps (the page
cache's: shared, and taken back by the kernel under pressure).

Claim (exit 1 with a line when it fails): the anonymous memory's peak over the whole run,
the Python and torch runtime included, is within the plan's ``required_bytes``; and what
the engine added to it from before loading to the peak is within the plan's weights,
activations and KV pool plus its runtime context (a CPU's context class is the runtime's
own estimate). Reported: each class planned, and the phases measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _child(args: argparse.Namespace) -> dict:
    """Runs in the measured process: the phases' anonymous and mapped memory."""
    import random
    import tempfile
    import time

    sys.path.insert(0, str(ROOT / "bench"))
    import torch  # noqa: F401 - the runtime counts from here
    from load_memory import PeakSampler, status_kib

    from kvledger.engine.core.engine import LLMEngine
    from kvledger.engine.model.builtin import write_model
    from kvledger.engine.sampling.params import SamplingParams
    from kvledger.engine.settings.config import EngineConfig

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_model(args.model, Path(tmp) / args.model))
        runtime_anon = status_kib()["RssAnon"] << 10
        sampler = PeakSampler().start()
        config = EngineConfig(model=model_dir, device="cpu", dtype=args.dtype,
                              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens)
        engine = LLMEngine.from_config(config)
        loaded = status_kib()
        start_peak_anon = sampler.peak["RssAnon"] << 10
        plan = engine.plan
        rng = random.Random(0)
        vocab = engine.runner.config.vocab_size
        seqs, context = plan.max_num_seqs, plan.max_model_len
        for i in range(seqs):
            n = rng.randrange(context // 4, context - 1)
            engine.add_request(f"r{i}", [rng.randrange(6, vocab) for _ in range(n)],
                               SamplingParams(temperature=0, max_tokens=context - n,
                                              ignore_eos=True))
        steps, short, began = 0, [], time.monotonic()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.finish_reason != "length":
                    short.append(f"{out.request_id}: {out.finish_reason}")
            steps += 1
        elapsed = time.monotonic() - began
        sampler.stop()
        peak = {"anon": sampler.peak["RssAnon"] << 10, "file": sampler.peak["RssFile"] << 10}
        return {"model": args.model, "dtype": plan.model_dtype, "max_model_len": context,
                "max_num_seqs": seqs, "max_num_batched_tokens": plan.max_num_batched_tokens,
                "num_blocks": plan.kv.num_blocks, "classes": plan.classes,
                "required_bytes": plan.required_bytes, "runtime_anon_bytes": runtime_anon,
                "loaded_anon_bytes": loaded["RssAnon"] << 10,
                "loaded_file_bytes": loaded["RssFile"] << 10,
                "start_peak_anon_bytes": start_peak_anon,
                "peak_anon_bytes": peak["anon"], "peak_file_bytes": peak["file"],
                "steps": steps, "workload_s": round(elapsed, 1), "short_requests": short}


def check(result: dict) -> list[str]:
    """What broke the claim, one line each (none: it holds)."""
    classes = result["classes"]
    problems = []
    if result["short_requests"]:
        problems.append(f"{len(result['short_requests'])} requests did not run to the context")
    if result["peak_anon_bytes"] > result["required_bytes"]:
        problems.append(f"the process's anonymous memory peaked at {result['peak_anon_bytes']:,} "
                        f"bytes, over the plan's {result['required_bytes']:,}")
    engine_share = sum(classes[c] for c in ("weights", "activations", "kv_cache", "context"))
    added = result["peak_anon_bytes"] - result["runtime_anon_bytes"]
    if added > engine_share:
        problems.append(f"the engine added {added:,} bytes of anonymous memory, over its "
                        f"classes' {engine_share:,}")
    return problems


def report(result: dict) -> list[str]:
    mib = 2**20
    classes = result["classes"]
    lines = [f"{result['model']} {result['dtype']} on the CPU: {result['max_num_seqs']} sequences "
             f"x {result['max_model_len']} tokens, steps of {result['max_num_batched_tokens']}, "
             f"{result['num_blocks']} blocks; {result['steps']} steps in "
             f"{result['workload_s']} s",
             "planned: " + ", ".join(f"{name} {value / mib:,.1f} MiB"
                                     for name, value in classes.items() if value)
             + f"; required {result['required_bytes'] / mib:,.1f} MiB",
             f"anonymous memory: the runtime {result['runtime_anon_bytes'] / mib:,.1f} MiB, "
             f"started {result['loaded_anon_bytes'] / mib:,.1f} (peak while starting "
             f"{result['start_peak_anon_bytes'] / mib:,.1f}), peak serving "
             f"{result['peak_anon_bytes'] / mib:,.1f} MiB = "
             f"{result['peak_anon_bytes'] / result['required_bytes']:.2f} of required; "
             f"the checkpoint's mapped pages at most {result['peak_file_bytes'] / mib:,.1f} MiB"]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="small-llama", help="built-in model name")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args)))
        return 0
    command = [sys.executable, __file__, "--child", "--model", args.model, "--dtype",
               args.dtype, "--max-model-len", str(args.max_model_len), "--max-num-seqs",
               str(args.max_num_seqs)]
    if args.max_num_batched_tokens is not None:
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        print(f"error: the measured process failed: {done.stderr.strip().splitlines()[-1:]}",
              file=sys.stderr)
        return 1
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for line in report(result):
        print(line)
    problems = check(result)
    result["within_plan"] = not problems
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if problems:
        for line in problems:
            print(f"claim failed: {line}")
        return 1
    print("within plan: yes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
