"""Helpers for the server tests: a small real engine, an app around it, metric reads."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from kvledger.engine.config import EngineConfig
from kvledger.engine.server.app import build_app
from kvledger.engine.server.state import STATE, ServeOptions


def make_llm(model_dir: Path, **flags):
    """A CPU ``LLMEngine`` on the tiny model; small pools make 429s easy to reach."""
    from kvledger.engine.llm_engine import LLMEngine

    values = {"max_model_len": 256, "num_gpu_blocks_override": 32, "max_num_seqs": 8}
    values.update(flags)
    return LLMEngine.from_config(EngineConfig(model=str(model_dir), device="cpu", **values))


async def start_app(aiohttp_client, llm, **options):
    """An aiohttp test client on a loaded, warmed app serving ``llm``."""
    app = build_app(ServeOptions(**options))
    client = await aiohttp_client(app)
    await app[STATE].attach(llm)
    return client


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in a Prometheus exposition (0 when absent)."""
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" (\S+)"
    match = re.search(r"^" + pattern + r"$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def metric(client, name: str, labels: str = "") -> float:
    response = await client.get("/metrics")
    return metric_value(await response.text(), name, labels)


async def wait_for_metric(client, name: str, value: float, timeout_s: float = 10.0) -> float:
    """Poll ``/metrics`` until ``name`` equals ``value``; return the last value seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        seen = await metric(client, name)
        if seen == value or loop.time() > deadline:
            return seen
        await asyncio.sleep(0.02)


def model_name(client) -> str:
    return client.app[STATE].model_name
