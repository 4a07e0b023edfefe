"""vLLM's ``POST /reset_prefix_cache`` (a development endpoint, ``VLLM_SERVER_DEV_MODE=1``):
the cached blocks no running request holds are dropped, so the next repeat of a prompt
computes it again; without the variable the path is not served; with API keys it needs one."""

from __future__ import annotations

import json

import pytest
from _server_helpers import make_llm, model_name, start_app, stop_app

PROMPT = list(range(500, 540))  # 2 full blocks of 16 + 8 tokens


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


async def _complete(client, **extra) -> None:
    body = {"model": model_name(client), "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    response = await client.post("/v1/completions", json=body, **extra)
    assert response.status == 200, await response.text()


async def test_a_reset_drops_the_cached_blocks(aiohttp_client, llm, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    client = await start_app(aiohttp_client, llm)
    await _complete(client)
    assert llm.ledger.cached_blocks >= 2
    hits = llm.ledger.prefix_cache.hits
    await _complete(client)
    assert llm.ledger.prefix_cache.hits - hits == 32  # the repeat found both blocks
    cached = llm.ledger.cached_blocks
    response = await client.post("/reset_prefix_cache")
    assert response.status == 200
    assert (await response.json()) == {"dropped_blocks": cached}
    assert llm.ledger.cached_blocks == 0
    hits = llm.ledger.prefix_cache.hits
    await _complete(client)
    assert llm.ledger.prefix_cache.hits == hits  # computed again: nothing was found
    assert llm.ledger.reserved_blocks == 0


async def test_not_served_without_dev_mode_and_keyed_with_keys(aiohttp_client, llm,
                                                               monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    plain = await start_app(aiohttp_client, llm)
    assert (await plain.post("/reset_prefix_cache")).status == 404
    await stop_app(plain)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    keyed = await start_app(aiohttp_client, llm, api_keys=("sk-a",))
    assert (await keyed.post("/reset_prefix_cache")).status == 401
    response = await keyed.post("/reset_prefix_cache",
                                headers={"Authorization": "Bearer sk-a"})
    assert response.status == 200 and "dropped_blocks" in await response.json()


async def test_a_reset_leaves_a_running_requests_blocks_and_tokens_alone(aiohttp_client, llm,
                                                                        monkeypatch):
    """Another client's reset mid-stream: the running request keeps the cached blocks it
    pinned (they are not among those dropped) and ends with the tokens it has alone."""
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    client = await start_app(aiohttp_client, llm)
    body = {"model": model_name(client), "prompt": PROMPT, "max_tokens": 48,
            "temperature": 0, "ignore_eos": True}
    alone = await (await client.post("/v1/completions", json=body)).json()
    reserved_idle = llm.ledger.reserved_blocks
    response = await client.post("/v1/completions", json={**body, "stream": True})
    text, reset = "", None
    async for line in response.content:
        if not line.startswith(b"data: {"):
            continue
        text += json.loads(line[6:])["choices"][0]["text"]
        if reset is None:  # it runs, holding the two prompt blocks it found cached
            held, unheld = llm.ledger.reserved_blocks, llm.ledger.cached_blocks
            reset = await (await client.post("/reset_prefix_cache")).json()
            assert reset == {"dropped_blocks": unheld}  # only blocks nobody holds
            assert llm.ledger.reserved_blocks == held  # nothing it holds was taken
    assert text == alone["choices"][0]["text"]
    assert llm.ledger.reserved_blocks == reserved_idle == 0
