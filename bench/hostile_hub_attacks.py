"""bench/hostile_cluster.py's sections on what the webhook reads and plans: hostile hub
repos (tests/hostile_hub.py), the pod's pre-flight on one, a flood of reviews to plan, and
SIGTERM while hub reads are under way. Each starts its own operator and hub stand-in."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import aiohttp
from _hub_helpers import run_with_peak
from attack_tools import (
    A100,
    H100,
    TIMEOUT_S,
    hub_spec,
    said,
    settle,
    small_repo,
    webhook,
)
from hostile_clients import Peak, exited, rss_mib
from hostile_hub import write_heavy_repo, write_moe_repo
from hub_server import HubServer
from plan_speed import write_sparse_checkpoint
from webhook_harness import SERVER_NAME, admission_review

# What the webhook may read of one model (operator/webhook/webhook.py's limit, which its warning
# names), what the operator may grow by whatever the repos, how soon it exits.
MODEL_BYTES_MIB = 16
GROWTH_MIB = {"hub": 48, "wide": 96}
CLAIMED_EXIT_S = 5.0
CHEAP_S = 1.0


async def hub_headers(args, report) -> None:
    heavy = args.tmp / "heavy"
    if not heavy.exists():
        write_heavy_repo(heavy, shards=6, header_bytes=95_000_000)
    with HubServer() as hub:
        hub.add_commit("warm/small", small_repo(args))
        hub.add_commit("hostile/heavy", heavy)
        async with webhook(args, hub) as client:
            base = rss_mib(client.pid)
            with Peak(client.pid) as peak:
                started = time.monotonic()
                answer = await client.ask(admission_review(hub_spec("hostile/heavy"),
                                                           dry_run=True))
                took = time.monotonic() - started
                # The read may go on once answered: until the hub stops sending (or 90 s).
                await settle(lambda: hub.served_bytes("hostile/heavy"), 3.0, 90.0)
            pulled = hub.served_bytes("hostile/heavy") / 2**20
    grown = peak.mib - base
    report.check("6 x 95 MB headers: operator memory", f"+{grown:.0f} MiB (peak "
                 f"{peak.mib:.0f} MiB)", f"under +{GROWTH_MIB['hub']} MiB",
                 grown < GROWTH_MIB["hub"])
    report.check("6 x 95 MB headers: pulled from the hub", f"{pulled:.1f} MiB",
                 f"at most {MODEL_BYTES_MIB} MiB", pulled <= MODEL_BYTES_MIB)
    report.check("6 x 95 MB headers: the answer", f"{took:.1f} s, {said(answer)}",
                 f"under {TIMEOUT_S - 2:g} s, naming {MODEL_BYTES_MIB} MiB",
                 took < TIMEOUT_S - 2 and f"{MODEL_BYTES_MIB} MiB" in str(answer))


async def hub_wide(args, report) -> None:
    wide = args.tmp / "wide"
    if not wide.exists():
        write_moe_repo(wide, layers=42, experts=512)
    repos = [f"hostile/wide-{i}" for i in range(6 if not args.fast else 3)]
    with HubServer() as hub:
        hub.add_commit("warm/small", small_repo(args))
        for repo in repos:
            hub.add_commit(repo, wide)
        async with webhook(args, hub) as client:
            base = rss_mib(client.pid)
            with Peak(client.pid) as peak:
                started = time.monotonic()
                answers = await asyncio.gather(*(client.ask(admission_review(hub_spec(repo)))
                                                 for repo in repos))
                took = time.monotonic() - started
                await settle(lambda: sum(hub.served_bytes(r) for r in repos), 3.0, 120.0)
                again = await asyncio.gather(*(client.ask(admission_review(hub_spec(repo)))
                                               for repo in repos))
    grown = peak.mib - base
    verdicts = sorted({said(a)[:60] for a in answers + again})
    report.check(f"{len(repos)} repos of 64,893 tensors at once: operator memory",
                 f"+{grown:.0f} MiB (peak {peak.mib:.0f} MiB); answered in {took:.1f} s: "
                 f"{' / '.join(verdicts)}", f"under +{GROWTH_MIB['wide']} MiB",
                 grown < GROWTH_MIB["wide"])


async def preflight_headers(args, report) -> None:
    heavy = args.tmp / "heavy"
    if not heavy.exists():
        write_heavy_repo(heavy, shards=6, header_bytes=95_000_000)
    with HubServer() as hub:
        hub.add_commit("hostile/heavy", heavy)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("HF_")},
               "HF_ENDPOINT": hub.url, "HF_HOME": str(args.tmp / "hf-home")}
        result, peak = await asyncio.to_thread(run_with_peak, [
            sys.executable, "-m", "kvledger.engine.cli", "plan", "--model", "hf://hostile/heavy",
            "--device-memory", "80GiB"], env)
        pulled = hub.served_bytes("hostile/heavy") / 2**20
    lines = result.stderr.strip().splitlines()
    report.check("kvledger plan on the 6 x 95 MB repo", f"peak {peak:.0f} MiB, {pulled:.1f} MiB "
                 f"pulled, exit {result.returncode}: {lines[-1][:120] if lines else ''}",
                 "exit 2, one error line, under 200 MiB",
                 result.returncode == 2 and len(lines) == 1 and peak < 200)


async def review_flood(args, report) -> None:
    count = 150
    ckpt = args.tmp / "llama-70b"
    if not ckpt.exists():
        ckpt.mkdir()
        write_sparse_checkpoint(ckpt, 30)
    with HubServer() as hub:
        hub.add_commit("warm/small", small_repo(args))
        hub.add_commit("bench/llama-70b", ckpt)
        async with webhook(args, hub, nodes=(H100, A100), per_kind=2) as client:
            def spec(seqs: int, gpus: int = 4) -> dict:
                return {"model": {"uri": "hf://bench/llama-70b"}, "gpus": gpus,
                        "engine": {"maxModelLen": 8192, "maxNumSeqs": seqs}}

            await client.ask(admission_review(spec(16)))  # read once, its plan kept
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as http:
                async def timed(body: dict) -> tuple[float, dict | None]:
                    started = time.monotonic()
                    try:
                        async with http.post(f"https://127.0.0.1:{client.port}/validate",
                                             json=body, ssl=client.trust,
                                             server_hostname=SERVER_NAME,
                                             timeout=aiohttp.ClientTimeout(total=60)) as r:
                            answer = (await r.json())["response"] if r.status == 200 else None
                    except (TimeoutError, aiohttp.ClientError):
                        answer = None
                    return time.monotonic() - started, answer

                flood = [asyncio.ensure_future(timed(admission_review(spec(200 + i))))
                         for i in range(count)]
                await asyncio.sleep(1.0)
                cheap = {
                    "gpus 0": admission_review(spec(7, gpus=0)),
                    "an unchanged spec": admission_review(spec(9), operation="UPDATE",
                                                          old_spec=spec(9)),
                    "a cached plan": admission_review(spec(16)),
                }
                cheap_done = dict(zip(cheap, await asyncio.gather(*map(timed, cheap.values())),
                                      strict=True))
                done = await asyncio.gather(*flood)
    slowest = max(s for s, _ in done)
    late = sum(s >= TIMEOUT_S for s, _ in done)
    unanswered = sum(a is None for _, a in done)
    warned = sum(bool(a and a["allowed"] and any("deadline" in w for w in a.get("warnings") or []))
                 for _, a in done)
    report.check(f"{count} concurrent reviews of distinct specs (cached 70B)",
                 f"slowest {slowest:.1f} s, {late} at or past {TIMEOUT_S:g} s, {unanswered} "
                 f"unanswered, {warned} allowed with the deadline's warning",
                 f"every one answered under {TIMEOUT_S:g} s", late == 0 and unanswered == 0)
    for what, (took, answer) in cheap_done.items():
        report.check(f"a review of {what} during the flood", f"{took:.2f} s"
                     + ("" if answer else " (no answer)"), f"under {CHEAP_S:g} s",
                     took < CHEAP_S and answer is not None)


async def sigterm_reads(args, report) -> None:
    count = 16
    with HubServer() as hub:
        hub.add_commit("warm/small", small_repo(args))
        for i in range(count):
            hub.add_commit(f"slow/model-{i}", small_repo(args))
        async with webhook(args, hub) as client:
            hub.drip_s["config.json"] = 0.5  # a byte every 0.5 s: each read takes minutes
            asks = [asyncio.ensure_future(client.ask(admission_review(hub_spec(f"slow/model-{i}"))))
                    for i in range(count)]
            await asyncio.sleep(2.0)  # the reads under way, the rest queued
            os.kill(client.pid, signal.SIGTERM)
            started = time.monotonic()
            while not exited(client.pid) and time.monotonic() - started < 180:
                await asyncio.sleep(0.05)
            took = time.monotonic() - started
            for ask in asks:
                ask.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
    report.check(f"SIGTERM with {count} hub reads under way or queued", f"exited in {took:.1f} s",
                 f"under {CLAIMED_EXIT_S:g} s", took < CLAIMED_EXIT_S)
