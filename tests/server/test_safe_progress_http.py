"""Safe admission never stops the server, over HTTP: the LoRA deadlock this was built
against finishes, and a stall (forced here, since by design none happens) turns
``/health`` to 503 for Kubernetes to restart the pod, logs one ERROR line with the
ledger's state and shows in ``/metrics``."""

from __future__ import annotations

import asyncio
import logging

import pytest
from _lora_helpers import write_adapter
from _server_helpers import make_llm, metric, start_app, wait_for_metric

from kvledger.engine.core.stall import StallWatch
from kvledger.engine.server.state import STATE
from kvledger.engine.settings.lora_config import LoraModule


@pytest.fixture(scope="module")
def two_adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(root / name, tiny_llama_dir, seed=seed)
            for name, seed in (("a", 1), ("b", 2))}


async def test_another_adapters_request_after_a_pool_filling_one_does_not_stop_the_server(
        aiohttp_client, tiny_llama_dir, two_adapters):
    """One adapter slot (the default): r0 leaves its prompt's blocks cached under adapter
    a; r1 (adapter b) may fill the pool; r2 (adapter a, r0's prompt) arrives while r1 runs.
    Before, r2 was admitted over-committed, could never get the slot r1 held, and r1
    paused for the blocks r2 would free: nothing answered again. Now every request
    finishes, and so does one sent after them."""
    llm = make_llm(tiny_llama_dir, enable_lora=True, num_gpu_blocks_override=40,
                   block_size=16, max_model_len=640, max_num_seqs=4,
                   lora_modules=tuple(LoraModule(name, str(path))
                                      for name, path in two_adapters.items()))
    client = await start_app(aiohttp_client, llm)
    prompt_a = [(7 * i) % 900 + 20 for i in range(40)]

    async def complete(model, prompt, max_tokens):
        answer = await client.post("/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0})
        assert answer.status == 200, await answer.text()
        return (await answer.json())["usage"]["completion_tokens"]

    assert await complete("a", prompt_a, 1) == 1
    r1 = asyncio.create_task(complete("b", list(range(30, 50)), 620))
    await asyncio.sleep(0.3)
    r2 = asyncio.create_task(complete("a", prompt_a, 8))
    assert await asyncio.wait_for(asyncio.gather(r1, r2), 120) == [620, 8]
    assert await asyncio.wait_for(complete(llm.model_name, [3, 4, 5, 6], 4), 30) == 4
    assert llm.ledger.used_blocks == llm.ledger.reserved_blocks == 0
    assert (await client.get("/health")).status == 200
    assert await metric(client, "kvledger_engine_stalls_total") == 0


async def test_a_stalled_engine_fails_its_liveness_probe_and_says_why(
        aiohttp_client, tiny_llama_dir, caplog, monkeypatch):
    """The ledger refuses every draw (a stand-in for a bug): the request sits in the
    engine and nothing runs. After the watch's thresholds, one ERROR line names the
    ledger's state, /health and /ready answer 503 and kvledger_engine_stalled is 1; once
    draws are granted again the request finishes and /health is 200."""
    llm = make_llm(tiny_llama_dir)
    client = await start_app(aiohttp_client, llm)
    llm.stall_watch = StallWatch(min_steps=20, min_seconds=0.2)
    grow = llm.ledger.grow
    monkeypatch.setattr(llm.ledger, "grow", lambda reservation, num_tokens: len(
        reservation.block_ids) * llm.ledger.block_size)
    caplog.set_level(logging.ERROR, logger="kvledger.engine")
    request = asyncio.create_task(client.post("/v1/completions", json={
        "model": llm.model_name, "prompt": [3, 4, 5], "max_tokens": 4}))
    for _ in range(300):
        health = await client.get("/health")
        if health.status == 503:
            break
        await asyncio.sleep(0.02)
    assert health.status == 503
    body = await health.json()
    assert body["status"] == "engine_stalled" and "no request has progressed" in body["error"]
    assert (await client.get("/ready")).status == 503
    assert await metric(client, "kvledger_engine_stalled") == 1
    assert await metric(client, "kvledger_engine_stalls_total") == 1
    stalls = [r.getMessage() for r in caplog.records if "engine stalled" in r.getMessage()]
    assert len(stalls) == 1 and "1 requests run" in stalls[0] and "in use" in stalls[0]
    monkeypatch.setattr(llm.ledger, "grow", grow)
    llm.ledger.grow = grow
    answer = await asyncio.wait_for(request, 30)
    assert answer.status == 200
    assert (await client.get("/health")).status == 200
    assert await metric(client, "kvledger_engine_stalled") == 0


async def test_a_line_that_does_not_move_while_the_engine_is_idle_fails_the_probe(
        aiohttp_client, tiny_llama_dir, caplog, monkeypatch):
    """The ledger refuses every reservation (a stand-in for a bug: a lost wake-up, a grant
    that never reached the engine): one request waits in line, the engine holds nothing,
    and nothing would ever let it in. Before, /health stayed 200 for as long as that
    lasted; now, after the watch's thresholds, one ERROR line says so, /health and /ready
    are 503 and kvledger_line_stalled is 1, until the line moves again."""
    llm = make_llm(tiny_llama_dir)
    client = await start_app(aiohttp_client, llm)
    state = client.app[STATE]
    watch = state.door.line_watch
    watch.min_checks, watch.min_seconds, watch.interval_s = 3, 0.2, 0.05
    reserve = llm.ledger.try_reserve_each
    monkeypatch.setattr(llm.ledger, "try_reserve_each", lambda *args, **kwargs: None)
    caplog.set_level(logging.ERROR, logger="kvledger.engine")
    request = asyncio.create_task(client.post("/v1/completions", json={
        "model": llm.model_name, "prompt": [3, 4, 5], "max_tokens": 4}))
    assert await wait_for_metric(client, "kvledger_requests_waiting", 1) == 1
    for _ in range(500):
        health = await client.get("/health")
        if health.status == 503:
            break
        await asyncio.sleep(0.02)
    assert health.status == 503
    body = await health.json()
    assert body["status"] == "engine_stalled"
    assert body["error"].startswith("1 requests wait in line and none has been admitted for")
    assert (await client.get("/ready")).status == 503
    assert await metric(client, "kvledger_line_stalled") == 1
    assert await metric(client, "kvledger_line_stalls_total") == 1
    assert await metric(client, "kvledger_engine_stalled") == 0  # the engine holds nothing
    stalls = [r.getMessage() for r in caplog.records if "line stalled" in r.getMessage()]
    assert len(stalls) == 1 and "KV blocks of" in stalls[0]
    monkeypatch.setattr(llm.ledger, "try_reserve_each", reserve)
    state.door.admission.capacity_changed()  # the wake-up the bug lost
    assert (await asyncio.wait_for(request, 30)).status == 200
    assert await wait_for_metric(client, "kvledger_line_stalled", 0) == 0
    assert (await client.get("/health")).status == 200
