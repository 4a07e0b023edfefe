"""The prefix cache as a server shows it: hits and queries on /metrics, the hit rate on
/v1/budget, and the same greedy answer whether a request hits or not.

Each test serves an engine of its own and sends prompts no other test sends, so what it
counts is what its own requests did, whichever tests ran before it."""

from __future__ import annotations

import pytest
from _server_helpers import make_llm, metric, model_name, start_app, wait_for_metric

BLOCK = 16  # make_llm's block size


def _system(first_id: int) -> list[int]:
    """A 96-token system prompt: six full blocks, shared by the requests that start with it."""
    return list(range(first_id, first_id + 6 * BLOCK))


@pytest.fixture
def llm(tiny_llama_dir):
    """A fresh engine for each test: an empty cache and counters at zero."""
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


async def _counters(client) -> tuple[float, float]:
    """(queried tokens, hit tokens) so far, as /metrics exports them."""
    return (await metric(client, "kvledger_prefix_cache_queries_total"),
            await metric(client, "kvledger_prefix_cache_hits_total"))


async def test_a_shared_prompt_hits_and_the_server_says_so(aiohttp_client, llm):
    system = _system(10)
    client = await start_app(aiohttp_client, llm)
    queried, hit = await _counters(client)              # the warm-up's lookups, if any
    assert hit == 0
    first = await _complete(client, [*system, 1, 2, 3])  # 99 tokens: computes all six blocks
    assert await _counters(client) == (queried + 99, 0)
    second = await _complete(client, [*system, 4, 5, 6])  # finds the six blocks cached
    assert await _counters(client) == (queried + 2 * 99, 6 * BLOCK)
    budget = await (await client.get("/v1/budget")).json()
    cache = budget["prefix_cache"]
    assert cache["enabled"]
    assert (cache["queries_tokens"], cache["hits_tokens"]) == (queried + 2 * 99, 6 * BLOCK)
    assert cache["hit_rate"] == pytest.approx(6 * BLOCK / (queried + 2 * 99))
    # The six system blocks, once: neither request fills a seventh (99 + 7 tokens computed),
    # nor does the warm-up's few tokens fill one.
    assert cache["cached_blocks"] == 6
    assert budget["pool"]["reserved_blocks"] == 0  # cached blocks are not reserved
    assert first["usage"]["completion_tokens"] == second["usage"]["completion_tokens"] == 8
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] == 99
    assert await wait_for_metric(client, "kvledger_kv_blocks_reserved", 0) == 0


async def test_hits_do_not_change_the_answer(aiohttp_client, llm, llm_without_cache):
    system = _system(700)
    prompt = [*system, 7, 8, 9]
    cached = await start_app(aiohttp_client, llm)
    await _complete(cached, [*system, 99])               # fills the cache with the system's blocks
    _, hits_before = await _counters(cached)
    with_hits = await _complete(cached, prompt)
    _, hits_after = await _counters(cached)
    assert hits_after - hits_before == 6 * BLOCK         # the answer below came from a hit
    plain = await start_app(aiohttp_client, llm_without_cache)
    without = await _complete(plain, prompt)
    assert with_hits["choices"][0]["text"] == without["choices"][0]["text"]
    budget = await (await plain.get("/v1/budget")).json()
    assert budget["prefix_cache"] == {"enabled": False, "cached_blocks": 0,
                                      "queries_tokens": 0, "hits_tokens": 0,
                                      "hit_rate": None}
