"""Completions' batched prompts (a list of strings or of token-id lists), as OpenAI and
vLLM answer them: choice ``prompt * n + j``, usage counting each prompt once. Each prompt
is admitted in turn and starts at once, so a batch never holds blocks idle while a later
prompt waits in line (two batches, each larger than the pool, both finish), and a later
prompt's refusal aborts the earlier ones and leaves the pool whole."""

from __future__ import annotations

import asyncio
import json

import pytest
from _server_helpers import make_llm, model_name, start_app

PROMPTS = ["Once upon a time there was", "The river ran past the mill and"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


async def _complete(client, **body):
    response = await client.post("/v1/completions", json={
        "model": model_name(client), "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        **body})
    return response.status, await response.json()


async def test_each_prompt_answered_as_alone_in_openai_order(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    alone = []
    for prompt in PROMPTS:
        status, body = await _complete(client, prompt=prompt, echo=True, logprobs=1)
        assert status == 200
        alone.append(body)
    status, batch = await _complete(client, prompt=PROMPTS, n=2, echo=True, logprobs=1)
    assert status == 200
    choices = batch["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for k, choice in enumerate(choices):  # choice k answers prompt k // n
        own = alone[k // 2]["choices"][0]
        assert choice["text"] == own["text"] and choice["text"].startswith(PROMPTS[k // 2])
        assert choice["logprobs"]["tokens"] == own["logprobs"]["tokens"]  # echoed prompt too
    usage = batch["usage"]  # each prompt counted once, each choice's tokens
    assert usage["prompt_tokens"] == sum(b["usage"]["prompt_tokens"] for b in alone)
    assert usage["completion_tokens"] == 4 * 4
    assert llm.ledger.reserved_blocks == 0


async def test_token_id_batches_and_streams(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    ids = [llm.tokenizer.encode(prompt) for prompt in PROMPTS]
    status, whole = await _complete(client, prompt=ids)
    assert status == 200 and len(whole["choices"]) == 2
    response = await client.post("/v1/completions", json={
        "model": model_name(client), "prompt": ids, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status == 200
    texts, finished, usage = ["", ""], [None, None], None
    for line in (await response.text()).splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[len("data: "):])
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
            finished[choice["index"]] = choice["finish_reason"] or finished[choice["index"]]
        usage = event.get("usage") or usage
    assert texts == [c["text"] for c in whole["choices"]]
    assert finished == ["length", "length"] and usage == whole["usage"]


async def test_a_batch_larger_than_the_pool_finishes_without_holding_blocks_idle(
        aiohttp_client, tiny_llama_dir):
    """Each prompt's promise takes most of the pool: one runs at a time. Had a batch
    reserved every prompt before starting any, two batches would each hold one prompt's
    blocks and wait forever for the other's."""
    llm = make_llm(tiny_llama_dir, num_gpu_blocks_override=16)
    client = await start_app(aiohttp_client, llm)  # waiters wait as long as it takes
    tokens = llm.ledger.num_blocks * llm.ledger.block_size
    cap = tokens * 2 // 3
    answers = await asyncio.wait_for(asyncio.gather(
        _complete(client, prompt=PROMPTS, max_tokens=cap),
        _complete(client, prompt=PROMPTS[::-1], max_tokens=cap)), timeout=120)
    for status, body in answers:
        assert status == 200 and [c["finish_reason"] for c in body["choices"]] == ["length"] * 2
        assert body["usage"]["completion_tokens"] == 2 * cap
    assert llm.ledger.reserved_blocks == 0 and llm.ledger.used_blocks == 0


async def test_a_later_prompt_refused_aborts_the_batch_and_leaves_the_pool_whole(
        aiohttp_client, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, num_gpu_blocks_override=16)
    client = await start_app(aiohttp_client, llm, max_queue_wait_s=0.0)
    cap = llm.ledger.num_blocks * llm.ledger.block_size * 2 // 3
    status, body = await _complete(client, prompt=PROMPTS, max_tokens=cap)
    assert status == 429 and body["error"]["code"] == "kv_cache_full"
    for _ in range(100):  # the first prompt, started, is aborted at the engine's next step
        if llm.ledger.reserved_blocks == 0 and llm.ledger.used_blocks == 0:
            break
        await asyncio.sleep(0.05)
    assert llm.ledger.reserved_blocks == 0 and llm.ledger.used_blocks == 0
    status, body = await _complete(client, prompt=PROMPTS[0], max_tokens=cap)
    assert status == 200  # nothing was lost


async def test_one_bad_prompt_refuses_the_batch_before_admission(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    status, body = await _complete(client, prompt=[PROMPTS[0], "word " * 400])
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    status, body = await _complete(client, prompt=[[1, 2], [1, llm.tokenizer.vocab_size + 5]])
    assert status == 400 and body["error"]["param"] == "prompt"
    assert llm.ledger.reserved_blocks == 0


async def test_the_openai_sdk_sends_a_batch(aiohttp_server, llm):
    from _server_helpers import start_sdk

    clients: list = []
    name, sdk = await start_sdk(aiohttp_server, llm, clients)
    try:
        answer = await sdk.completions.create(model=name, prompt=PROMPTS, max_tokens=3,
                                              temperature=0, extra_body={"ignore_eos": True})
    finally:
        for each in clients:
            await each.close()
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.usage.completion_tokens == 6


async def test_a_seeded_prompt_draws_the_same_tokens_in_a_batch_as_alone(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    body = {"temperature": 1.0, "seed": 7, "max_tokens": 6, "n": 2}
    status, batch = await _complete(client, prompt=PROMPTS, **body)
    assert status == 200
    for i, prompt in enumerate(PROMPTS):
        status, alone = await _complete(client, prompt=prompt, **body)
        assert [c["text"] for c in alone["choices"]] == \
            [c["text"] for c in batch["choices"][2 * i:2 * i + 2]]
