"""Prefix caching is exact: greedy tokens with the cache on equal the cache off and
transformers' for prompts that share none, some or all of their blocks, across chunked
prefill and block sizes; a repeated prefix is computed once, its hits counted; cached
blocks are evicted only under pressure, least recently released first; prompt logprobs
stay exact; and an idle pool holds nothing but cached blocks."""

from __future__ import annotations

import random

import pytest
from _engine_helpers import DEVICE, evictions, hf_greedy

from kvledger.engine import LLM, SamplingParams
from kvledger.engine.core.engine import LLMEngine
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make_engine(model_dir, **flags) -> LLMEngine:
    flags = {"max_model_len": 128, "max_num_seqs": 4, "device": DEVICE, **flags}
    return LLMEngine.from_config(EngineConfig(model=str(model_dir), **flags))


def run(engine: LLMEngine, prompts: dict[str, list[int]], params=GREEDY) -> dict:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        final.update((out.request_id, out) for out in engine.step() if out.finished)
    return final


def assert_idle(engine: LLMEngine) -> None:
    """Nothing reserved or in use; what is left is cached (evictable) or free."""
    ledger = engine.ledger
    assert (ledger.reserved_blocks, ledger.used_blocks) == (0, 0)
    assert ledger.free_blocks == ledger.num_blocks


