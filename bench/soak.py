"""Soak: hostile, mixed traffic against one real ``kvledger serve`` for ``--duration`` s.

The server (tiny model, CPU, a small KV pool, a short FIFO queue) runs in a child process
whose sampler fails every request that carries ``seed == FAULT_SEED`` at its third
token: a per-request fault injected where a real one would rise. Clients, all at once:
streams and whole answers, ``max_tokens`` set and unset, chats and completions; streams
dropped mid-way and requests dropped while queued; floods that draw 429s and clients
that honour ``retry-after-ms``; the faulty requests. A poller times ``/health`` the whole
time.

Printed: requests by kind and outcome, p50/p99 latency of completed requests, the worst
``/health`` latency, the server's RSS after warm-up and at the end, and the pool at idle.
Exits 1 on any leak (blocks reserved or used at idle), any 5xx or stream error other than
the injected faults, a faulty request that was not failed, ``/health`` failing or slower
than ``--health-limit-ms``, or RSS growth past ``--rss-growth-mib``.

    .venv/bin/python bench/soak.py [--duration 180]       # the README's run: --duration 600
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from local_server import free_port, wait_ready

FAULT_SEED = 13013
WARMUP_S = 10.0


def serve_with_faults(argv: list[str]) -> int:
    """``kvledger serve`` whose sampler fails requests seeded FAULT_SEED (the child)."""
    from kvledger.engine.cli import main
    from kvledger.engine.sampling import sampler as sampler_module

    real = sampler_module.Sampler.__call__

    def faulty(self, logits, seqs):
        if any(s.params.seed == FAULT_SEED and len(s.output_token_ids) >= 2 for s in seqs):
            raise RuntimeError("soak: injected sampling fault")
        return real(self, logits, seqs)

    sampler_module.Sampler.__call__ = faulty
    return main(["serve", *argv])




def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Soak:
    def __init__(self, base: str, model: str, args: argparse.Namespace) -> None:
        self.base, self.model, self.args = base, model, args
        self.outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.latencies_s: list[float] = []
        self.problems: list[str] = []
        self.health_worst_ms = 0.0
        self.deadline = 0.0

    def body(self, rng: random.Random, *, chat: bool, stream: bool, fault: bool = False,
             capped: bool = True) -> dict:
        words = " ".join(rng.choice(("river", "stone", "light", "cold", "north", "song"))
                         for _ in range(rng.randint(3, 40)))
        body: dict = {"model": self.model, "stream": stream, "ignore_eos": True}
        if chat:
            body["messages"] = [{"role": "user", "content": words}]
        else:
            body["prompt"] = words
        if capped or fault:
            body["max_tokens"] = rng.randint(16, 96)
        elif not chat:
            body["max_tokens"] = None  # the rest of the context (unset, a completion's is 16)
        if stream:
            body["stream_options"] = {"include_usage": True}
        if fault:
            body.update(seed=FAULT_SEED, temperature=0.7)
        return body

    async def send(self, session: aiohttp.ClientSession, kind: str, body: dict,
                   drop_after_chunks: int | None = None) -> tuple[int, float]:
        """One request, recorded; returns (status, the retry-after-ms of a 429 in s)."""
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        started = time.monotonic()
        async with session.post(self.base + path, json=body) as response:
            if response.status != 200 or not body["stream"]:
                payload = await response.read()
                outcome = str(response.status)
                if response.status == 200:
                    self.latencies_s.append(time.monotonic() - started)
                elif response.status >= 500 and "error" not in json.loads(payload or b"{}"):
                    self.problems.append(f"{kind}: {response.status} without an error body")
                self.record(kind, outcome, body)
                return response.status, int(response.headers.get("retry-after-ms", 0)) / 1000
            chunks, error, done = 0, False, False
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                if b'"error"' in data and b'"choices"' not in data:
                    error = True
                chunks += 1
                if drop_after_chunks is not None and chunks >= drop_after_chunks:
                    outcome = "dropped-mid-stream"
                    self.record(kind, outcome, body)
                    return 200, 0.0  # leaving the block closes the connection
            outcome = "stream-error" if error else ("200-stream" if done else "stream-cut")
            if outcome == "200-stream":
                self.latencies_s.append(time.monotonic() - started)
            if error and not done:
                self.problems.append(f"{kind}: a stream error without [DONE]")
            self.record(kind, outcome, body)
            return 200, 0.0

    def record(self, kind: str, outcome: str, body: dict) -> None:
        self.outcomes[(kind, outcome)] += 1
        failed = outcome.startswith("5") or outcome in ("stream-error", "stream-cut")
        if body.get("seed") == FAULT_SEED:
            if outcome not in ("500", "stream-error", "429"):
                self.problems.append(f"{kind}: the injected fault was not failed ({outcome})")
        elif failed:
            self.problems.append(f"{kind}: {outcome}")

    async def client(self, session: aiohttp.ClientSession, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.deadline:
            chat, stream = rng.random() < 0.4, rng.random() < 0.5
            roll = rng.random()
            try:
                if roll < 0.08:
                    await self.send(session, "fault", self.body(rng, chat=chat, stream=stream,
                                                                fault=True))
                elif roll < 0.2:
                    await self.send(session, "drop-mid-stream",
                                    self.body(rng, chat=chat, stream=True),
                                    drop_after_chunks=rng.randint(1, 4))
                elif roll < 0.3:
                    await self.drop_while_queued(session, rng)
                elif roll < 0.4:
                    await self.flood(session, rng)
                else:
                    await self.polite(session, rng, chat, stream)
            except (TimeoutError, aiohttp.ClientError) as exc:
                self.problems.append(f"client error: {type(exc).__name__}: {exc}")

    async def polite(self, session, rng, chat: bool, stream: bool) -> None:
        """Honours retry-after-ms, up to 5 attempts; max_tokens unset one time in four."""
        body = self.body(rng, chat=chat, stream=stream, capped=rng.random() < 0.75)
        for _ in range(5):
            status, retry_after_s = await self.send(session, "polite", body)
            if status != 429:
                return
            await asyncio.sleep(retry_after_s)

    async def flood(self, session, rng) -> None:
        """16 uncapped requests at once: most draw a 429 (or a queue wait)."""
        await asyncio.gather(*(self.send(session, "flood", self.body(rng, chat=False,
                                                                      stream=False, capped=False))
                               for _ in range(16)))

    async def drop_while_queued(self, session, rng) -> None:
        """An uncapped request given up after 50-300 ms: often still queued for blocks."""
        body = self.body(rng, chat=False, stream=False, capped=False)
        try:
            await asyncio.wait_for(self.send(session, "drop-queued", body), rng.uniform(0.05, 0.3))
        except TimeoutError:
            self.outcomes[("drop-queued", "dropped")] += 1

    async def health(self, session: aiohttp.ClientSession) -> None:
        while time.monotonic() < self.deadline:
            started = time.monotonic()
            try:
                async with session.get(self.base + "/health",
                                       timeout=aiohttp.ClientTimeout(total=5)) as response:
                    await response.read()
                    if response.status != 200:
                        self.problems.append(f"/health answered {response.status}")
            except (TimeoutError, aiohttp.ClientError) as exc:
                self.problems.append(f"/health failed: {type(exc).__name__}")
            self.health_worst_ms = max(self.health_worst_ms, (time.monotonic() - started) * 1e3)
            await asyncio.sleep(0.05)




async def _idle_pool(base: str, timeout_s: float = 30.0) -> dict:
    """The ledger once nothing runs or waits (or whatever it holds after timeout_s)."""
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + timeout_s
        while True:
            async with session.get(base + "/v1/budget") as response:
                budget = await response.json()
            pool, queue = budget["pool"], budget["queue"]
            idle = queue["running"] == 0 and queue["waiting"] == 0
            if (idle and pool["reserved_blocks"] == 0) or time.monotonic() > deadline:
                return {**pool, **queue}
            await asyncio.sleep(0.2)


async def _failed_requests_metric(base: str) -> float:
    """``kvledger_requests_failed_total{reason="request_error"}`` as the server counts it."""
    async with aiohttp.ClientSession() as session, session.get(base + "/metrics") as response:
        text = await response.text()
    name = 'kvledger_requests_failed_total{reason="request_error"} '
    return sum(float(line[len(name):]) for line in text.splitlines() if line.startswith(name))


async def bench(args: argparse.Namespace) -> int:
    from kvledger.engine.model.builtin import write_model

    model_dir = write_model("tiny-llama", Path(tempfile.mkdtemp(prefix="kvledger-soak-")) / "m")
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="kvledger-soak-", suffix=".log")[1])
    serve_flags = ["--model", str(model_dir), "--served-model-name", "tiny-llama",
                   "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
                   "--max-model-len", "256", "--max-num-seqs", "8",
                   "--num-gpu-blocks-override", str(args.pool_blocks),
                   "--max-queue-wait", "1", "--log-level", "warning"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--serve-with-faults", *serve_flags],
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        model = await wait_ready(base, proc)
        soak = Soak(base, model, args)
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        timeout = aiohttp.ClientTimeout(total=120)
        started = time.monotonic()
        soak.deadline = started + args.duration
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            tasks = [asyncio.ensure_future(soak.client(session, args.seed + i))
                     for i in range(args.clients)]
            tasks.append(asyncio.ensure_future(soak.health(session)))
            await asyncio.sleep(min(WARMUP_S, args.duration / 4))
            rss_start = _rss_mib(proc.pid)
            await asyncio.gather(*tasks)
        pool = await _idle_pool(base)
        pool["failed_metric"] = await _failed_requests_metric(base)
        rss_end = _rss_mib(proc.pid)
        elapsed = time.monotonic() - started
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(model_dir.parent, ignore_errors=True)  # the log stays, for a reader
    return report(soak, pool, rss_start, rss_end, elapsed, log_path, args)


def report(soak: Soak, pool: dict, rss_start: float, rss_end: float, elapsed: float,
           log_path: Path, args: argparse.Namespace) -> int:
    print(f"tiny-llama on CPU, pool {args.pool_blocks} blocks x 16 tokens, {args.clients} "
          f"clients, {elapsed:.0f} s; server log {log_path} ({log_path.stat().st_size} bytes)")
    print("\n| kind | outcome | requests |\n|---|---|---:|")
    for (kind, outcome), count in sorted(soak.outcomes.items()):
        print(f"| {kind} | {outcome} | {count} |")
    lat = sorted(soak.latencies_s)
    p50 = statistics.median(lat) if lat else float("nan")
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
    print(f"\ncompleted: {len(lat)}, latency p50 {p50:.2f} s, p99 {p99:.2f} s; "
          f"/health worst {soak.health_worst_ms:.0f} ms")
    print(f"server RSS after warm-up {rss_start:.0f} MiB, at the end {rss_end:.0f} MiB "
          f"({rss_end - rss_start:+.0f} MiB)")
    print(f"pool at idle: reserved {pool['reserved_blocks']}, used {pool['used_blocks']}, "
          f"running {pool['running']}, waiting {pool['waiting']}; failed requests counted "
          f"by the server: {pool['failed_metric']:.0f}")
    problems = list(soak.problems)
    if pool["reserved_blocks"] or pool["used_blocks"]:
        problems.append(f"leak: {pool['reserved_blocks']} blocks reserved, "
                        f"{pool['used_blocks']} used at idle")
    if soak.health_worst_ms > args.health_limit_ms:
        problems.append(f"/health took {soak.health_worst_ms:.0f} ms "
                        f"(limit {args.health_limit_ms} ms)")
    if rss_end - rss_start > args.rss_growth_mib:
        problems.append(f"RSS grew {rss_end - rss_start:.0f} MiB "
                        f"(limit {args.rss_growth_mib} MiB)")
    faults = sum(n for (kind, outcome), n in soak.outcomes.items()
                 if kind == "fault" and outcome in ("500", "stream-error"))
    if not faults:
        problems.append("no injected fault reached the engine: the soak proved nothing")
    if pool["failed_metric"] != faults:
        problems.append(f"kvledger_requests_failed_total{{reason=\"request_error\"}} is "
                        f"{pool['failed_metric']:.0f}, the clients saw {faults} failed requests")
    for problem, count in collections.Counter(problems).most_common():
        print(f"FAIL: {problem}" + (f" (x{count})" if count > 1 else ""))
    print("soak passed" if not problems else f"soak failed: {len(problems)} problems")
    return 1 if problems else 0


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-with-faults":
        sys.exit(serve_with_faults(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of traffic")
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--pool-blocks", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--health-limit-ms", type=float, default=1000.0)
    parser.add_argument("--rss-growth-mib", type=float, default=150.0)
    args = parser.parse_args()
    sys.exit(asyncio.run(bench(args)))


if __name__ == "__main__":
    main()
