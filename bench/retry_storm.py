"""Retry storm: clients that honour ``retry-after-ms`` against clients that retry at once.

One real ``kvledger serve`` process (tiny model, CPU, a small KV pool) on 127.0.0.1; the
same work (``--clients`` clients x ``--per-client`` completions with large caps) is sent
twice, once by each kind of client. Printed: rejected (429) attempts and time to finish
all the work, and their ratios (immediate / honouring).

    .venv/bin/python bench/retry_storm.py        # ~1 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time

import aiohttp
from local_server import free_port, wait_ready

from kvledger.engine.model.builtin import write_model


async def run_load(base: str, model: str, honour: bool, args) -> tuple[int, int, float]:
    """(429 attempts, completed requests, seconds to finish all work)."""
    rng = random.Random(args.seed)
    work = [[{"model": model, "prompt": "word " * rng.randint(4, 24), "ignore_eos": True,
              "max_tokens": rng.randint(48, 160)} for _ in range(args.per_client)]
            for _ in range(args.clients)]
    rejected = completed = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client(bodies: list[dict]) -> None:
            nonlocal rejected, completed
            for body in bodies:
                for _ in range(args.max_attempts):
                    async with session.post(base + "/v1/completions", json=body) as response:
                        await response.read()
                        if response.status == 200:
                            completed += 1
                            break
                        if response.status != 429:
                            sys.exit(f"unexpected {response.status}")
                        rejected += 1
                        delay_s = int(response.headers["retry-after-ms"]) / 1000 if honour else 0
                    await asyncio.sleep(delay_s)

        started = time.perf_counter()
        await asyncio.gather(*(client(bodies) for bodies in work))
        return rejected, completed, time.perf_counter() - started


async def bench(args) -> None:
    model_dir = write_model("tiny-llama", tempfile.mkdtemp(prefix="kvledger-bench-"))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvledger.engine.cli", "serve", "--model", str(model_dir),
         "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", "256", "--num-gpu-blocks-override", str(args.pool_blocks),
         "--log-level", "warning"],
        # One intra-op thread: the load generator shares the CPUs, and an oversubscribed
        # OpenMP pool makes step times erratic (p90 10x the median on 2 cores).
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        model = await wait_ready(base, proc)
        print(f"tiny-llama on CPU, pool {args.pool_blocks} blocks x 16 tokens; "
              f"{args.clients} clients x {args.per_client} requests (max_tokens 48-160)")
        rows = {}
        for honour in (True, False):
            rows[honour] = await run_load(base, model, honour, args)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print("\n| clients | rejected attempts (429) | completed | time to finish all s |")
    print("|---|---:|---:|---:|")
    for honour, label in ((True, "honour retry-after-ms"), (False, "retry at once")):
        rejected, completed, seconds = rows[honour]
        print(f"| {label} | {rejected} | {completed} | {seconds:.1f} |")
    (r_h, _, t_h), (r_i, _, t_i) = rows[True], rows[False]
    print(f"\nretry at once / honour: {r_i / max(r_h, 1):.1f}x the rejected attempts, "
          f"{t_i / t_h:.2f}x the time to finish")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--per-client", type=int, default=3)
    parser.add_argument("--pool-blocks", type=int, default=48)
    parser.add_argument("--max-attempts", type=int, default=100000,
                        help="bound on attempts per request (a safety net, not a policy)")
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