def _prompts(vocab: int, block_size: int) -> dict[str, list[int]]:
    """A shared prefix of 3.5 blocks and prompts sharing all, some or none of it."""
    rng = random.Random(block_size)
    words = lambda n: [rng.randrange(2, vocab) for _ in range(n)]  # noqa: E731
    prefix = words(block_size * 3 + block_size // 2)
    return {
        "whole": prefix,                                        # every full block cached
        "longer": prefix + words(block_size + 3),               # the prefix, then its own
        "some": prefix[:block_size + 1] + words(2 * block_size),  # only the first block
        "none": words(3 * block_size + 5),
        "exact": prefix[:3 * block_size],                       # full blocks only: last one recomputed
    }


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> dict:
    """transformers' greedy tokens for every block size's prompts, computed once."""
    cache = {}

    def tokens(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            cache[key] = hf_greedy(str(tiny_llama_dir), prompt, GREEDY.max_tokens)
        return cache[key]

    return tokens


@pytest.mark.parametrize("block_size,batched_tokens", [(4, 10), (16, 2048), (16, 24)])
def test_greedy_tokens_equal_the_cache_off_and_transformers(tiny_llama_dir, reference, block_size,
                                                            batched_tokens):
    flags = {"block_size": block_size, "max_num_batched_tokens": batched_tokens}
    on = make_engine(tiny_llama_dir, **flags)
    off = make_engine(tiny_llama_dir, enable_prefix_caching=False, **flags)
    prompts = _prompts(on.runner.config.vocab_size, block_size)
    # The same requests on both engines: a warm-up, then every prompt twice.
    run(off, {"warm": prompts["whole"]})
    expected = {rid: out.token_ids for rid, out in run(off, prompts).items()}
    assert expected == {rid: reference(prompt) for rid, prompt in prompts.items()}
    assert {rid: out.token_ids for rid, out in run(off, prompts).items()} == expected
    total = sum(map(len, prompts.values()))
    assert off.num_prefill_tokens == len(prompts["whole"]) + 2 * total  # computes every token
    assert off.ledger.cached_blocks == 0 and off.ledger.prefix_cache.hits == 0

    # The full blocks each prompt finds cached (never the one holding its last token).
    # First time: the warm-up's 3 blocks of the prefix for "whole" and "longer", the first
    # one for "some", 2 for "exact" (its third holds its last token), none for "none".
    first_hits = 3 + 3 + 1 + 0 + 2
    # Sent again, every prompt finds all of its own full blocks before its last token.
    again_hits = sum((len(prompt) - 1) // block_size for prompt in prompts.values())

    run(on, {"warm": prompts["whole"]})                         # caches the shared prefix
    assert (on.num_prefill_tokens, on.ledger.prefix_cache.hits) == (len(prompts["whole"]), 0)
    first = run(on, prompts)                                    # hits: all, some or none
    assert on.ledger.prefix_cache.hits == first_hits * block_size
    again = run(on, prompts)                                    # hits their own blocks too
    assert {rid: out.token_ids for rid, out in first.items()} == expected
    assert {rid: out.token_ids for rid, out in again.items()} == expected
    hits = (first_hits + again_hits) * block_size
    assert on.ledger.prefix_cache.hits == hits and evictions(on.ledger) == 0
    # Exactly the cached tokens were not computed: the cache off computed them all.
    assert on.num_prefill_tokens == off.num_prefill_tokens - hits
    assert_idle(on)
    assert on.ledger.cached_blocks > 0


def test_a_repeated_prompt_computes_only_its_uncached_tail_and_counts_its_hits(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)                        # blocks of 16 tokens
    prompt = list(range(7, 57))                                 # 50 tokens: 3 full blocks
    first = run(engine, {"a": prompt})["a"]
    assert engine.num_prefill_tokens == 50
    ledger = engine.ledger
    assert (ledger.prefix_cache.queries, ledger.prefix_cache.hits) == (50, 0)
    second = run(engine, {"b": prompt})["b"]
    assert engine.num_prefill_tokens == 50 + 2                  # 48 tokens came from the cache
    assert (ledger.prefix_cache.queries, ledger.prefix_cache.hits) == (100, 48)
    assert second.token_ids == first.token_ids
    # A prompt of exactly 3 blocks recomputes its last one: its logits give the first token.
    run(engine, {"c": prompt[:48]})
    assert engine.num_prefill_tokens == 52 + 16
    assert_idle(engine)


def test_requests_admitted_together_hit_what_the_first_computed_when_they_start(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=1, num_gpu_blocks_override=16)
    prompt = list(range(60, 110))                               # 50 tokens: 3 full blocks
    final = run(engine, {f"r{i}": prompt for i in range(3)})    # admitted before any ran
    assert engine.num_prefill_tokens == 50 + 2 + 2
    assert engine.ledger.prefix_cache.hits == 2 * 48
    assert len({tuple(out.token_ids) for out in final.values()}) == 1
    assert_idle(engine)


def test_a_resent_conversation_hits_the_blocks_of_the_reply(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = list(range(100, 120))                              # 1 full block
    reply = run(engine, {"turn-1": prompt}, SamplingParams(temperature=0, max_tokens=30,
                                                            ignore_eos=True))["turn-1"]
    history = prompt + reply.token_ids + [5, 6, 7]              # 53 tokens
    hits_before = engine.ledger.prefix_cache.hits
    second = run(engine, {"turn-2": history})["turn-2"]
    # 49 of the 50 tokens turn 1 computed are in 3 full blocks, two of them the reply's.
    assert engine.ledger.prefix_cache.hits - hits_before == 48
    off = make_engine(tiny_llama_dir, enable_prefix_caching=False)
    assert second.token_ids == run(off, {"turn-2": history})["turn-2"].token_ids


def test_cached_blocks_are_evicted_only_under_pressure_least_recently_released_first(
        tiny_llama_dir):
    flags = {"max_model_len": 64, "block_size": 8, "num_gpu_blocks_override": 12}
    engine = make_engine(tiny_llama_dir, **flags)
    off = make_engine(tiny_llama_dir, enable_prefix_caching=False, **flags)
    ledger = engine.ledger
    old, new = [11] * 24 + [1], [12] * 24 + [2]                 # 3 full blocks each
    one_token = SamplingParams(temperature=0, max_tokens=1)
    tokens = {}

    def both(request_id: str, prompt: list[int]) -> None:
        """Run on the engine and on the cache off; the same greedy token."""
        tokens[request_id] = run(engine, {request_id: prompt}, one_token)[request_id].token_ids
        assert tokens[request_id] == run(off, {request_id: prompt}, one_token)[request_id].token_ids

    both("old", old)
    both("new", new)
    assert (ledger.cached_blocks, evictions(ledger)) == (6, 0)
    both("filler", [13] * 40)                                   # 5 blocks: the 6 free ones first
    assert evictions(ledger) == 0
    both("pressure", [14] * 32)                                 # 4 blocks: 1 free, 3 evicted
    assert evictions(ledger) == 3
    hits = ledger.prefix_cache.hits
    both("new-again", new)
    assert ledger.prefix_cache.hits - hits == 24                # the recent one survived
    both("old-again", old)                                      # recomputed in evicted blocks
    assert ledger.prefix_cache.hits - hits == 24                # the old one was evicted
    assert tokens["new-again"] == tokens["new"] and tokens["old-again"] == tokens["old"]
    assert evictions(off.ledger) == 0 and off.ledger.prefix_cache.hits == 0
    assert_idle(engine)


def test_greedy_tokens_under_eviction_churn_equal_the_cache_off(tiny_llama_dir):
    """A pool too small to keep what it caches: waves of requests evict blocks earlier waves
    cached while they hit others (system prompts, re-sent conversations and their replies);
    every request's greedy tokens equal those of the same requests with the cache off."""
    flags = {"max_model_len": 64, "block_size": 4, "num_gpu_blocks_override": 16,
             "max_num_seqs": 2}
    on = make_engine(tiny_llama_dir, **flags)
    off = make_engine(tiny_llama_dir, enable_prefix_caching=False, **flags)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    rng = random.Random(0)
    words = lambda n: [rng.randrange(2, on.runner.config.vocab_size) for _ in range(n)]  # noqa: E731
    systems = [words(10) for _ in range(3)]                     # 2 full blocks each, and 2 tokens
    hits_after_evictions, previous = 0, None
    for n in range(8):
        # A system prompt's question, and the conversation of the wave before re-sent
        # with its reply (at most 6 + 9 blocks: the cache off fits them in the pool too).
        wave = {f"w{n}-ask": systems[n % 3] + words(rng.randrange(2, 7))}
        if previous is None:
            wave[f"w{n}-ask-too"] = systems[1] + words(3)
        else:
            wave[f"w{n}-chat"] = previous + words(2)
        evicted, hits = evictions(on.ledger), on.ledger.prefix_cache.hits
        got = {rid: out.token_ids for rid, out in run(on, wave, params).items()}
        assert got == {rid: out.token_ids for rid, out in run(off, wave, params).items()}, wave
        if evicted:
            hits_after_evictions += on.ledger.prefix_cache.hits - hits
        previous = wave[f"w{n}-ask"] + got[f"w{n}-ask"]
    assert evictions(on.ledger) >= 20 and hits_after_evictions >= 100  # real churn, real hits
    assert on.num_prefill_tokens == off.num_prefill_tokens - on.ledger.prefix_cache.hits
    assert evictions(off.ledger) == 0
    assert_idle(on)


def test_prompt_logprobs_are_exact_with_the_cache_on(tiny_llama_dir):
    echo = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, ignore_eos=True)
    prompt = list(range(30, 70))
    off = run(make_engine(tiny_llama_dir, enable_prefix_caching=False), {"e": prompt}, echo)["e"]
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=16)
    run(engine, {"warm": prompt})
    on = run(engine, {"e": prompt}, echo)["e"]                  # takes no hits: needs every position
    assert on.token_ids == off.token_ids
    assert len(on.prompt_logprobs) == len(prompt)
    for got, want in zip(on.prompt_logprobs[1:], off.prompt_logprobs[1:], strict=True):
        assert (got.token_id, got.rank) == (want.token_id, want.rank)
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
    assert engine.ledger.prefix_cache.queries == len(prompt)    # the echo did not query
    assert engine.num_prefill_tokens == 2 * len(prompt)
    assert_idle(engine)


def test_choices_pin_the_same_cached_blocks_and_decode_alike(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = list(range(200, 240))                              # 2 full blocks
    alone = run(engine, {"first": prompt})["first"].token_ids
    ledger = engine.ledger
    choices = ledger.try_reserve_each(len(prompt) + GREEDY.max_tokens, 3, prompt)
    assert [r.block_ids for r in choices] == [choices[0].block_ids] * 3
    assert ledger.used_blocks == 2                              # shared: counted once
    for i, reservation in enumerate(choices):
        engine.add_request(f"choice-{i}", prompt, GREEDY, reservation=reservation)
    final = run(engine, {})
    assert [final[f"choice-{i}"].token_ids for i in range(3)] == [alone] * 3
    assert_idle(engine)


def test_a_reservation_must_fit_its_prompt_and_its_use_of_the_cache(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = list(range(300, 340))
    run(engine, {"warm": prompt})
    other = engine.ledger.try_reserve(60, list(range(400, 440)))
    with pytest.raises(BadInput, match="another prompt"):
        engine.add_request("mismatch", prompt, GREEDY, reservation=other)
    cached = engine.ledger.try_reserve(60, prompt)
    assert cached.num_cached_blocks == 2
    with pytest.raises(BadInput, match="prompt_logprobs"):
        engine.add_request("echo", prompt, SamplingParams(max_tokens=4, prompt_logprobs=1),
                           reservation=cached)
    assert other.released and cached.released                  # refused: given back
    assert_idle(engine)


async def test_the_server_admits_with_the_prompt_so_a_repeat_hits(aiohttp_client, tiny_llama_dir):
    from _server_helpers import make_llm, model_name, start_app

    llm = make_llm(tiny_llama_dir)                              # blocks of 16 tokens
    client = await start_app(aiohttp_client, llm)
    prompt = list(range(500, 540))                              # 2 full blocks + 8 tokens
    body = {"model": model_name(client), "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    first = await (await client.post("/v1/completions", json=body)).json()
    hits = llm.ledger.prefix_cache.hits
    second = await (await client.post("/v1/completions", json={**body, "n": 2})).json()
    assert llm.ledger.prefix_cache.hits - hits == 2 * 32        # each choice pinned both
    assert [c["text"] for c in second["choices"]] == [first["choices"][0]["text"]] * 2
    echo = await (await client.post("/v1/completions", json={**body, "echo": True,
                                                             "logprobs": 1})).json()
    assert llm.ledger.prefix_cache.hits - hits == 2 * 32        # echo needs every position
    assert echo["choices"][0]["text"].endswith(first["choices"][0]["text"])


def test_llm_takes_the_flag(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_model_len=64, device=DEVICE, enable_prefix_caching=False)
    assert not llm.engine.ledger.prefix_cache.enabled
    assert "--no-enable-prefix-caching" in llm.engine.config.to_flags()
