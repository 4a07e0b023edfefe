"""HTTP overhead of the 429 path: requests/s that kvledger's server can refuse (parse the
body, check the model, tokenize the prompt, compute the cap, try the ledger, estimate
Retry-After, count metrics) against a bare aiohttp handler that returns a canned 429, in
the same run, same process, same client.

A child process serves both apps on 127.0.0.1 (the kvledger app on the tiny model with
its whole KV pool held, so every completion is refused); this process is the client.

    .venv/bin/python bench/http_overhead.py       # ~30 s
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
from aiohttp import web
from local_server import free_port

TEXT = "The quick brown fox jumps over the lazy dog. " * 2
# Short prompts (90 bytes) let a full pool refuse before tokenizing; a 225-byte prompt
# with max_tokens 64 might not fit the 256-token context, so it is tokenized first.
COMPLETION = {"prompt": TEXT, "max_tokens": 64}
CHAT = {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 64}
LONG_COMPLETION = {"prompt": TEXT * 2 + TEXT[:45], "max_tokens": 64}




async def _bare_429(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"error": {"message": "full", "type": "rate_limit_error",
                                        "code": "kv_cache_full", "param": None}},
                             status=429, headers={"Retry-After": "1", "retry-after-ms": "1000"})


async def serve(bare_port: int, kv_port: int, model_dir: str) -> None:
    """Child: the bare app and the kvledger app (pool fully held) until stdin closes."""
    import torch

    from kvledger.engine.core.engine import LLMEngine
    from kvledger.engine.server.app import build_app
    from kvledger.engine.server.state import STATE
    from kvledger.engine.settings.config import EngineConfig

    torch.set_num_threads(1)
    bare = web.Application()
    bare.router.add_post("/v1/completions", _bare_429)
    bare.router.add_post("/v1/chat/completions", _bare_429)
    kv = build_app()
    llm = LLMEngine.from_config(EngineConfig(model=model_dir, device="cpu", max_model_len=256,
                                             num_gpu_blocks_override=32))
    runners = []
    for app, port in ((bare, bare_port), (kv, kv_port)):
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    await kv[STATE].attach(llm)
    held = llm.ledger.try_reserve(llm.ledger.num_blocks * llm.ledger.block_size)
    print(json.dumps({"model": kv[STATE].model_name}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    llm.ledger.release(held)
    for runner in runners:
        await runner.cleanup()


async def load(url: str, body: dict, requests: int, concurrency: int) -> float:
    """Requests/s of ``requests`` POSTs over ``concurrency`` keep-alive connections."""
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        remaining = requests

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                async with session.post(url, json=body) as response:
                    await response.read()
                    if response.status != 429:
                        sys.exit(f"expected 429, got {response.status}")

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return requests / (time.perf_counter() - started)


async def bench(args) -> None:
    from kvledger.engine.model.builtin import write_model

    model_dir = write_model("tiny-llama", tempfile.mkdtemp(prefix="kvledger-bench-"))
    bare_port, kv_port = free_port(), free_port()
    child = subprocess.Popen([sys.executable, __file__, "--serve", str(bare_port), str(kv_port),
                              str(model_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        model = json.loads(child.stdout.readline())["model"]
        bare, kv = f"http://127.0.0.1:{bare_port}/v1", f"http://127.0.0.1:{kv_port}/v1"
        targets = {
            "bare aiohttp 429": (bare + "/completions", COMPLETION),
            "kvledger completion 429 (refused before tokenizing)": (kv + "/completions",
                                                                    COMPLETION),
            "kvledger chat 429 (template rendered, refused before tokenizing)": (
                kv + "/chat/completions", CHAT),
            "kvledger completion 429 (tokenized, then refused by the ledger)": (
                kv + "/completions", LONG_COMPLETION),
        }
        for url, body in targets.values():  # warm all
            await load(url, {"model": model, **body}, 200, args.concurrency)
        rounds = {name: [] for name in targets}
        for _ in range(args.rounds):  # interleaved rounds: the box is shared and noisy
            for name, (url, body) in targets.items():
                rps = await load(url, {"model": model, **body}, args.requests, args.concurrency)
                rounds[name].append(rps)
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    print(f"{args.requests} requests x {args.rounds} interleaved rounds, {args.concurrency} "
          f"connections, client and server on the same machine\n")
    bare = rounds.pop("bare aiohttp 429")
    print("| handler | requests/s (median round) | vs bare (median of per-round ratios) |")
    print("|---|---:|---:|")
    print(f"| bare aiohttp 429 | {statistics.median(bare):.0f} | 1 |")
    for name, values in rounds.items():
        ratio = statistics.median(v / b for v, b in zip(values, bare, strict=True))
        print(f"| {name} | {statistics.median(values):.0f} | {ratio:.2f} |")


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--serve":
        asyncio.run(serve(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--concurrency", type=int, default=32)
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
