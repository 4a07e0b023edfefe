"""What a client's heavy structured-output schemas cost everyone else: the latency of a
request whose grammar is cached (json_object) and of a plain one with a 12 KiB body,
idle and while 8 distinct heavy json_schemas compile, and the server's resident memory
against its grammar cache bound, on one real ``kvledger serve``.

A heavy schema is an ``anyOf`` of 300 objects with 30 pattern properties each (about
570 KiB): seconds to compile and tens of MiB compiled, where a typical schema takes
milliseconds and kilobytes.

    .venv/bin/python bench/hostile_grammar.py [--heavy 8] [--cache 128MiB]

The claims, each checked (exit 1, one line on stderr per failed one): during the wave the
p90 latency of both kinds of request stays within 100 ms of its idle median, every heavy
request ends in a 200 or a 400 (never a 500), and the server's resident memory grows by
at most the cache bound plus one grammar per compile thread in flight (plus 64 MiB for
the allocator's own slack).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from local_server import free_port, wait_ready

MiB = 2**20
SLACK_BYTES = 64 * MiB


def heavy_schema(seed: int, objects: int = 300) -> dict:
    return {"anyOf": [{"type": "object", "patternProperties": {
        f"^h{seed}_{i}_{j}[a-z]{{2,8}}$": {"type": "string",
                                           "pattern": f"^[a-f0-9]{{{j + 1},{j + 9}}}x{i}$"}
        for j in range(30)}} for i in range(objects)]}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def timed_post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, int, dict]:
    started = time.perf_counter()
    async with session.post(url, json=body) as response:
        answer = await response.json()
        return time.perf_counter() - started, response.status, answer


async def run(args: argparse.Namespace, base: str, proc: subprocess.Popen) -> list[str]:
    model = await wait_ready(base, proc)
    url = base + "/v1/completions"
    cached = {"model": model, "prompt": "{", "max_tokens": 8, "temperature": 0,
              "response_format": {"type": "json_object"}}
    plain = {"model": model, "prompt": "hello", "max_tokens": 8, "temperature": 0,
             "user": "u" * 12_000}
    problems: list[str] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(3):  # warm up; the json_object grammar is cached from now on
            for body in (cached, plain):
                await timed_post(session, url, body)
        idle = {"cached": [], "plain": []}
        for _ in range(args.samples):
            idle["cached"].append((await timed_post(session, url, cached))[0])
            idle["plain"].append((await timed_post(session, url, plain))[0])
        rss_before = rss_bytes(proc.pid)
        heavy_bodies = [{"model": model, "prompt": "x", "max_tokens": 4, "temperature": 0,
                         "response_format": {"type": "json_schema", "json_schema": {
                             "name": f"heavy{i}", "schema": heavy_schema(i)}}}
                        for i in range(args.heavy)]
        schema_kib = len(json.dumps(heavy_bodies[0]["response_format"])) / 1024
        started = time.perf_counter()
        heavy = [asyncio.create_task(timed_post(session, url, body)) for body in heavy_bodies]
        during = {"cached": [], "plain": []}
        peak_rss = rss_before
        while not all(task.done() for task in heavy):
            during["cached"].append((await timed_post(session, url, cached))[0])
            during["plain"].append((await timed_post(session, url, plain))[0])
            peak_rss = max(peak_rss, rss_bytes(proc.pid))
            await asyncio.sleep(0.05)
        wave_s = time.perf_counter() - started
        outcomes = [(await task)[1:] for task in heavy]
        rss_after = rss_bytes(proc.pid)
    print(f"{args.heavy} distinct heavy json_schemas of {schema_kib:.0f} KiB, compiled in "
          f"{wave_s:.1f} s; statuses {sorted(status for status, _ in outcomes)}; finish "
          f"reasons {sorted(a['choices'][0]['finish_reason'] for s, a in outcomes if s == 200)}")
    print(f"{'request':<12}{'idle p50 ms':>14}{'during p50 ms':>16}{'during p90 ms':>16}"
          f"{'during max ms':>16}{'samples':>9}")
    for name in ("cached", "plain"):
        base_ms = statistics.median(idle[name]) * 1000
        values = sorted(v * 1000 for v in during[name])
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))] if values else float("nan")
        print(f"{name:<12}{base_ms:>14.1f}{statistics.median(values):>16.1f}{p90:>16.1f}"
              f"{values[-1]:>16.1f}{len(values):>9}")
        if not values:
            problems.append(f"no {name} request ran during the wave")
        elif p90 > base_ms + 100:
            problems.append(f"{name}: p90 {p90:.0f} ms during the wave, over idle "
                            f"{base_ms:.0f} ms + 100 ms")
    bound = args.cache_bytes + args.workers * args.grammar_bytes + SLACK_BYTES
    print(f"server RSS: {rss_before / MiB:.0f} MiB before, peak {peak_rss / MiB:.0f} MiB "
          f"(+{(peak_rss - rss_before) / MiB:.0f}), after {rss_after / MiB:.0f} MiB; bound "
          f"+{bound / MiB:.0f} MiB (cache {args.cache_bytes / MiB:.0f} + {args.workers} in "
          f"flight x {args.grammar_bytes / MiB:.0f} + {SLACK_BYTES / MiB:.0f} slack)")
    if peak_rss - rss_before > bound:
        problems.append(f"RSS grew by {(peak_rss - rss_before) / MiB:.0f} MiB, over the "
                        f"bound of {bound / MiB:.0f} MiB")
    if any(status >= 500 for status, _ in outcomes):
        problems.append("a heavy schema ended in a 5xx")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--heavy", type=int, default=8)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--cache", default="128MiB", help="--grammar-cache-bytes")
    args = parser.parse_args()
    from kvledger.engine.model.builtin import write_model
    from kvledger.engine.model.tokenizer import Tokenizer
    from kvledger.engine.sampling.grammar import GrammarCompiler, GrammarSpec, compile_workers
    from kvledger.engine.settings.kinds import parse_size

    args.cache_bytes = parse_size(args.cache)
    args.workers = compile_workers()
    model_dir = write_model(args.model, tempfile.mkdtemp(prefix="kvledger-bench-"))
    # One heavy grammar, compiled here as the server's compiler compiles and measures it.
    tokenizer = Tokenizer(model_dir)
    compiler = GrammarCompiler(tokenizer, tokenizer.eos_token_ids, tokenizer.vocab_size,
                               cache_bytes=2**40)
    spec = GrammarSpec("json_schema", json.dumps(heavy_schema(10_000), sort_keys=True))
    started = time.perf_counter()
    args.grammar_bytes = compiler.compile(spec).nbytes
    print(f"one heavy grammar: {args.grammar_bytes / MiB:.1f} MiB compiled, "
          f"{time.perf_counter() - started:.1f} s; {args.workers} compile thread(s)")
    compiler.close()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvledger.engine.cli", "serve", "--model", str(model_dir),
         "--device", "cpu", "--port", str(port), "--host", "127.0.0.1", "--max-model-len",
         "512", "--max-num-seqs", "16", "--grammar-cache-bytes", args.cache,
         "--grammar-compile-timeout", "120", "--log-level", "warning"],
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        problems = asyncio.run(run(args, f"http://127.0.0.1:{port}", proc))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for line in problems:
        print(f"hostile_grammar: FAILED: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
