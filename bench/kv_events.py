"""KV-cache events (``--kv-events-config``): what the engine's step pays for them, how many
the publisher sustains, whether a subscriber rebuilds the pod's blocks exactly, and what a
router gains by routing on them across two replicas.

    .venv/bin/python bench/kv_events.py [--model small-llama] [--docs 8] [--requests 48]
        [--concurrency 4] [--quick] [--json]

1. **Step cost** (in this process, one ``LLMEngine``): a prefix-heavy workload (``--docs``
   documents of 256 tokens, each request a document and a 16-64-token question, 16 output
   tokens; the pool a quarter of what the documents need, so blocks are evicted) run with
   events on (a publisher on an ipc socket, a subscriber reading it) and off, A-B-B-A. The
   time the step spends in event code (logging stored/removed blocks, sealing the batch:
   every call timed) as a share of the step's time; claim < 1%. The whole run's step time
   with and without events is printed too, with the spread of the two "off" runs (this
   machine's noise).
2. **Sustained rate**: a publisher and a subscriber alone, batches of 32 one-block
   ``BlockStored`` events as fast as the log takes them; claim: at least 20x the blocks per
   second the engine stored in part 1.
3. **Round trip**: the subscriber of part 1 rebuilds the pod's findable blocks from the
   events (stored adds, removed drops, cleared empties) and compares them with the
   ledger's own findable blocks at the end; claim: identical.
4. **Routing** (two ``kvledger serve`` processes, each publishing to a subscriber here):
   the same documents and questions sent over HTTP (streamed, TTFT to the first chunk) with
   each request going to the replica whose published blocks cover the longest prefix of
   its prompt (keys computed from the prompt's tokens as the router would: kv/event_keys.py;
   a tie goes to the replica with fewer requests in flight), vs round robin. Each replica's
   pool holds about half the documents. Claims: routed by events, the share of prompt
   tokens found cached is higher and TTFT p50 is lower.

Exit status 1, one line per failed claim on stderr; 0 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import msgspec
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from local_server import free_port, wait_ready  # noqa: E402

from kvledger.engine.core.engine import LLMEngine  # noqa: E402
from kvledger.engine.core.kv_publisher import KVEventPublisher  # noqa: E402
from kvledger.engine.errors import AdmissionRejected  # noqa: E402
from kvledger.engine.kv.event_keys import EventKeys, external_hash  # noqa: E402
from kvledger.engine.kv.events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventLog,
)
from kvledger.engine.sampling.params import SamplingParams  # noqa: E402
from kvledger.engine.settings.config import EngineConfig  # noqa: E402
from kvledger.engine.settings.kv_events_config import KVEventsConfig  # noqa: E402

BLOCK = 16
DOC_TOKENS = 256
OUTPUT_TOKENS = 16


def workload(docs: int, requests: int, seed: int = 0) -> list[list[int]]:
    """Each request: one of ``docs`` documents (their own tokens), then a question."""
    rng = random.Random(seed)
    documents = [[rng.randrange(5, 1000) for _ in range(DOC_TOKENS)] for _ in range(docs)]
    return [documents[rng.randrange(docs)] + [rng.randrange(5, 1000)
                                              for _ in range(rng.randrange(16, 65))]
            for _ in range(requests)]


class Subscriber:
    """A SUB socket's frames, read on a thread of its own, and the block set they build."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.blocks: set[int] = set()
        self.events = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            _, _, payload = self.sock.recv_multipart()
            for event in decoder.decode(payload).events:
                self.events += 1
                if isinstance(event, BlockStored):
                    self.blocks.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self.blocks.difference_update(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    self.blocks.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.ctx.destroy(linger=0)


class Timed:
    """Wraps a log's step-path methods, adding each call's time to ``seconds``."""

    def __init__(self, log: KVEventLog) -> None:
        self.seconds = 0.0
        for name in ("stored", "removed", "cleared", "seal"):
            setattr(log, name, self._timed(getattr(log, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return timed


def engine_run(model_dir: str, prompts: list[list[int]], concurrency: int, events: bool,
               tmp: str) -> dict:
    """Part 1 (and 3): the workload through one engine; step seconds, event seconds,
    blocks stored, and with events the round trip's verdict."""
    pool = max(concurrency * 22, len(set(map(tuple, (p[:DOC_TOKENS] for p in prompts))))
               * DOC_TOKENS // BLOCK // 4)
    endpoint = f"ipc://{tmp}/kv-{os.getpid()}-{time.monotonic_ns()}"
    kv = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint) \
        if events else None
    engine = LLMEngine.from_config(EngineConfig(
        model=model_dir, device="cpu", block_size=BLOCK, max_model_len=512,
        num_gpu_blocks_override=pool, max_num_seqs=concurrency, kv_events_config=kv))
    log = engine.ledger.prefix_cache.events
    publisher = KVEventPublisher(kv, log) if events else None
    subscriber = Subscriber(endpoint) if events else None
    timer = Timed(log) if events else None
    time.sleep(0.3 if events else 0)  # the subscription reaches the publisher
    queue = list(enumerate(prompts))
    running = 0
    step_s = 0.0
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    while queue or running:
        while queue and running < concurrency:
            i, prompt = queue[0]
            try:
                engine.add_request(f"r{i}", prompt, params)
            except AdmissionRejected:
                break
            queue.pop(0)
            running += 1
        started = time.perf_counter()
        outputs = engine.step()
        if log is not None:
            log.seal()  # as the server's driver does after each step
        step_s += time.perf_counter() - started
        running -= sum(1 for out in outputs if out.finished)
    result = {"step_s": step_s, "event_s": timer.seconds if timer else 0.0}
    if events:
        publisher.close()
        time.sleep(0.3)
        subscriber.close()
        pool_keys = engine.ledger._pool._by_hash  # the ledger's findable blocks
        published = {external_hash(log._published[h]) for h in pool_keys if h in log._published}
        result.update(events=subscriber.events, published=publisher.published,
                      round_trip=(subscriber.blocks == published
                                  and len(published) == len(pool_keys)),
                      findable=len(pool_keys), rebuilt=len(subscriber.blocks))
    return result


def sustained_rate(tmp: str, seconds: float = 2.0) -> float:
    """Part 2: one-block BlockStored events per second through a publisher to a subscriber."""
    endpoint = f"ipc://{tmp}/rate"
    log = KVEventLog(BLOCK)
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    publisher = KVEventPublisher(config, log)
    subscriber = Subscriber(endpoint)
    time.sleep(0.3)
    event = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=list(range(BLOCK)),
                        block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None,
                        extra_keys=[None], group_idx=0, kv_cache_spec_kind="full_attention")
    sent = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        with log._lock:
            log._events.extend([event] * 32)
        log.seal()
        sent += 32
        while publisher.published * 32 < sent - 32 * 64:  # at most 64 batches in flight
            time.sleep(0.0005)
    while subscriber.events < sent and time.perf_counter() - started < seconds + 5:
        time.sleep(0.01)
    elapsed = time.perf_counter() - started
    publisher.close()
    subscriber.close()
    return subscriber.events / elapsed


async def routing(model_dir: str, prompts: list[list[int]], concurrency: int, tmp: str,
                  by_events: bool) -> dict:
    """Part 4: two replicas, requests routed by their published blocks or round robin."""
    replicas, procs, subs = [], [], []
    pool = len(set(map(tuple, (p[:DOC_TOKENS] for p in prompts)))) * DOC_TOKENS // BLOCK // 2 + \
        concurrency * 6
    try:
        for r in range(2):
            port, endpoint = free_port(), f"ipc://{tmp}/replica{r}-{by_events}"
            config = json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint})
            command = [sys.executable, "-m", "kvledger.engine.cli", "serve", "--model", model_dir,
                       "--device", "cpu", "--port", str(port), "--host", "127.0.0.1",
                       "--block-size", str(BLOCK), "--max-model-len", "512",
                       "--num-gpu-blocks-override", str(pool), "--enable-prompt-tokens-details", "--max-num-seqs",
                       str(concurrency), "--kv-events-config", config, "--log-level", "warning"]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
            procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))
            subs.append(Subscriber(endpoint))
            replicas.append(f"http://127.0.0.1:{port}")
        keys = EventKeys("sha256", seed="0")  # the replicas' PYTHONHASHSEED
        names = [await wait_ready(base, proc) for base, proc in zip(replicas, procs, strict=True)]
        model = names[0]
        in_flight = [0, 0]
        turn = iter(range(10**9))
        ttft: list[float] = []
        cached = [0]

        def choose(prompt: list[int]) -> int:
            if not by_events:
                return next(turn) % 2
            chain: list[bytes] = []
            keys.extend(chain, prompt, len(prompt) // BLOCK, BLOCK, lambda i: None)
            published = [external_hash(k) for k in chain]

            def covered(r: int) -> int:
                n = 0
                while n < len(published) and published[n] in subs[r].blocks:
                    n += 1
                return n
            return max((0, 1), key=lambda r: (covered(r), -in_flight[r], -r))

        async def one(session: aiohttp.ClientSession, prompt: list[int]) -> None:
            r = choose(prompt)
            in_flight[r] += 1
            started = time.perf_counter()
            body = {"model": model, "prompt": prompt, "max_tokens": OUTPUT_TOKENS,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            first = None
            async with session.post(replicas[r] + "/v1/completions", json=body) as response:
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        chunk = json.loads(line[6:])
                        if first is None and chunk["choices"]:
                            first = time.perf_counter() - started
                        usage = chunk.get("usage") or {}
                        details = usage.get("prompt_tokens_details") or {}
                        cached[0] += details.get("cached_tokens") or 0
            in_flight[r] -= 1
            ttft.append(first)

        async with aiohttp.ClientSession() as session:
            pending = list(prompts)
            workers = [asyncio.create_task(_drain(session, pending, one))
                       for _ in range(concurrency)]
            await asyncio.gather(*workers)
        total = sum(len(p) for p in prompts)
        return {"ttft_p50_s": statistics.median(ttft),
                "ttft_p90_s": statistics.quantiles(ttft, n=10)[-1],
                "cached_share": cached[0] / total}
    finally:
        for sub in subs:
            sub.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)


async def _drain(session, pending: list, one) -> None:
    while pending:
        await one(session, pending.pop(0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--quick", action="store_true",
                        help="parts 1-3 on a few requests, no routing (CI)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from kvledger.engine.model.builtin import write_model

    failures, report = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_model(args.model, Path(tmp) / args.model))
        requests = 8 if args.quick else args.requests
        prompts = workload(args.docs, requests)
        runs = {}
        for label, events in (("off", False), ("on", True), ("on", True), ("off", False)):
            run = engine_run(model_dir, prompts, args.concurrency, events, tmp)
            runs.setdefault(label, []).append(run)
        on, off = runs["on"], runs["off"]
        share = sum(r["event_s"] for r in on) / sum(r["step_s"] for r in on)
        stored_rate = sum(r["events"] for r in on) / sum(r["step_s"] for r in on)
        report["step_cost"] = {
            "event_share_of_step": share,
            "step_s_on": [round(r["step_s"], 3) for r in on],
            "step_s_off": [round(r["step_s"], 3) for r in off],
            "off_spread": abs(off[0]["step_s"] - off[1]["step_s"]) / min(r["step_s"] for r in off),
            "events_per_step_second": stored_rate}
        if share >= 0.01:
            failures.append(f"events take {share:.2%} of the step (claim < 1%)")
        rate = sustained_rate(tmp)
        report["sustained_events_per_s"] = rate
        if rate < 20 * stored_rate:
            failures.append(f"the publisher sustains {rate:.0f} events/s, under 20x the "
                            f"engine's {stored_rate:.0f}/s")
        report["round_trip"] = [{"identical": r["round_trip"], "findable": r["findable"],
                                 "rebuilt": r["rebuilt"]} for r in on]
        if not all(r["round_trip"] for r in on):
            failures.append("a subscriber's rebuilt block set differs from the ledger's")
        if not args.quick:
            rr = asyncio.run(routing(model_dir, prompts, args.concurrency, tmp, by_events=False))
            ev = asyncio.run(routing(model_dir, prompts, args.concurrency, tmp, by_events=True))
            report["routing"] = {"round_robin": rr, "by_events": ev}
            if ev["cached_share"] <= rr["cached_share"]:
                failures.append(f"routed by events, {ev['cached_share']:.1%} of prompt tokens "
                                f"cached, round robin {rr['cached_share']:.1%}")
            if ev["ttft_p50_s"] >= rr["ttft_p50_s"]:
                failures.append(f"TTFT p50 routed by events {ev['ttft_p50_s']:.3f}s, round "
                                f"robin {rr['ttft_p50_s']:.3f}s")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        sc = report["step_cost"]
        print(f"step cost: events {sc['event_share_of_step']:.3%} of step time; step s on "
              f"{sc['step_s_on']} off {sc['step_s_off']} (off runs differ by "
              f"{sc['off_spread']:.1%}); {sc['events_per_step_second']:.0f} events per step-s")
        print(f"sustained: {report['sustained_events_per_s']:.0f} events/s")
        print(f"round trip: {report['round_trip']}")
        if "routing" in report:
            for name, r in report["routing"].items():
                print(f"{name}: TTFT p50 {r['ttft_p50_s']:.3f}s p90 {r['ttft_p90_s']:.3f}s, "
                      f"{r['cached_share']:.1%} of prompt tokens cached")
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
