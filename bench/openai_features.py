"""What logprobs and structured outputs cost: output tokens/s of one real ``kvledger
serve`` on the same chat workload, plain, with ``logprobs: true, top_logprobs: 5``, and
with a ``response_format`` json_schema mask, over HTTP (so the cost of formatting the
logprobs into JSON counts too).

Modes run in interleaved rounds (plain, logprobs, schema, plain, ...) so that anything
else on the machine slows them alike; the median round of each mode is reported, and
its ratio to plain. The issue's targets: logprobs cost at most 10% of tokens/s, the
json_schema mask at most 25%.

    .venv/bin/python bench/openai_features.py [--model small-llama] [--rounds 3]
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

import aiohttp
from local_server import free_port, wait_ready

SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["title", "year", "tags"]}
MODES = {
    "plain": {},
    "top_logprobs 5": {"logprobs": True, "top_logprobs": 5},
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "film", "schema": SCHEMA}}},
}


async def one_round(base: str, model: str, extra: dict, requests: int, concurrency: int,
                    max_tokens: int) -> tuple[int, float]:
    """(output tokens, seconds) for ``requests`` chats, ``concurrency`` at a time."""
    queue = list(range(requests))
    tokens = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal tokens
        while queue:
            i = queue.pop()
            body = {"model": model, "max_tokens": max_tokens, "temperature": 1.0, "seed": i,
                    "ignore_eos": True, **extra,
                    "messages": [{"role": "user", "content": f"Describe film number {i}."}]}
            async with session.post(base + "/v1/chat/completions", json=body) as response:
                answer = await response.json()
                if response.status != 200:
                    sys.exit(f"{response.status}: {answer}")
                choice = answer["choices"][0]
                if "response_format" in extra and choice["finish_reason"] == "stop":
                    json.loads(choice["message"]["content"])  # complete, so it is JSON
                tokens += answer["usage"]["completion_tokens"]

    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return tokens, time.perf_counter() - started


async def run(args: argparse.Namespace, base: str, proc: subprocess.Popen) -> dict:
    model = await wait_ready(base, proc)
    for extra in MODES.values():  # warm-up: first-call costs, the grammar's first compile
        await one_round(base, model, extra, args.concurrency, args.concurrency, 8)
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, extra in MODES.items():
            tokens, seconds = await one_round(base, model, extra, args.requests,
                                              args.concurrency, args.max_tokens)
            rates[mode].append(tokens / seconds)
    return {mode: statistics.median(values) for mode, values in rates.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="small-llama", help="built-in model name")
    parser.add_argument("--requests", type=int, default=32, help="per round and mode")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    kvledger = os.path.join(os.path.dirname(sys.executable), "kvledger")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, args.model)
        subprocess.run([kvledger, "make-model", args.model, model_dir], check=True,
                       stdout=subprocess.DEVNULL)
        port = free_port()
        proc = subprocess.Popen([kvledger, "serve", "--model", model_dir, "--device", "cpu",
                                 "--port", str(port), "--max-model-len", "512",
                                 "--max-num-seqs", str(args.concurrency)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            rates = asyncio.run(run(args, f"http://127.0.0.1:{port}", proc))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    if args.json:
        print(json.dumps(rates))
        return 0
    print(f"model {args.model}, {args.rounds} rounds x {args.requests} chats, concurrency "
          f"{args.concurrency}, up to {args.max_tokens} tokens each (median round)")
    for mode, rate in rates.items():
        print(f"{mode:<16}{rate:>9.1f} tok/s   {rate / rates['plain']:.2f}x plain")
    return 0


if __name__ == "__main__":
    sys.exit(main())
