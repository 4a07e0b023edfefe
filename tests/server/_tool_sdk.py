"""A tool-call format end to end through the OpenAI SDK, as each parser's tests run it: a
tiny checkpoint whose tokenizer holds the format's markers as tokens (``marker_llm``),
``tool_choice`` required and a named function answered whole and streamed alike, every
call a declared function whose arguments validate, and the answer's first token the
format's own marker (``required_round_trip``, ``named_round_trip``)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import jsonschema
from _server_helpers import make_llm, with_added_tokens
from test_tool_calls_sdk import ASK, SCHEMAS, TOOLS, _streamed

VLLM_ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{16}$")


def read_whole(scanner, text: str) -> tuple[str, list[tuple[str, str]]]:
    """``text`` fed to ``scanner`` as a whole answer: its content and each call's (name,
    arguments), every call's id as vLLM writes one."""
    scanner.feed(text, True)
    assert all(VLLM_ID.match(c.id) for c in scanner.calls)
    return scanner.content, [(c.name, c.arguments) for c in scanner.calls]


def marker_llm(tiny_llama_dir, tmp_path_factory, name: str, markers: list[str]):
    """The tiny engine with ``markers`` added to its tokenizer (the weights keep their size)."""
    out = with_added_tokens(tiny_llama_dir, tmp_path_factory.mktemp(name) / "model",
                            list(markers))
    return make_llm(out, max_model_len=1024, num_gpu_blocks_override=256)


def vllm_id(call) -> bool:
    return bool(VLLM_ID.match(call.id))


def checked_calls(choice, finish_reason: str = "tool_calls",
                  good_id: Callable[[object], bool] = vllm_id,
                  with_ids: bool = False) -> list[tuple[str, ...]]:
    """The choice's calls as (name, arguments), each checked: the finish reason, no
    content, an id ``good_id`` takes, arguments valid against the function's schema;
    ``with_ids``: (id, name, arguments), for a format whose ids the model writes."""
    assert choice.finish_reason == finish_reason
    assert choice.message.tool_calls and not choice.message.content
    for call in choice.message.tool_calls:
        assert good_id(call), call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [(*((c.id,) if with_ids else ()), c.function.name, c.function.arguments)
            for c in choice.message.tool_calls]


async def required_round_trip(sdk_serve, llm, parser: str, marker: str,
                              good_id: Callable[[object], bool] = vllm_id,
                              with_ids: bool = False, seed: int = 1) -> None:
    """``tool_choice: "required"``: calls whole and streamed alike, the first token the
    format's ``marker`` as its own token. ``seed``: one whose random calls end within the
    answer's 300 tokens (a format whose calls take many tokens may keep calling past it)."""
    name, client = await sdk_serve(tool_call_parser=parser)
    body = {"model": name, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 300, "seed": seed, "temperature": 1.0}
    whole = (await client.chat.completions.create(**body)).choices[0]
    streamed = await _streamed(client, **body)
    assert (checked_calls(streamed, good_id=good_id, with_ids=with_ids)
            == checked_calls(whole, good_id=good_id, with_ids=with_ids))
    again = await client.chat.completions.create(**body, logprobs=True)
    first = again.choices[0].logprobs.content[0].token
    assert llm.tokenizer.token_to_id(first) == llm.tokenizer.added_token_id(marker)


async def named_round_trip(sdk_serve, parser: str, good_id: Callable[[object], bool] = vllm_id,
                           with_ids: bool = False) -> None:
    """A named function: that function alone, called, whole and streamed alike."""
    name, client = await sdk_serve(tool_call_parser=parser)
    body = {"model": name, "messages": ASK, "tools": TOOLS, "max_tokens": 200,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "seed": 3, "temperature": 1.0}
    whole = (await client.chat.completions.create(**body)).choices[0]
    calls = checked_calls(whole, "stop", good_id, with_ids)
    assert [call[-2] for call in calls] == ["get_time"]
    assert checked_calls(await _streamed(client, **body), "stop", good_id, with_ids) == calls
