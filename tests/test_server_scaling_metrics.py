"""The series autoscalers and routers read: the reserved ratio, the waiting and running
requests (also under vLLM's names, for the Gateway API Inference Extension's endpoint
picker), and the kv_cache_full rejections, exported at 0 before the first one."""

from __future__ import annotations

import asyncio
import time

import pytest
from _server_helpers import make_llm, model_name, start_app
from prometheus_client.parser import text_string_to_metric_families

from kvledger.engine.server.metrics import VLLM_ALIASES
from kvledger.engine.server.state import STATE


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


async def _samples(client) -> dict[tuple[str, frozenset], float]:
    """Every sample of one scrape, parsed as Prometheus parses it: ``(name, labels) -> value``."""
    text = await (await client.get("/metrics")).text()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def _settled(client, name: str, value: float, timeout_s: float = 10.0) -> dict:
    """The first scrape in which ``name`` (unlabelled) equals ``value``, else the last one."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = await _samples(client)
        if samples.get((name, frozenset())) == value or time.monotonic() > deadline:
            return samples
        await asyncio.sleep(0.02)


def _vllm(samples: dict, alias: str, client) -> float | None:
    return samples.get((alias, frozenset({("model_name", model_name(client))})))


def _assert_aliases_agree(samples: dict, client) -> None:
    for alias, name in VLLM_ALIASES.items():
        assert _vllm(samples, alias, client) == samples[(name, frozenset())], alias


async def test_reserved_ratio_is_reserved_over_total_blocks(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    ledger = client.app[STATE].llm.ledger
    assert (await _settled(client, "kvledger_kv_blocks_reserved", 0))[
        ("kvledger_kv_reserved_ratio", frozenset())] == 0.0
    held = ledger.try_reserve(ledger.block_size * (ledger.num_blocks // 4))
    try:
        samples = await _samples(client)
        ratio = samples[("kvledger_kv_reserved_ratio", frozenset())]
        assert ratio == ledger.reserved_blocks / ledger.num_blocks == 0.25
        assert _vllm(samples, "vllm:kv_cache_usage_perc", client) == 0.25
        assert _vllm(samples, "vllm:gpu_cache_usage_perc", client) == 0.25
        _assert_aliases_agree(samples, client)
    finally:
        ledger.release(held)
    assert (await _settled(client, "kvledger_kv_reserved_ratio", 0.0))[
        ("kvledger_kv_reserved_ratio", frozenset())] == 0.0


async def test_a_queued_request_counts_as_waiting(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, max_queue_wait_s=5.0)
    state = client.app[STATE]
    ledger = state.llm.ledger
    held = ledger.try_reserve(ledger.num_blocks * ledger.block_size)
    request = asyncio.create_task(client.post("/v1/completions", json={
        "model": model_name(client), "prompt": "x", "max_tokens": 2}))
    try:
        samples = await _settled(client, "kvledger_requests_waiting", 1)
        assert samples[("kvledger_requests_waiting", frozenset())] == 1
        assert samples[("kvledger_queue_length", frozenset())] == 1  # the older name
        assert samples[("kvledger_kv_reserved_ratio", frozenset())] == 1.0
        assert _vllm(samples, "vllm:num_requests_waiting", client) == 1
        _assert_aliases_agree(samples, client)
    finally:
        ledger.release(held)
        state.admission.capacity_changed()  # what the engine's next step would do
    assert (await request).status == 200
    samples = await _settled(client, "kvledger_requests_waiting", 0)
    assert _vllm(samples, "vllm:num_requests_waiting", client) == 0


async def test_a_running_request_counts_as_running(aiohttp_client, llm, monkeypatch):
    execute = llm.runner.execute

    def slow(batch):  # each step >= 10 ms: 100 tokens run for over a second
        time.sleep(0.01)
        return execute(batch)

    monkeypatch.setattr(llm.runner, "execute", slow)
    client = await start_app(aiohttp_client, llm)
    ledger = client.app[STATE].llm.ledger
    response = await client.post("/v1/completions", json={
        "model": model_name(client), "prompt": "Tell me a story", "max_tokens": 100,
        "ignore_eos": True, "stream": True})
    assert response.status == 200
    await response.content.readuntil(b"\n\n")  # the first chunk: it is running
    samples = await _samples(client)
    assert samples[("kvledger_requests_running", frozenset())] == 1
    assert _vllm(samples, "vllm:num_requests_running", client) == 1
    # The reservation is prompt + cap, whole, from admission on.
    assert samples[("kvledger_kv_reserved_ratio", frozenset())] == (
        ledger.reserved_blocks / ledger.num_blocks) > 0
    _assert_aliases_agree(samples, client)
    await response.read()
    samples = await _settled(client, "kvledger_requests_running", 0)
    assert _vllm(samples, "vllm:num_requests_running", client) == 0


async def test_kv_cache_full_is_exported_at_zero_and_counts_each_429(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    full = ("kvledger_requests_rejected_total", frozenset({("reason", "kv_cache_full")}))
    assert (await _samples(client))[full] == 0  # present before any rejection
    ledger = client.app[STATE].llm.ledger
    held = ledger.try_reserve(ledger.num_blocks * ledger.block_size)
    try:
        response = await client.post("/v1/completions", json={
            "model": model_name(client), "prompt": "x", "max_tokens": 2})
        assert response.status == 429
        assert (await response.json())["error"]["code"] == "kv_cache_full"
    finally:
        ledger.release(held)
    assert (await _samples(client))[full] == 1


async def test_the_vllm_names_wait_for_a_model(aiohttp_client):
    from kvledger.engine.server.app import build_app

    client = await aiohttp_client(build_app())
    samples = await _samples(client)
    assert samples[("kvledger_kv_reserved_ratio", frozenset())] == 0
    assert samples[("kvledger_requests_waiting", frozenset())] == 0
    assert not any(name.startswith("vllm:") for name, _ in samples)  # no model_name yet
