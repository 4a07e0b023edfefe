"""Tenants over HTTP: the admission line takes turns between API keys, one key's flood
fills only its own places in line (429 tenant_queue_full, for it alone), a full line says
queue_full, and vLLM's ``priority`` orders the line under --scheduling-policy priority
(a 400 under fcfs, as vLLM documents)."""

from __future__ import annotations

import asyncio

import pytest
from _server_helpers import make_llm, model_name, start_app, wait_for_metric


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # 16 blocks of 16: each request below (8 + 150 tokens, 10 blocks) runs alone
    return make_llm(tiny_llama_dir, num_gpu_blocks_override=16)


def _headers(key):
    return {"Authorization": f"Bearer {key}"}


async def _send(client, key, finished, name, **body):
    response = await client.post("/v1/completions", headers=_headers(key), json={
        "model": model_name(client), "prompt": "Once upon a time", "max_tokens": 150,
        "ignore_eos": True, "temperature": 0, **body})
    finished.append(name)
    return response.status, await response.json(), response.headers


async def _flood_then_one(client, flood_key, other_key, other_body=None):
    finished: list[str] = []
    flood = [asyncio.create_task(_send(client, flood_key, finished, f"a{i}"))
             for i in range(5)]
    await wait_for_metric(client, "kvledger_requests_waiting", 4)  # a0 runs
    other = asyncio.create_task(_send(client, other_key, finished, "b", **(other_body or {})))
    await wait_for_metric(client, "kvledger_requests_waiting", 5)
    results = await asyncio.gather(*flood, other)
    assert all(status == 200 for status, _, _ in results), results
    return finished


async def test_another_keys_request_waits_one_admission_not_the_flood(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, api_keys=("key-a", "key-b"))
    finished = await _flood_then_one(client, "key-a", "key-b")
    assert finished.index("b") <= 2  # after a0 (running) and at most the one tagged before it


async def test_without_fairness_the_flood_goes_first(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, api_keys=("key-a", "key-b"),
                             tenant_fairness=False)
    finished = await _flood_then_one(client, "key-a", "key-b")
    assert finished[-1] == "b"


async def test_priority_goes_first_under_the_priority_policy(aiohttp_client, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, num_gpu_blocks_override=16, scheduling_policy="priority")
    client = await start_app(aiohttp_client, llm)
    finished = await _flood_then_one(client, "k", "k", {"priority": -1})
    assert finished.index("b") == 1  # the next to start once a0 ends


async def test_a_keys_flood_fills_its_own_places_only(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, api_keys=("key-a", "key-b"),
                             max_queue_len=4)  # two places in line for each key
    finished: list[str] = []
    flood = [asyncio.create_task(_send(client, "key-a", finished, f"a{i}")) for i in range(3)]
    await wait_for_metric(client, "kvledger_requests_waiting", 2)
    status, body, headers = await _send(client, "key-a", finished, "a3")
    assert status == 429 and body["error"]["code"] == "tenant_queue_full"
    assert "key-0" in body["error"]["message"] and "key-a" not in body["error"]["message"]
    assert float(headers["Retry-After"]) > 0
    theirs = [asyncio.create_task(_send(client, "key-b", finished, f"b{i}")) for i in range(2)]
    await wait_for_metric(client, "kvledger_requests_waiting", 4)  # B got its two places
    status, body, _ = await _send(client, "key-b", finished, "b2")
    assert status == 429 and body["error"]["code"] == "queue_full"  # now the line is full
    results = await asyncio.gather(*flood, *theirs)
    assert all(status == 200 for status, _, _ in results)


async def test_a_full_line_says_queue_full(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, max_queue_len=1)
    finished: list[str] = []
    first = [asyncio.create_task(_send(client, "k", finished, f"r{i}")) for i in range(2)]
    await wait_for_metric(client, "kvledger_requests_waiting", 1)
    status, body, _ = await _send(client, "k", finished, "r2")
    assert status == 429 and body["error"]["code"] == "queue_full"
    assert "--max-queue-len 1" in body["error"]["message"]
    assert all(r[0] == 200 for r in await asyncio.gather(*first))


async def test_priority_under_fcfs_is_a_400(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    status, body, _ = await _send(client, "k", [], "r", priority=3, max_tokens=1)
    assert status == 400 and body["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in body["error"]["message"]
    status, _, _ = await _send(client, "k", [], "r", priority=0, max_tokens=1)
    assert status == 200


async def _first_token_while_the_flood_runs(client, urgent_body):
    """Fill the engine's seats with best-effort requests (400 tokens each), one more
    waiting for a seat, then send a short one: whether its first token arrives before any
    best-effort request ends (none was preempted for it)."""
    ended: list[float] = []
    loop = asyncio.get_running_loop()

    async def best_effort(i):
        status, _, _ = await _send(client, "k", [], f"b{i}", max_tokens=400, priority=10)
        ended.append(loop.time())
        assert status == 200

    flood = [asyncio.create_task(best_effort(i)) for i in range(4)]
    await wait_for_metric(client, "kvledger_requests_running", 4)  # all admitted
    response = await client.post("/v1/completions", json={
        "model": model_name(client), "prompt": "Once upon a time", "max_tokens": 8,
        "ignore_eos": True, "temperature": 0, "stream": True, **urgent_body})
    assert response.status == 200
    await response.content.readline()  # the first event: its first token
    first_token = loop.time()
    await response.read()
    await asyncio.gather(*flood)
    return first_token < min(ended)


async def test_headroom_seats_an_urgent_request_while_best_effort_ones_run(
        aiohttp_client, tiny_llama_dir):
    """Four seats, one kept: three best-effort requests run, a fourth waits for a seat;
    the urgent one is seated at the next step. Without the headroom it waits for a
    best-effort request to end (400 steps)."""
    llm = make_llm(tiny_llama_dir, num_gpu_blocks_override=256, max_num_seqs=4,
                   max_model_len=512, scheduling_policy="priority", priority_headroom=0.25)
    client = await start_app(aiohttp_client, llm)
    assert await _first_token_while_the_flood_runs(client, {"priority": 0})
    assert llm.ledger.reserved_blocks == 0
