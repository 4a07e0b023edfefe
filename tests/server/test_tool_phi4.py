"""phi4_mini_json: Phi-4-mini's ``functools[...]`` lists, read back as vLLM 0.32's
``Phi4MiniJsonToolParser`` reads a whole answer (checked against it on random texts), but
a list holding a ``]`` read to its own bracket; streamed sensibly where vLLM streams
nothing; and ``required``/named calls written in it through the SDK by the tiny model."""

from __future__ import annotations

import pytest
from _tool_sdk import checked_calls, named_round_trip, read_whole
from _tool_streams import assembled, split_once_everywhere
from test_tool_calls_sdk import ASK, TOOLS, _streamed
from test_tool_calls_sdk import llm as llm  # the tiny model sdk_serve serves

from kvledger.engine.server.tools.calls import template_parser, tool_plan
from kvledger.engine.server.tools.parsers import CallScanner
from kvledger.engine.server.tools.protocol import Tool

CALLS = ('[{"name": "f", "arguments": {"a": "é"}}, {"name": "g", "parameters": "s"}, '
         '{"name": "h", "arguments": {"l": [1, "]"]}}]')
READ = [("f", '{"a": "é"}'), ("g", '"s"'), ("h", '{"l": [1, "]"]}')]
CASES = [
    ("no calls", "no calls", []),
    ('Sure. functools[{"name": "f", "arguments": {"a": "é"}}]', "", READ[:1]),
    # a list holding a ']' read to its own bracket (vLLM's reading stops at the first
    # ']', and its answer is empty)
    (f"functools{CALLS}", "", READ),
    (f"functools{CALLS} and text after", "", READ),
    ("functools[] ", "", []),
    # a list that is no JSON, read to its first ']': an empty answer (vLLM's)
    ('functools[{"name": "f", "arguments": {}] x', "", []),
    # an element vLLM's call refuses, or no ']' after the marker: all content
    ('a functools[{"name": "f"}]', 'a functools[{"name": "f"}]', []),
    ('a functools[{"name": 1, "arguments": {}}]', 'a functools[{"name": 1, "arguments": {}}]', []),
    ("a functools[3]", "a functools[3]", []),
    ('a functools[{"name": "f"', 'a functools[{"name": "f"', []),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_calls_are_read_as_vllm_reads_them(text, content, calls) -> None:
    scanner = CallScanner("phi4_mini_json")
    assert read_whole(scanner, text) == (content, calls)
    for cut, _, got_calls in split_once_everywhere(lambda: CallScanner("phi4_mini_json"), text):
        assert got_calls == calls, cut


def test_content_before_the_marker_streams_and_the_calls_come_at_the_end() -> None:
    scanner = CallScanner("phi4_mini_json")
    pieces = scanner.feed("Sure. functool", False)
    assert pieces == ["Sure."]  # (the blank waits for what follows)
    pieces += scanner.feed(f"Sure. functools{CALLS[:20]}", False)
    pieces += scanner.feed(f"Sure. functools{CALLS}", True)
    content, calls, _ = assembled(pieces)
    assert (content, calls) == ("Sure.", READ)  # the whole answer drops that content


def test_the_template_chooses_the_format_and_the_grammar_writes_the_list() -> None:
    template = 'as functools[{"name": [function name], "arguments": [function arguments]}]'
    assert template_parser(template) == "phi4_mini_json"
    tools = [Tool.model_validate(t) for t in TOOLS]
    plan = tool_plan(tools, "required", True, auto_enabled=False, parser=None,
                     chat_template=template)
    assert plan.grammar.splitlines()[0] == 'start: "functools[" call (", " call)* "]"'


async def test_required_calls_are_written_and_read_in_phi4_format(sdk_serve) -> None:
    name, client = await sdk_serve(tool_call_parser="phi4_mini_json")
    body = {"model": name, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 300, "seed": 1, "temperature": 1.0}
    whole = (await client.chat.completions.create(**body)).choices[0]
    assert checked_calls(await _streamed(client, **body)) == checked_calls(whole)


async def test_a_named_function_is_called_once(sdk_serve) -> None:
    await named_round_trip(sdk_serve, "phi4_mini_json")
