"""The series autoscalers and routers read: the reserved ratio, the waiting and running
requests (also under vLLM's names, for the Gateway API Inference Extension's endpoint
picker), and the kv_cache_full rejections, exported at 0 before the first one."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from _server_helpers import fill_pool, make_llm, model_name, start_app
from prometheus_client.parser import text_string_to_metric_families

from kvledger.engine.server.metrics import VLLM_ALIASES
from kvledger.engine.server.state import STATE

POOL_BLOCKS, BLOCK = 32, 16  # make_llm's pool


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


class _HeldEngine:
    """Holds the engine's forward passes until ``release()``: admitted requests stay
    admitted (running, their blocks reserved) for as long as the test looks at them."""

    def __init__(self, llm, monkeypatch) -> None:
        self._go = threading.Event()
        execute = llm.runner.execute

        def held(batch):
            self._go.wait(60)
            return execute(batch)

        monkeypatch.setattr(llm.runner, "execute", held)

    def release(self) -> None:
        self._go.set()


def _post_ids(client, prompt_ids: list[int], max_tokens: int) -> asyncio.Task:
    """A completion of a prompt of known token ids, in flight as a task."""
    return asyncio.create_task(client.post("/v1/completions", json={
        "model": model_name(client), "prompt": prompt_ids, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True}))


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
    return samples.get((alias, frozenset({("model_name", model_name(client)), ("engine", "0")})))


def _assert_aliases_agree(samples: dict, client) -> None:
    for alias, name in VLLM_ALIASES.items():
        # A counter's samples end in _total, a gauge's are its name.
        total = "_total" if (name + "_total", frozenset()) in samples else ""
        assert _vllm(samples, alias + total, client) == samples[(name + total, frozenset())], alias


async def test_reserved_ratio_is_reserved_over_total_blocks(aiohttp_client, llm, monkeypatch):
    client = await start_app(aiohttp_client, llm)
    idle = await _settled(client, "kvledger_kv_blocks_reserved", 0)
    assert idle[("kvledger_kv_blocks_total", frozenset())] == POOL_BLOCKS
    assert idle[("kvledger_kv_reserved_ratio", frozenset())] == 0.0
    engine = _HeldEngine(llm, monkeypatch)
    # prompt + max_tokens: 10 + 54 = 64 tokens = 4 blocks; 40 + 40 = 80 tokens = 5 blocks.
    # The prompts share no block, so nothing is shared: 9 of the pool's 32 blocks.
    requests = [_post_ids(client, list(range(100, 110)), 54),
                _post_ids(client, list(range(200, 240)), 40)]
    try:
        samples = await _settled(client, "kvledger_requests_running", 2)
        assert samples[("kvledger_requests_running", frozenset())] == 2
        assert samples[("kvledger_kv_blocks_reserved", frozenset())] == 4 + 5
        assert samples[("kvledger_kv_reserved_ratio", frozenset())] == 9 / 32
        assert _vllm(samples, "vllm:kv_cache_usage_perc", client) == 9 / 32
        assert _vllm(samples, "vllm:gpu_cache_usage_perc", client) == 9 / 32
        _assert_aliases_agree(samples, client)
    finally:
        engine.release()
        responses = await asyncio.gather(*requests)
    assert [r.status for r in responses] == [200, 200]
    samples = await _settled(client, "kvledger_kv_reserved_ratio", 0.0)
    assert samples[("kvledger_kv_reserved_ratio", frozenset())] == 0.0
    assert samples[("kvledger_kv_blocks_reserved", frozenset())] == 0


async def test_queued_requests_count_as_waiting(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, max_queue_wait_s=5.0)
    state = client.app[STATE]
    ledger = llm.ledger  # the engine the test holds; the server reads it only through its door
    held = fill_pool(ledger)  # the whole pool: both requests queue
    requests = [_post_ids(client, [7, 8], 2), _post_ids(client, [9, 10], 2)]
    try:
        samples = await _settled(client, "kvledger_requests_waiting", 2)
        assert samples[("kvledger_requests_waiting", frozenset())] == 2
        assert samples[("kvledger_queue_length", frozenset())] == 2  # the older name
        assert samples[("kvledger_requests_running", frozenset())] == 0
        assert samples[("kvledger_kv_reserved_ratio", frozenset())] == 1.0
        assert _vllm(samples, "vllm:num_requests_waiting", client) == 2
        _assert_aliases_agree(samples, client)
    finally:
        ledger.release(held)
        state.door.admission.capacity_changed()  # what the engine's next step would do
    assert [(await r).status for r in requests] == [200, 200]
    samples = await _settled(client, "kvledger_requests_waiting", 0)
    assert _vllm(samples, "vllm:num_requests_waiting", client) == 0


async def test_a_running_request_counts_as_running(aiohttp_client, llm, monkeypatch):
    client = await start_app(aiohttp_client, llm)
    engine = _HeldEngine(llm, monkeypatch)
    # The reservation is prompt + cap, whole, from admission on: 20 + 100 tokens = 8 blocks.
    request = _post_ids(client, list(range(300, 320)), 100)
    try:
        samples = await _settled(client, "kvledger_requests_running", 1)
        assert samples[("kvledger_requests_running", frozenset())] == 1
        assert _vllm(samples, "vllm:num_requests_running", client) == 1
        assert samples[("kvledger_requests_waiting", frozenset())] == 0
        assert samples[("kvledger_kv_blocks_reserved", frozenset())] == 8
        assert samples[("kvledger_kv_reserved_ratio", frozenset())] == 8 / 32
        _assert_aliases_agree(samples, client)
    finally:
        engine.release()
        response = await request
    assert response.status == 200
    assert (await response.json())["usage"]["completion_tokens"] == 100
    samples = await _settled(client, "kvledger_requests_running", 0)
    assert _vllm(samples, "vllm:num_requests_running", client) == 0
    assert samples[("kvledger_kv_reserved_ratio", frozenset())] == 0.0


async def test_kv_cache_full_is_exported_at_zero_and_counts_each_429(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, max_queue_len=0)  # refused at once
    full = ("kvledger_requests_rejected_total", frozenset({("reason", "kv_cache_full")}))
    assert (await _samples(client))[full] == 0  # present before any rejection
    ledger = client.app[STATE].door.engine.ledger
    held = fill_pool(ledger)
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
