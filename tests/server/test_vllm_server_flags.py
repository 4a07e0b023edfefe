"""vLLM's serve flags that change what a server answers: --max-logprobs,
--return-tokens-as-token-ids, --enable-prompt-tokens-details, --enable-log-requests, and
the engine's --tokenizer."""

from __future__ import annotations

import logging
import shutil

import pytest
from _server_helpers import make_llm, model_name, start_app

from kvledger.engine.errors import BadInput


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


async def _complete(client, **body):
    response = await client.post("/v1/completions", json={
        "model": model_name(client), "prompt": "Once upon a time there was", "max_tokens": 2,
        **body})
    return response.status, await response.json()


async def test_max_logprobs_bounds_what_a_request_may_ask(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, max_logprobs=2)
    assert (await _complete(client, logprobs=2))[0] == 200
    status, body = await _complete(client, logprobs=3)
    assert status == 400 and body["error"]["param"] == "logprobs"
    assert "--max-logprobs" in body["error"]["message"]


async def test_server_wide_token_ids_and_cached_prompt_tokens(aiohttp_client, llm, caplog):
    client = await start_app(aiohttp_client, llm, return_tokens_as_token_ids=True,
                             prompt_tokens_details=True, log_requests=True)
    with caplog.at_level(logging.INFO, logger="kvledger.engine.server.openai_api"):
        status, first = await _complete(client, logprobs=1)
    assert status == 200
    assert all(t.startswith("token_id:") for t in first["choices"][0]["logprobs"]["tokens"])
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    logged = [r.message for r in caplog.records if r.message.startswith("request cmpl-")]
    assert len(logged) == 1 and "prompt tokens" in logged[0]
    assert "Once upon" not in logged[0]  # never the prompt's text
    # the same prompt again: its full blocks come from the prefix cache
    prompt = " ".join(["Once upon a time there was a river"] * 8)
    await _complete(client, prompt=prompt)
    status, again = await _complete(client, prompt=prompt)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < again["usage"]["prompt_tokens"]
    assert cached % llm.ledger.block_size == 0


async def test_without_the_flags_answers_are_unchanged(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    status, body = await _complete(client, logprobs=1)
    assert status == 200 and "prompt_tokens_details" not in body["usage"]
    assert not body["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")


def test_a_separate_tokenizer_folder(tiny_llama_dir, tmp_path):
    model, tokenizer = tmp_path / "model", tmp_path / "tokenizer"
    model.mkdir(), tokenizer.mkdir()
    for path in tiny_llama_dir.iterdir():
        into = tokenizer if path.name.startswith("tokenizer") else model
        shutil.copy(path, into / path.name)
    engine = make_llm(model, tokenizer=str(tokenizer))
    assert engine.tokenizer.encode("Once upon") == make_llm(tiny_llama_dir).tokenizer.encode(
        "Once upon")
    with pytest.raises(BadInput, match=r"no tokenizer\.json"):
        make_llm(model)
    with pytest.raises(BadInput, match="reads a tokenizer from a folder"):
        make_llm(tiny_llama_dir, tokenizer="Org/tokenizer-on-the-hub")


async def test_skip_special_tokens_false_keeps_their_text(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    special = llm.tokenizer.token_to_id("<|system|>")
    body = {"prompt": "Once upon", "max_tokens": 2, "logit_bias": {str(special): 100},
            "ignore_eos": True, "temperature": 0}
    status, kept = await _complete(client, skip_special_tokens=False, **body)
    assert status == 200 and kept["choices"][0]["text"] == "<|system|><|system|>"
    status, dropped = await _complete(client, **body)
    assert status == 200 and dropped["choices"][0]["text"] == ""


async def test_cached_prompt_tokens_never_tell_one_key_what_another_sent(aiohttp_client, llm):
    """usage.prompt_tokens_details.cached_tokens counts a key's own cached prompt only under
    --cache-salt-per-key: the same prompt sent under another key finds nothing cached, so
    the count cannot tell one tenant what another sent."""
    client = await start_app(aiohttp_client, llm, api_keys=("key-a", "key-b"),
                             salt_cache_per_key=True, prompt_tokens_details=True)
    prompt = " ".join(["A tenant's private system prompt, long enough for blocks"] * 6)

    async def cached(key):
        response = await client.post("/v1/completions", headers={
            "Authorization": f"Bearer {key}"}, json={
            "model": model_name(client), "prompt": prompt, "max_tokens": 1})
        assert response.status == 200
        return (await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await cached("key-a") == 0
    assert await cached("key-a") > 0      # its own prompt, cached
    assert await cached("key-b") == 0     # the same text under another key: nothing


async def test_spaces_between_special_tokens_is_a_request_field(aiohttp_client, llm):
    """vLLM's field reaches the detokenizer (whose rule tests/engine tests): accepted either
    way, text unchanged on a byte-level tokenizer, anything but a boolean a 400."""
    client = await start_app(aiohttp_client, llm)
    special = llm.tokenizer.token_to_id("<|system|>")
    body = {"prompt": "Once upon", "max_tokens": 2, "logit_bias": {str(special): 100},
            "ignore_eos": True, "temperature": 0, "skip_special_tokens": False}
    status, bare = await _complete(client, spaces_between_special_tokens=False, **body)
    assert status == 200 and bare["choices"][0]["text"] == "<|system|><|system|>"
    status, error = await _complete(client, spaces_between_special_tokens="no", **body)
    assert status == 400 and error["error"]["param"] == "spaces_between_special_tokens"
