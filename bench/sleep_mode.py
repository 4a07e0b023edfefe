"""Sleep mode against a cold start: how long ``kvledger serve --enable-sleep-mode`` takes to
go to sleep and to wake at each level, next to starting the server from nothing.

    .venv/bin/python bench/sleep_mode.py [--model small-llama] [--rounds 3] [--json]

One server (``VLLM_SERVER_DEV_MODE=1``, the built-in model written by ``make-model``):
the cold start is the process's launch to ``/ready`` 200 (imports, plan, loading, profile,
warm-up). Then, ``--rounds`` times for each level: ``POST /sleep?level=N`` and ``POST
/wake_up``, each timed from the client, and one greedy completion whose text must equal
the one before any sleep. Medians are reported.

Claims (exit 1 with one line each when one fails): every wake gives the same tokens;
waking from level 1 takes under a tenth of the cold start (vLLM reports 18-200x); waking
from level 2 (the weights read again) under the cold start. On the CPU level 1 keeps the
weights where they are (host memory) and frees the KV pool; on a GPU it copies them to
host memory and back, which this run does not measure.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from local_server import free_port, wait_ready  # noqa: E402

PROMPT = list(range(100, 164))


async def measure(model_dir: str, rounds: int) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "kvledger.engine.cli", "serve", "--model", model_dir,
               "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "512", "--enable-sleep-mode", "--log-level", "warning"]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    started = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        model = await wait_ready(base, proc)
        cold = time.perf_counter() - started
        async with aiohttp.ClientSession() as session:
            async def timed(path: str) -> float:
                began = time.perf_counter()
                async with session.post(base + path) as response:
                    assert response.status == 200, await response.text()
                return time.perf_counter() - began

            async def text() -> str:
                body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                        "ignore_eos": True}
                async with session.post(base + "/v1/completions", json=body) as response:
                    return (await response.json())["choices"][0]["text"]

            reference = await text()
            out = {"cold_start_s": cold, "levels": {}, "same_tokens": True}
            for level in (1, 2):
                sleeps, wakes = [], []
                for _ in range(rounds):
                    sleeps.append(await timed(f"/sleep?level={level}"))
                    wakes.append(await timed("/wake_up"))
                    out["same_tokens"] &= await text() == reference
                out["levels"][level] = {"sleep_s": statistics.median(sleeps),
                                        "wake_s": statistics.median(wakes)}
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from kvledger.engine.model.builtin import write_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_model(args.model, Path(tmp) / args.model))
        report = asyncio.run(measure(model_dir, args.rounds))
    failures = []
    cold = report["cold_start_s"]
    if not report["same_tokens"]:
        failures.append("a wake changed the greedy tokens")
    if report["levels"][1]["wake_s"] >= cold / 10:
        failures.append(f"waking from level 1 took {report['levels'][1]['wake_s']:.3f}s, not "
                        f"under a tenth of the {cold:.2f}s cold start")
    if report["levels"][2]["wake_s"] >= cold:
        failures.append(f"waking from level 2 took {report['levels'][2]['wake_s']:.3f}s, not "
                        f"under the {cold:.2f}s cold start")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"cold start: {cold:.2f} s")
        for level, figures in report["levels"].items():
            print(f"level {level}: sleep {figures['sleep_s']:.3f} s, wake "
                  f"{figures['wake_s']:.3f} s ({cold / figures['wake_s']:.0f}x faster than "
                  "the cold start)")
        print(f"same tokens after every wake: {report['same_tokens']}")
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
