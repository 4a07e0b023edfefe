"""What bench/hostile_cluster.py's sections share: the operator's webhook started against
kmock's emulator (tests/webhook_harness.py) and warmed up, its memory sampled from /proc,
and raw TLS or TCP connections held open as a hostile client holds them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from hostile_hub import write_moe_repo
from hub_server import HubServer
from operator_harness import emulated_cluster
from webhook_harness import admission_review, gpu_node, webhook_operator

TIMEOUT_S = 10.0  # the chart's webhook.timeoutSeconds
H100 = ("h100", 4, 81559, "NVIDIA-H100-80GB-HBM3")
A100 = ("a100", 8, 40960, "NVIDIA-A100-SXM4-40GB")


@contextlib.asynccontextmanager
async def webhook(args, hub: HubServer | None = None, nodes: tuple = (H100,),
                  per_kind: int = 1) -> AsyncIterator[Any]:
    """The emulator with ``nodes`` (``per_kind`` of each), and the operator's webhook
    reading ``hub``, warmed up: one hf:// model read, so the hub client's imports are in
    the baseline."""
    async with emulated_cluster() as cluster:
        for name, gpus, mib, product in nodes:
            for i in range(per_kind):
                await cluster.api.create("/api/v1/nodes", gpu_node(f"{name}-{i}", gpus, mib,
                                                                   product))
        policy = {"hubEndpoints": [hub.url]} if hub is not None else {}
        async with webhook_operator(cluster, args.tmp / "operator.log", policy=policy,
                                    timeout_s=TIMEOUT_S) as client:
            if hub is not None:
                await client.ask(admission_review(hub_spec("warm/small")))
            yield client


def hub_spec(repo: str, **engine: Any) -> dict[str, Any]:
    return {"model": {"uri": f"hf://{repo}"}, "gpus": 1, "engine": engine}


def small_repo(args) -> Path:
    folder = args.tmp / "small"
    if not folder.exists():
        write_moe_repo(folder, layers=2, experts=4, shards=2)
    return folder


async def settle(count: Callable[[], int], quiet_s: float, limit_s: float) -> None:
    """Until ``count()`` has not changed for ``quiet_s`` (at most ``limit_s``)."""
    last, since, started = count(), time.monotonic(), time.monotonic()
    while time.monotonic() - started < limit_s and time.monotonic() - since < quiet_s:
        await asyncio.sleep(0.2)
        if count() != last:
            last, since = count(), time.monotonic()


def said(answer: dict[str, Any]) -> str:
    if not answer["allowed"]:
        return f"refused {answer['status']['code']}: {answer['status']['message'][:110]}"
    return "allowed" + (f" with a warning: {answer['warnings'][0][:110]}"
                        if answer.get("warnings") else "")


async def gather_limited(make: Callable[[], Any], count: int, at_once: int = 64) -> list:
    gate = asyncio.Semaphore(at_once)

    async def one() -> Any:
        async with gate:
            return await make()

    return await asyncio.gather(*(one() for _ in range(count)))
