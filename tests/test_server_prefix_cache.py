"""The prefix cache as a server shows it: hits and queries on /metrics, the hit rate on
/v1/budget, and the same greedy answer whether a request hits or not."""

from __future__ import annotations

import pytest
from _server_helpers import make_llm, metric, model_name, start_app, wait_for_metric

SYSTEM = list(range(10, 10 + 96))  # six full 16-token blocks shared by both requests


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def llm_without_cache(tiny_llama_dir):
    return make_llm(tiny_llama_dir, enable_prefix_caching=False)


async def _complete(client, prompt: list[int]) -> dict:
    response = await client.post("/v1/completions", json={
        "model": model_name(client), "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})
    assert response.status == 200, await response.text()
    return await response.json()


async def test_a_shared_prompt_hits_and_the_server_says_so(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    hits_before = await metric(client, "kvledger_prefix_cache_hits_total")
    first = await _complete(client, [*SYSTEM, 1, 2, 3])
    second = await _complete(client, [*SYSTEM, 4, 5, 6])
    queried = await metric(client, "kvledger_prefix_cache_queries_total")
    hits = await metric(client, "kvledger_prefix_cache_hits_total") - hits_before
    assert hits == len(SYSTEM) and queried >= 2 * (len(SYSTEM) + 3)
    budget = await (await client.get("/v1/budget")).json()
    cache = budget["prefix_cache"]
    assert cache["enabled"] and cache["hits_tokens"] >= len(SYSTEM)
    assert 0 < cache["hit_rate"] <= 1 and cache["cached_blocks"] >= len(SYSTEM) // 16
    assert budget["pool"]["reserved_blocks"] == 0  # cached blocks are not reserved
    assert first["usage"]["completion_tokens"] == second["usage"]["completion_tokens"] == 8
    assert await wait_for_metric(client, "kvledger_kv_blocks_reserved", 0) == 0


async def test_hits_do_not_change_the_answer(aiohttp_client, llm, llm_without_cache):
    prompt = [*SYSTEM, 7, 8, 9]
    cached = await start_app(aiohttp_client, llm)
    await _complete(cached, [*SYSTEM, 99])           # fills the cache with SYSTEM's blocks
    with_hits = await _complete(cached, prompt)
    plain = await start_app(aiohttp_client, llm_without_cache)
    without = await _complete(plain, prompt)
    assert with_hits["choices"][0]["text"] == without["choices"][0]["text"]
    budget = await (await plain.get("/v1/budget")).json()
    assert budget["prefix_cache"] == {"enabled": False, "cached_blocks": 0,
                                      "queries_tokens": 0, "hits_tokens": 0,
                                      "hit_rate": None}
