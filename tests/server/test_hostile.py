"""Hostile clients, round two, over HTTP: structured outputs cannot take time or memory
from others or cause a 500; the prefix cache can be salted per request (``cache_salt``)
and per API key, several keys open the API, and /metrics can have a key of its own;
``n`` choices share their prompt's blocks."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
from _engine_helpers import heavy_schema
from _server_helpers import make_llm, metric, start_app, stop_app

from kvledger.engine.commands.serve import _api_keys, add_arguments
from kvledger.engine.settings.declare import values_from_args
from kvledger.engine.settings.launch_line import with_config
from kvledger.engine.settings.serve_config import ServeConfig

HITS = "kvledger_prefix_cache_hits_total"
FAILED = "kvledger_requests_failed_total"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_num_seqs=8, num_gpu_blocks_override=64,
                    max_model_len=512, served_model_name="tiny-llama")


def _body(**fields) -> dict:
    return {"model": "tiny-llama", "max_tokens": 4, "temperature": 0, **fields}


async def _post(client, path: str, body: dict, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = await client.post(path, json=body, headers=headers)
    return response.status, await response.json()


# -- structured outputs -------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "loop", "schema": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}),
    ("guided_regex", "[^\\x00-\\x{10FFFF}]"),
], ids=["ref-cycle", "empty-class"])
async def test_a_grammar_no_output_can_satisfy_is_a_400_not_a_500(aiohttp_client, llm, field,
                                                                   value, caplog):
    client = await start_app(aiohttp_client, llm)
    failed = await metric(client, FAILED, 'reason="request_error"')
    with caplog.at_level(logging.WARNING):
        status, body = await _post(client, "/v1/completions", _body(prompt="x", **{field: value}))
    assert status == 400 and body["error"]["param"] == field
    assert "allows no output" in body["error"]["message"]
    assert await metric(client, FAILED, 'reason="request_error"') == failed
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_grammar_text_that_spells_a_special_token_is_a_400_or_a_dead_end(aiohttp_client,
                                                                                  llm, caplog):
    """A regex whose text the tokenizer turns into a special token: at the start, a 400
    naming it; after some text, a 200 that ends there with "grammar". Never a 500."""
    client = await start_app(aiohttp_client, llm)
    failed = await metric(client, FAILED, 'reason="request_error"')
    with caplog.at_level(logging.WARNING):
        status, body = await _post(client, "/v1/completions", _body(
            prompt="x", guided_regex="<\\|user\\|>hi"))
        assert status == 400 and "'<|user|>', a special token" in body["error"]["message"]
        status, body = await _post(client, "/v1/completions", _body(
            prompt="x", max_tokens=8, guided_regex="hi<\\|user\\|>"))
    assert status == 200, body
    assert body["choices"][0]["text"] == "hi" and body["choices"][0]["finish_reason"] == "grammar"
    assert await metric(client, FAILED, 'reason="request_error"') == failed
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_schema_over_the_compile_time_limit_is_a_400_naming_it(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, grammar_compile_timeout_s=0.2)
    status, body = await _post(client, "/v1/completions", _body(
        prompt="x", guided_json=heavy_schema(1)))
    assert status == 400 and body["error"]["param"] == "guided_json"
    assert "--grammar-compile-timeout" in body["error"]["message"]


async def test_heavy_compiles_never_hold_up_cached_or_plain_requests(aiohttp_client, llm):
    """Distinct heavy schemas compile on the compiler's own threads: a request whose
    grammar is cached, and one with none, are answered while they are still compiling."""
    client = await start_app(aiohttp_client, llm, grammar_compile_timeout_s=60.0)
    json_object = _body(prompt="{", response_format={"type": "json_object"})
    assert (await _post(client, "/v1/completions", json_object))[0] == 200  # now cached
    done: dict[str, float] = {}

    async def timed(name: str, body: dict) -> int:
        status, answer = await _post(client, "/v1/completions", body)
        done[name] = time.monotonic()
        if status == 200:  # a grammar past the library's parser limits ends as "grammar"
            assert answer["choices"][0]["finish_reason"] in ("stop", "length", "grammar")
        return status

    heavy = [asyncio.create_task(timed(f"heavy{i}", _body(prompt="x", max_tokens=1,
                                                             guided_json=heavy_schema(10 + i))))
             for i in range(3)]
    await asyncio.sleep(0.1)  # the compiles have started
    assert await timed("cached", json_object) == 200
    # A 12 KiB body: parsed on the preparation threads, which compiles never occupy.
    assert await timed("plain", _body(prompt="hello", user="u" * 12_000)) == 200
    assert [await task for task in heavy] == [200, 200, 200]
    first_heavy = min(done[f"heavy{i}"] for i in range(3))
    assert done["cached"] < first_heavy and done["plain"] < first_heavy, done


# -- the prefix cache across tenants -------------------------------------------------------


PROMPT = list(range(5, 5 + 160))  # 10 full blocks


async def _hits_after(client, key: str | None = None, **fields) -> float:
    before = await metric(client, HITS)
    status, body = await _post(client, "/v1/completions", _body(prompt=PROMPT, **fields), key)
    assert status == 200, body
    return await metric(client, HITS) - before


async def test_cache_salt_keeps_prefixes_apart(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    assert await _hits_after(client, cache_salt="tenant-a-" + "x" * 40) == 0   # computed
    assert await _hits_after(client, cache_salt="tenant-a-" + "x" * 40) == 144  # 9 blocks hit
    assert await _hits_after(client, cache_salt="tenant-b-" + "y" * 40) == 0   # another salt
    assert await _hits_after(client) == 0                                      # unsalted
    status, body = await _post(client, "/v1/completions", _body(prompt="x", cache_salt=""))
    assert status == 400 and body["error"]["param"] == "cache_salt"


async def test_several_api_keys_and_a_cache_salted_per_key(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, api_keys=("key-a", "key-b"),
                             salt_cache_per_key=True)
    assert (await _post(client, "/v1/completions", _body(prompt="x"), "key-c"))[0] == 401
    salt = {"cache_salt": "same-salt-for-both"}
    assert await _hits_after(client, "key-a", **salt) == 0
    assert await _hits_after(client, "key-a", **salt) == 144
    # Another key's client sending the very same prompt and salt finds nothing.
    assert await _hits_after(client, "key-b", **salt) == 0
    assert await _hits_after(client, "key-b", **salt) == 144


async def test_metrics_can_have_a_key_of_its_own(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, api_keys=("tenant",),
                             metrics_api_key="scraper")
    assert (await client.get("/metrics")).status == 401
    tenant = await client.get("/metrics", headers={"Authorization": "Bearer tenant"})
    assert tenant.status == 401  # a tenant's key cannot read the cache's counters
    scraper = await client.get("/metrics", headers={"Authorization": "Bearer scraper"})
    assert scraper.status == 200 and HITS in await scraper.text()
    # /v1/budget's live figures are the same counters: the scraper's too (before, any
    # tenant watched another's prompt sizes and cache hits there)
    tenant = await client.get("/v1/budget", headers={"Authorization": "Bearer tenant"})
    assert tenant.status == 401
    scraper = await client.get("/v1/budget", headers={"Authorization": "Bearer scraper"})
    assert scraper.status == 200 and "hits_tokens" in (await scraper.json())["prefix_cache"]
    await stop_app(client)
    open_client = await start_app(aiohttp_client, llm, api_keys=("tenant",))
    assert (await open_client.get("/metrics")).status == 200  # open by default
    budget = await open_client.get("/v1/budget", headers={"Authorization": "Bearer tenant"})
    assert budget.status == 200  # without a metrics key, the API keys' as before


def test_api_keys_from_flags_the_environment_and_a_file(tmp_path, monkeypatch):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def serving(*argv: str) -> ServeConfig:  # as serve's main reads its flags
        argv = tuple(with_config(["--model", "m", *argv], parser))
        return ServeConfig(**values_from_args(parser.parse_args(argv),
                                              ServeConfig))

    keys = tmp_path / "keys"
    keys.write_text("# team keys\nkey-c\n\n  key-d  \nkey-a\n")
    args = serving("--api-key", "key-a", "key-b", "--api-key-file", str(keys))
    assert _api_keys(args) == ("key-a", "key-b", "key-c", "key-d")
    # vLLM's rule: a later --api-key replaces an earlier one (a rotated key stops working)
    assert _api_keys(serving("--api-key", "old", "--api-key", "new")) == ("new",)
    rotated = tmp_path / "serve.yaml"
    rotated.write_text("api-key: [old]\n")  # the command line's key replaces the file's
    assert _api_keys(serving("--config", str(rotated), "--api-key", "new")) == ("new",)
    monkeypatch.setenv("KVLEDGER_API_KEY", "from-env")
    assert _api_keys(serving()) == ("from-env",)
    monkeypatch.delenv("KVLEDGER_API_KEY")
    monkeypatch.setenv("VLLM_API_KEY", "vllms")  # before: ignored, the server open to all
    assert _api_keys(serving()) == ("vllms",)
    assert _api_keys(serving("--api-key", "x", "y")) == ("x", "y")
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    from kvledger.engine.errors import BadInput

    with pytest.raises(BadInput, match="holds no key"):
        _api_keys(serving("--api-key-file", str(empty)))


# -- n choices ------------------------------------------------------------------------------


async def test_n_choices_share_the_prompts_blocks(aiohttp_client, tiny_llama_dir):
    """190 prompt tokens + 5 each: 13 blocks a choice, 65 for five without sharing; a pool
    of 30 holds them sharing the prompt's 11 full blocks."""
    llm = make_llm(tiny_llama_dir, num_gpu_blocks_override=30, max_model_len=256,
                   enable_prefix_caching=False, served_model_name="tiny-llama")
    client = await start_app(aiohttp_client, llm)
    status, body = await _post(client, "/v1/completions", _body(
        prompt=list(range(5, 195)), n=5, max_tokens=5, temperature=0.8, seed=1,
        ignore_eos=True))
    assert status == 200, body
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2, 3, 4]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert llm.ledger.reserved_blocks == 0
    status, body = await _post(client, "/v1/completions", _body(
        prompt=list(range(5, 195)), n=5, max_tokens=5, echo=True, logprobs=1))
    # Echoed prompt logprobs need every choice to compute the prompt: nothing shared.
    assert status == 400 and "65 KV blocks" in json.dumps(body)
