"""Hostile ``POST /v1/responses`` bodies, generated: valid bodies the SDKs send, mutated at
random (a field's value swapped for junk of another type, deleted, duplicated, an unknown
field added, the JSON text itself cut or corrupted). Whatever arrives, the answer is a
200 in this API's shape or a 4xx with an OpenAI-style ``error`` object, never a 5xx or a
stream ending in an ``error`` event, and no KV reservation outlives its request.

KVLEDGER_FUZZ_EXAMPLES hunts harder (default 300, about 20 s on 2 cores);
KVLEDGER_FUZZ_SEED picks another sequence of bodies.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import re
from typing import Any

import pytest
from _server_helpers import make_llm, metric, model_name, start_app

from kvledger.engine.server.state import STATE

EXAMPLES = int(os.environ.get("KVLEDGER_FUZZ_EXAMPLES", "300"))
SEED = int(os.environ.get("KVLEDGER_FUZZ_SEED", "20250"))

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city"],
          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}
TOOL = {"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": True,
        "description": "Weather for a city."}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"}
# What the OpenAI SDK, the Agents SDK and LangChain send: each mutated from here.
BODIES: list[dict[str, Any]] = [
    {"input": "Once upon a time"},
    {"input": [{"role": "user", "content": "hi"}], "instructions": "Be brief.",
     "include": [], "stream": True},
    {"input": [{"role": "developer", "content": "French."},
               {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Weather?"}]},
               CALL, {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
               {"type": "reasoning", "id": "rs_1", "summary": [],
                "content": [{"type": "reasoning_text", "text": "Think."}]},
               {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress",
                "content": [{"type": "output_text", "text": "It is", "annotations": [],
                             "logprobs": []}]}],
     "tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": True},
    {"input": "Weather in Paris?", "tools": [TOOL], "stream": True,
     "tool_choice": {"type": "function", "name": "get_weather"}},
    {"input": "A city:", "text": {"format": {"type": "json_schema", "name": "city",
                                             "schema": SCHEMA, "strict": True}}},
    {"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2,
     "reasoning": {"effort": "low", "summary": "auto"}, "metadata": {"a": "b"},
     "store": False, "truncation": "disabled", "service_tier": "auto", "user": "u",
     "temperature": 0.5, "seed": 3, "stop": ["."], "stream_options": {
         "include_obfuscation": False}, "text": {"format": {"type": "json_object"}}},
]
FIELDS = ["input", "instructions", "max_output_tokens", "tools", "tool_choice", "text",
          "reasoning", "include", "top_logprobs", "metadata", "stream", "stream_options",
          "previous_response_id", "background", "prompt", "conversation", "request_id",
          "chat_template_kwargs", "structured_outputs", "logit_bias", "messages", "max_tokens",
          "type", "role", "content", "call_id", "output", "arguments", "name", "schema",
          "format", "effort", "status", "summary", "text", "id", "parameters", "strict"]
WORDS = ["message", "function_call", "function_call_output", "reasoning", "input_text",
         "output_text", "refusal", "summary_text", "reasoning_text", "json_schema",
         "json_object", "text", "function", "web_search", "auto", "none", "required",
         "in_progress", "incomplete", "completed", "user", "assistant", "system", "developer",
         "tool", "high", "max", "call_1", "get_weather", "{", "{}", "[]", "null", "", " ",
         "\x00", "\ud800", "é\u2028", "<|im_start|>", "<tool_call>", "x" * 5000]


def _junk(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 4 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**63, -(2**63) - 1, 10**40])
    if kind == 3:
        return rng.choice([0.5, -0.0, 1e308, 1e-308])
    if kind in (4, 5, 6, 7):
        return rng.choice(WORDS)
    if kind in (8, 9):
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice(FIELDS): _junk(rng, depth + 1) for _ in range(rng.randrange(4))}


def _paths(value: Any, path: tuple = ()) -> list[tuple]:
    """Every place in ``value``: dict keys and list indexes, depth first."""
    out = [path]
    if isinstance(value, dict):
        for key, child in value.items():
            out += _paths(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            out += _paths(child, (*path, index))
    return out


def _mutate(body: Any, rng: random.Random) -> Any:
    path = rng.choice(_paths(body))
    if not path:
        return body if rng.random() < 0.9 else _junk(rng)
    parent = body
    for part in path[:-1]:
        parent = parent[part]
    key, op = path[-1], rng.randrange(6)
    if op == 0:
        del parent[key]
    elif op == 1 and isinstance(parent, list):
        parent[key:key] = [copy.deepcopy(parent[key])] * rng.choice([1, 2, 40])
    elif op == 2 and isinstance(parent, dict):
        parent[rng.choice(FIELDS)] = _junk(rng)
    elif op == 3:
        parent[key] = [parent[key]] if rng.random() < 0.5 else {"type": parent[key]}
    else:
        parent[key] = _junk(rng)
    return body


def _raw(body: Any, rng: random.Random) -> bytes:
    """The body's JSON, now and then cut short or with a byte corrupted."""
    raw = json.dumps(body).encode()
    roll = rng.random()
    if roll < 0.03:
        return raw[:rng.randrange(len(raw))]
    if roll < 0.06:
        at = rng.randrange(len(raw))
        return raw[:at] + bytes([rng.choice([0x00, 0x22, 0x5C, 0xFF, 0x7B, 0x5D])]) + raw[at + 1:]
    return raw


