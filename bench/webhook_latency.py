"""How long `kubectl apply` waits on the admission webhook: its answers timed over HTTPS.

Runs ``kvledger operator --webhook-port`` (its own process, self-signed TLS) against kmock's
Kubernetes emulator with a GPU node pool (4 x H100 80 GB and 8 x A100 40 GB nodes, labelled
as GPU feature discovery labels them), and a hub stand-in on 127.0.0.1 (tests/hub_server.py)
serving bench/plan_speed.py's Llama-3-70B-shaped checkpoint (30 sparse shards, 131 GiB of
tensors). Times AdmissionReview v1 requests on one kept-alive connection, as the API server
sends them, in three kinds:

  local     a model on a volume (the operator cannot read it: spec and nodes only)
  cached    hf:// 70B whose headers were read before, each request a different spec
            (engine.maxNumSeqs from 1 to 200: about half refused, their remedies searched)
  uncached  hf:// 70B never seen: each request a different repository (same files), so the
            revision, config.json, the index and 30 headers are read over HTTP first
  flood     --flood (150) reviews of the 70B at once, each a spec not planned before, each
            on a connection of its own (as the API server opens them): more than the
            planner can do within the 10 s timeoutSeconds, so some are allowed with the
            deadline's warning
  cheap     sent 1 s into the flood, each on a connection of its own: gpus 0, an UPDATE
            that leaves the spec as it was, a spec planned before

Claims (exit 1 when one fails): p99 under 200 ms for local and cached decisions, under 5 s
for an uncached 70B; every review of the flood answered within the 10 s deadline (its
slowest, p100), and each cheap one under 1 s. Prints a table of p50 / p99 / max per kind
and the verdicts seen.

    .venv/bin/python bench/webhook_latency.py [--requests 200] [--uncached 12] [--flood 150]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

from hub_server import HubServer  # noqa: E402
from operator_harness import emulated_cluster  # noqa: E402
from plan_speed import write_sparse_checkpoint  # noqa: E402
from webhook_harness import SERVER_NAME, admission_review, webhook_operator  # noqa: E402

# Each kind's claim: (the quantile that must be under it, seconds).
CLAIMS_S = {"local": (0.99, 0.2), "cached": (0.99, 0.2), "uncached": (0.99, 5.0),
            "flood": (1.0, 10.0), "cheap": (1.0, 1.0)}
POOL = [("h100", 4, 81559, "NVIDIA-H100-80GB-HBM3"), ("a100", 8, 40960, "NVIDIA-A100-SXM4-40GB")]


def node(name: str, gpus: int, mib: int, product: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"nvidia.com/gpu.memory": str(mib),
                                                  "nvidia.com/gpu.product": product,
                                                  "nvidia.com/gpu.count": str(gpus)}},
            "spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]},
            "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}}


def spec_70b(repo: str, max_num_seqs: int) -> dict:
    return {"model": {"uri": f"hf://{repo}"}, "gpus": 4,
            "engine": {"maxModelLen": 8192, "maxNumSeqs": max_num_seqs}}


async def timed(client, spec: dict) -> tuple[float, bool]:
    started = time.perf_counter()
    answer = await client.ask(admission_review(spec))
    return time.perf_counter() - started, answer["allowed"]


async def flood(client, count: int) -> tuple[list, list]:
    """``count`` reviews of new specs at once and, 1 s in, the cheap ones: each on a
    connection of its own, timed from its send to its answer."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def one(body: dict) -> tuple[float, bool]:
            started = time.perf_counter()
            async with http.post(f"https://127.0.0.1:{client.port}/validate", json=body,
                                 ssl=client.trust, server_hostname=SERVER_NAME) as response:
                answer = (await response.json())["response"]
            return time.perf_counter() - started, answer["allowed"]

        spec = functools.partial(spec_70b, "bench/llama-70b-0")
        floods = [asyncio.ensure_future(one(admission_review(spec(1000 + i))))
                  for i in range(count)]
        await asyncio.sleep(1.0)
        cheap = await asyncio.gather(
            one(admission_review(dict(spec(7), gpus=0))),
            one(admission_review(spec(9), operation="UPDATE", old_spec=spec(9))),
            one(admission_review(spec(16))))
        return await asyncio.gather(*floods), cheap


async def measure(args: argparse.Namespace, hub: HubServer, log: Path) -> dict[str, list]:
    async with emulated_cluster() as cluster:
        for name, gpus, mib, product in POOL:
            for i in range(args.nodes_per_kind):
                await cluster.api.create("/api/v1/nodes", node(f"{name}-{i}", gpus, mib, product))
        async with webhook_operator(cluster, log, policy={"hubEndpoints": [hub.url]},
                                    timeout_s=10) as client:
            runs: dict[str, list[tuple[float, bool]]] = {kind: [] for kind in CLAIMS_S}
            for i in range(args.requests):
                runs["local"].append(await timed(client, {
                    "model": {"path": "/models/llama"}, "gpus": 1 + i % 4}))
            await timed(client, spec_70b("bench/llama-70b-0", 16))  # the headers, read once
            for i in range(args.requests):
                runs["cached"].append(await timed(client, spec_70b("bench/llama-70b-0",
                                                                   1 + i * 37 % 200)))
            for i in range(1, args.uncached + 1):
                runs["uncached"].append(await timed(client, spec_70b(f"bench/llama-70b-{i}",
                                                                     16)))
            runs["flood"], runs["cheap"] = await flood(client, args.flood)
            return runs


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200,
                        help="requests of the local and cached kinds each (default 200)")
    parser.add_argument("--uncached", type=int, default=12,
                        help="uncached 70B requests, each a new repository (default 12)")
    parser.add_argument("--flood", type=int, default=150,
                        help="reviews of new specs sent at once (default 150)")
    parser.add_argument("--nodes-per-kind", type=int, default=8,
                        help="nodes of each GPU kind in the pool (default 8)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, HubServer() as hub:
        (Path(tmp) / "ckpt").mkdir()
        write_sparse_checkpoint(Path(tmp) / "ckpt", 30)
        for i in range(args.uncached + 1):
            hub.add_commit(f"bench/llama-70b-{i}", Path(tmp) / "ckpt")
        runs = asyncio.run(measure(args, hub, Path(tmp) / "operator.log"))
    failed = []
    print("| decision | requests | allowed / refused | p50 | p99 | max | claim |")
    print("|---|---|---|---|---|---|---|")
    for kind, (q, claim) in CLAIMS_S.items():
        seconds = [s for s, _ in runs[kind]]
        allowed = sum(ok for _, ok in runs[kind])
        got = quantile(seconds, q)
        held = got < claim
        which = "max" if q == 1.0 else f"p{q * 100:.0f}"
        print(f"| {kind} | {len(seconds)} | {allowed} / {len(seconds) - allowed} "
              f"| {statistics.median(seconds) * 1000:.1f} ms "
              f"| {quantile(seconds, 0.99) * 1000:.1f} ms | {max(seconds) * 1000:.1f} ms "
              f"| {which} < {claim * 1000:.0f} ms: {'held' if held else 'FAILED'} |")
        if not held:
            failed.append(f"{kind} {which} {got * 1000:.1f} ms is not under "
                          f"{claim * 1000:.0f} ms")
    for line in failed:
        print(f"FAILED: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
