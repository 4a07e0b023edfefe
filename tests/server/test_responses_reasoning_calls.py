"""A Responses request that must call a tool, on a model that reasons (``--reasoning-parser
qwen3``): the call grammar applies once the reasoning ends (Qwen3's ``<tool_call>`` ends it
and is the call's first token), so the answer is a reasoning item, then a
``function_call`` item with arguments valid against the tool's schema, streamed as the
same items."""

from __future__ import annotations

import json

import pytest
from _server_helpers import model_name, start_app, stop_app
from test_reasoning_http import qwen_llm  # noqa: F401 (fixture)
from test_responses_reasoning_stream import _kinds, _unnamed, _whole_and_streamed

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"], "additionalProperties": False}}]


# seeds whose reasoning runs a few tokens before one call (the bias opens some at once)
@pytest.mark.parametrize("seed", [0, 6, 9])
async def test_reasoning_then_a_required_call(aiohttp_client, qwen_llm, seed):  # noqa: F811
    client = await start_app(aiohttp_client, qwen_llm, reasoning_parser="qwen3")
    opening = str(qwen_llm.tokenizer.token_to_id("<tool_call>"))
    body = {"model": model_name(client), "input": "Weather in Paris?", "tools": TOOLS,
            "tool_choice": "required", "max_output_tokens": 100, "temperature": 1.0,
            "seed": seed, "logit_bias": {opening: 6}}
    whole, events = await _whole_and_streamed(client, body)
    assert [item["type"] for item in whole["output"]] == ["reasoning", "function_call"], whole
    call = whole["output"][1]
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"])["city"] in ("Paris", "Rome")
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    final = events[-1][1]["response"]
    # the same items, their ids aside (each answer draws its own call_id)
    assert [{k: v for k, v in item.items() if k != "call_id"} for item in _unnamed(
        final["output"])] == [{k: v for k, v in item.items() if k != "call_id"}
                              for item in _unnamed(whole["output"])]
    kinds = _kinds(events)
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.function_call_arguments.done")
    arguments = "".join(d["delta"] for k, d in events
                        if k == "response.function_call_arguments.delta")
    assert arguments == call["arguments"]
    await stop_app(client)