def _body(rng: random.Random, model: str) -> bytes:
    body = {"model": model, **copy.deepcopy(rng.choice(BODIES))}
    for _ in range(rng.choice([1, 1, 2, 3])):
        body = _mutate(body, rng)
    if isinstance(body, dict) and "max_output_tokens" not in body:
        body["max_output_tokens"] = rng.choice([1, 2, 4])  # keep each generation short
    return _raw(body, rng)


def _check_answer(status: int, content_type: str, text: str, sent: bytes) -> None:
    where = f"status {status} for {sent[:300]!r}: {text[:300]}"
    assert status == 200 or 400 <= status < 500, where
    if status != 200:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"], where
        assert error["type"] and error["code"], where
        # A refusal names a field the body holds (or lacks), never the chat field it became.
        if error["param"] and not error["message"].startswith("missing required field"):
            assert re.split(r"[.\[]", error["param"])[0] in json.loads(sent), where
        return
    if content_type.startswith("text/event-stream"):
        blocks = text.strip().split("\n\n")
        events = [json.loads(block.split("data: ", 1)[1]) for block in blocks]
        assert [e["sequence_number"] for e in events] == list(range(len(events))), where
        assert events[-1]["type"] == "response.completed", where
    else:
        answer = json.loads(text)
        assert answer["object"] == "response", where
        assert answer["status"] in ("completed", "incomplete"), where


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_model_len=256, num_gpu_blocks_override=32)


async def test_mutated_bodies_are_answered_or_refused_and_hold_nothing(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, enable_auto_tool_choice=True,
                             tool_call_parser="hermes")
    ledger = client.app[STATE].door.engine.ledger
    rng = random.Random(SEED)
    statuses: dict[int, int] = {}
    for _ in range(EXAMPLES):
        sent = _body(rng, model_name(client))
        response = await client.post("/v1/responses", data=sent,
                                     headers={"Content-Type": "application/json"})
        text = await response.text()
        _check_answer(response.status, response.headers["Content-Type"], text, sent)
        statuses[response.status] = statuses.get(response.status, 0) + 1
        for _ in range(100):  # the last reservation goes back as its request ends
            if ledger.reserved_blocks == 0:
                break
            await asyncio.sleep(0.01)
        assert ledger.reserved_blocks == 0, sent[:300]
    assert await metric(client, "kvledger_requests_failed_total",
                        'reason="internal_error"') == 0
    # The bodies reach the model, not only the parser: some are answered, some refused.
    assert statuses.get(200, 0) >= EXAMPLES // 20 and statuses.get(400, 0) >= EXAMPLES // 4
