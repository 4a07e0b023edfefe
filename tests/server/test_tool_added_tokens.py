"""Tool calls on the tokens models really use: Qwen2.5/Qwen3 and Hermes checkpoints carry
``<tool_call>`` and ``</tool_call>`` as added tokens that are NOT special. A grammar
library takes every added token for a special one, which a string literal may never
produce: the call grammar names the markers as those tokens, so ``tool_choice:
"required"``, a named function and ``parallel_tool_calls: false`` work on such a
tokenizer, while plain constrained text still never turns into one of them."""

from __future__ import annotations

import json

import pytest
from _server_helpers import make_llm, model_name, start_app, with_added_tokens

MARKERS = ["<tool_call>", "</tool_call>"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen_like_dir(tiny_llama_dir, tmp_path_factory):
    """tiny-llama with its tokenizer trained again, the two markers then added as Qwen's
    tokenizer holds them (``add_tokens``, special false); the built-in template is
    Qwen2.5's hermes tool format. The vocabulary keeps its size, so the weights fit."""
    out = with_added_tokens(tiny_llama_dir, tmp_path_factory.mktemp("qwen-like") / "model",
                            MARKERS)
    saved = json.loads((out / "tokenizer.json").read_text())
    added = {t["content"]: t["special"] for t in saved["added_tokens"]}
    assert added["<tool_call>"] is False and added["</tool_call>"] is False
    return out


async def test_required_named_and_single_calls_on_added_non_special_tokens(
        aiohttp_client, qwen_like_dir):
    llm = make_llm(qwen_like_dir, max_model_len=1024, num_gpu_blocks_override=256)
    client = await start_app(aiohttp_client, llm)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, parallel in (("required", True), (named, True), ("required", False)):
        response = await client.post("/v1/chat/completions", json={
            "model": model_name(client), "messages": ASK, "tools": TOOLS,
            "tool_choice": choice, "parallel_tool_calls": parallel, "max_tokens": 120,
            "seed": 0})
        answer = await response.json()
        assert response.status == 200, answer
        message = answer["choices"][0]["message"]
        # OpenAI's and vLLM's: a function the request named finishes "stop"
        assert answer["choices"][0]["finish_reason"] == ("stop" if choice is named
                                                         else "tool_calls")
        assert message["tool_calls"] and all(
            c["function"]["name"] == "get_weather" for c in message["tool_calls"])
        for call in message["tool_calls"]:
            assert "city" in json.loads(call["function"]["arguments"])
        if not parallel:
            assert len(message["tool_calls"]) == 1
    # Plain constrained text never produces the markers: a regex that starts with one is
    # refused as before (it would have to be that token).
    response = await client.post("/v1/chat/completions", json={
        "model": model_name(client), "messages": ASK, "max_tokens": 4,
        "structured_outputs": {"regex": "<tool_call>x"}})
    assert response.status == 400
