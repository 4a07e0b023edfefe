"""Fair share wherever a request waits (issue 52): one API key's flood delays another key's
request by about one turn whether the bottleneck is the KV blocks (shared in tokens, not
requests), the seats (``--max-num-seqs``), the adapter slots (``--max-loras``) or the
step's prompt tokens (``--max-num-batched-tokens``). Each test fails on the engine that was
fair at admission only, in requests."""

from __future__ import annotations

import asyncio

import pytest
from _lora_helpers import write_adapter
from _server_helpers import make_llm, model_name, start_app, wait_for_metric

from kvledger.engine.settings.lora_config import LoraModule

KEYS = ("key-a", "key-b")


async def _send(client, key, finished, name, **body):
    body = {"model": model_name(client), "prompt": "Once upon a time", "max_tokens": 40,
            "ignore_eos": True, "temperature": 0, **body}
    response = await client.post("/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"})
    assert response.status == 200, await response.text()
    finished.append(name)


async def test_seats_another_keys_request_waits_one_turn(aiohttp_client, tiny_llama_dir):
    """Seats run out first (a pool of 256 blocks, 2 seats): before, key B's request was
    admitted at once and then waited for a seat behind all of key A's."""
    llm = make_llm(tiny_llama_dir, max_num_seqs=2, num_gpu_blocks_override=256)
    client = await start_app(aiohttp_client, llm, api_keys=KEYS)
    finished: list[str] = []
    flood = [asyncio.create_task(_send(client, "key-a", finished, f"a{i}")) for i in range(8)]
    await wait_for_metric(client, "kvledger_requests_running", 8)  # all admitted
    await _send(client, "key-b", finished, "b")
    await asyncio.gather(*flood)
    assert finished.index("b") <= 3, finished  # after the two seated and one tagged before


async def test_blocks_are_shared_in_tokens_not_requests(aiohttp_client, tiny_llama_dir):
    """Key A's requests reserve 10 blocks each, key B's one: under equal weights B's ten
    are granted before A's next one (before, they took turns request for request). Each
    request holds its blocks whole (``--admission reserve``): the blocks are the limit."""
    llm = make_llm(tiny_llama_dir, num_gpu_blocks_override=16, admission="reserve")
    client = await start_app(aiohttp_client, llm, api_keys=KEYS)
    finished: list[str] = []
    big = [asyncio.create_task(_send(client, "key-a", finished, f"a{i}", max_tokens=150))
           for i in range(3)]
    await wait_for_metric(client, "kvledger_requests_waiting", 2)  # a0 runs, a1 a2 wait
    small = [asyncio.create_task(_send(client, "key-b", finished, f"b{i}", max_tokens=10))
             for i in range(10)]
    await asyncio.gather(*big, *small)
    last_b = max(finished.index(f"b{i}") for i in range(10))
    assert last_b < finished.index("a1"), finished


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fair-adapters")
    return {name: write_adapter(root / name, tiny_llama_dir, seed=seed)
            for name, seed in (("sql", 1), ("chat", 2))}


async def test_adapter_slots_another_keys_adapter_waits_for_the_running_ones(
        aiohttp_client, tiny_llama_dir, adapters):
    """One slot, four seats: key A's requests on one adapter kept the slot for as long as
    they came, and key B's request on another adapter waited for all of them."""
    llm = make_llm(tiny_llama_dir, enable_lora=True, max_loras=1, max_cpu_loras=2,
                   max_num_seqs=4, num_gpu_blocks_override=256, served_model_name="base",
                   lora_modules=(LoraModule("sql", str(adapters["sql"])),
                                 LoraModule("chat", str(adapters["chat"]))))
    client = await start_app(aiohttp_client, llm, api_keys=KEYS)
    finished: list[str] = []
    flood = [asyncio.create_task(_send(client, "key-a", finished, f"a{i}", model="sql"))
             for i in range(12)]
    await wait_for_metric(client, "kvledger_requests_running", 12)
    await _send(client, "key-b", finished, "b", model="chat")
    await asyncio.gather(*flood)
    assert finished.index("b") <= 5, finished  # after the four running, and one more


async def test_prompt_tokens_a_short_prompt_is_not_held_behind_long_ones(aiohttp_client,
                                                                         tiny_llama_dir):
    """16 prompt tokens a step: key A's six prompts of 240 tokens started first and took the
    whole budget, step after step (90 steps), before key B's prompt of 8 got any."""
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=16, num_gpu_blocks_override=256)
    client = await start_app(aiohttp_client, llm, api_keys=KEYS)
    finished: list[str] = []
    long_prompt = list(range(10, 250))
    flood = [asyncio.create_task(_send(client, "key-a", finished, f"a{i}",
                                       prompt=long_prompt[i:] + long_prompt[:i], max_tokens=4))
             for i in range(6)]
    await wait_for_metric(client, "kvledger_requests_running", 6)
    await _send(client, "key-b", finished, "b", prompt=list(range(300, 308)), max_tokens=4)
    await asyncio.gather(*flood)
    assert finished.index("b") <= 1, finished
