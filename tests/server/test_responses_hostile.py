"""``POST /v1/responses`` as a hostile tenant sends it: each refusal names the field the
body holds (never the chat field it would have been, never a whole item for one part's
missing text), ``metadata`` within OpenAI's limits (it is echoed in every response
object), and an id echoed in a 404 cut to one short line."""

from __future__ import annotations

import pytest
from _server_helpers import make_llm, model_name, start_app

from kvledger.engine.server.api_errors import ApiError
from kvledger.engine.server.responses_fields import (
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
)
from kvledger.engine.server.responses_request import parse_responses


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_model_len=256, num_gpu_blocks_override=32)


async def _error(client, body: dict, status: int = 400) -> dict:
    response = await client.post("/v1/responses", json={"model": model_name(client), **body})
    assert response.status == status, await response.text()
    return (await response.json())["error"]


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 3), ("max_completion_tokens", 3), ("messages", []),
    ("response_format", {"type": "json_object"}), ("reasoning_effort", "low"),
    ("logprobs", True),
])
async def test_a_chat_field_sent_here_is_unknown_by_its_own_name(aiohttp_client, llm, field,
                                                                 value):
    """Chat's names are not this API's: the body's own field is named, not renamed to the
    Responses field a chat refusal would stand for ("unknown field 'max_output_tokens'"
    told a client its valid field was unknown)."""
    client = await start_app(aiohttp_client, llm)
    error = await _error(client, {"input": "hi", field: value})
    assert error["param"] == field
    assert error["message"] == f"unknown field '{field}': this server does not implement it"


async def test_the_doors_refusals_still_name_this_apis_fields(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    error = await _error(client, {"input": "hi", "max_output_tokens": 1000})
    assert error["param"] == "max_output_tokens" and "max_tokens" not in error["message"]
    error = await _error(client, {"input": "hello " * 300})
    assert error["param"] == "input" and error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("item, param", [
    ({"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text"}]},
     "input[1].content[1].text"),
    ({"role": "assistant", "content": [{"type": "refusal", "text": "no"}]},
     "input[1].content[0].refusal"),
    ({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text"}]},
     "input[1].output[0].text"),
])
def test_a_part_without_its_text_is_named_to_the_field(item, param):
    with pytest.raises(ApiError) as refused:
        parse_responses({"input": [{"role": "user", "content": "hi"}, item]})
    assert refused.value.status == 400 and refused.value.param == param


def test_metadata_within_openais_limits():
    most = {f"{i:0{MAX_METADATA_KEY_CHARS}d}": "v" * MAX_METADATA_VALUE_CHARS
            for i in range(MAX_METADATA_PAIRS)}
    assert parse_responses({"input": "hi", "metadata": most}).responses.metadata == most
    for metadata, words in (
            ({**most, "one more": ""}, f"at most {MAX_METADATA_PAIRS}"),
            ({"k" * (MAX_METADATA_KEY_CHARS + 1): ""}, "key 'kkkk"),
            ({"k": "v" * (MAX_METADATA_VALUE_CHARS + 1)}, "value of 'k'")):
        with pytest.raises(ApiError) as refused:
            parse_responses({"input": "hi", "metadata": metadata})
        assert refused.value.param == "metadata" and words in refused.value.message
    with pytest.raises(ApiError) as refused:  # the type's own error, as before
        parse_responses({"input": "hi", "metadata": {"a": 1}})
    assert refused.value.param == "metadata.a"


async def test_an_id_echoed_in_a_404_is_cut_short(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    error = await _error(client, {"input": "hi", "previous_response_id": "r" * 100_000}, 404)
    assert error["param"] == "previous_response_id" and len(error["message"]) < 300
    response = await client.get("/v1/responses/" + "r" * 4000)
    assert response.status == 404
    assert len((await response.json())["error"]["message"]) < 300


async def test_another_keys_cache_and_requests_change_nothing_of_a_tenants(aiohttp_client,
                                                                           llm):
    """Two keys, the cache salted per key: the second key sending the first's input finds
    none of its blocks (``cached_tokens`` 0, so it learns nothing of what the first sent),
    and each key's answers, alone or side by side with the other's, are its own greedy
    tokens."""
    import asyncio

    client = await start_app(aiohttp_client, llm, api_keys=("key-a", "key-b"),
                             salt_cache_per_key=True, prompt_tokens_details=True)
    body = {"model": model_name(client), "input": "the sky is blue because " * 8,
            "max_output_tokens": 8, "temperature": 0}

    async def ask(key: str) -> dict:
        response = await client.post("/v1/responses", json=body,
                                     headers={"Authorization": f"Bearer {key}"})
        assert response.status == 200, await response.text()
        return await response.json()

    def cached(answer: dict) -> int:
        return answer["usage"]["input_tokens_details"]["cached_tokens"]

    first = await ask("key-a")
    assert cached(await ask("key-a")) > 0  # its own blocks, found again
    other = await ask("key-b")
    assert cached(other) == 0
    side_by_side = await asyncio.gather(ask("key-a"), ask("key-b"))
    texts = {a["output"][0]["content"][0]["text"] for a in (first, other, *side_by_side)}
    assert len(texts) == 1
    assert llm.ledger.reserved_blocks == 0
