"""xlam: xLAM's JSON lists of calls, bare, fenced, after ``[TOOL_CALLS]`` or in
``<tool_call>`` tags, read back whole and streamed as vLLM 0.32's ``xLAMToolParser``
reads them (checked against it on random texts), and ``required``/named calls written as
the bare list through the SDK by the tiny model."""

from __future__ import annotations

import pytest
from _tool_sdk import checked_calls, named_round_trip, read_whole
from _tool_streams import assembled
from test_tool_calls_sdk import ASK, TOOLS, _streamed
from test_tool_calls_sdk import llm as llm  # the tiny model sdk_serve serves

from kvledger.engine.server.tools.calls import tool_plan
from kvledger.engine.server.tools.parsers import CallScanner
from kvledger.engine.server.tools.protocol import Tool

CALL = '[{"name": "f", "arguments": {"a": "é"}}, {"name": "g", "arguments": "{\\"b\\": 2}"}]'
CALLS = [("f", '{"a": "é"}'), ("g", '{"b": 2}')]
CASES = [
    ("no calls", "no calls", []),
    (CALL, "", CALLS),
    (f"  {CALL}", "", CALLS),
    (f"Sure. ```json\n{CALL}``` and ```{{}}``` done", "Sure.  and  done", CALLS),  # (every fence goes)
    (f"a [TOOL_CALLS]{CALL}\nb [TOOL_CALLS]x\nc", "a \nb \nc", CALLS),
    (f"<think>hm</think>\n{CALL}\n", "<think>hm</think>", CALLS),
    (f"a <tool_call>{CALL}</tool_call> b", "a  b", CALLS),
    # JSON that is no list: no call (the match still dropped); a call vLLM's own types
    # refuse, no JSON: all content
    ('a <tool_call>{"name": "f"}</tool_call>', "a", []),
    ('[{"name": 3, "arguments": {}}]', '[{"name": 3, "arguments": {}}]', []),
    ('[{"name": "f", "arguments"', '[{"name": "f", "arguments"', []),
    ("[" * 100000, "[" * 100000, []),
    ("x ```[1]", "x ```[1]", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_calls_are_read_as_vllm_reads_them_whole_and_streamed(text, content, calls) -> None:
    scanner = CallScanner("xlam")
    assert read_whole(scanner, text) == (content, calls)
    for cut in range(1, min(len(text), 200)):
        scanner = CallScanner("xlam")
        got_content, got_calls, _ = assembled(scanner.feed(text[:cut], False)
                                              + scanner.feed(text, True))
        assert (got_content, got_calls) == (content, calls), cut


def test_content_streams_until_a_marker() -> None:
    scanner = CallScanner("xlam")
    assert scanner.feed("Sure, let me", False) == ["Sure, let me"]
    assert scanner.feed("Sure, let me ```json [", False) == []
    assert scanner.feed("[1]", False) == [] and CallScanner("xlam").feed(" a b", False) == []


def test_the_grammar_writes_the_bare_list() -> None:
    plan = tool_plan([Tool.model_validate(t) for t in TOOLS], "required", True,
                     auto_enabled=False, parser="xlam", chat_template=None)
    assert plan.grammar.splitlines()[0] == 'start: "[" call (", " call)* "]"'
    assert plan.grammar.splitlines()[2].startswith('call_0: "{\\"name\\": \\"get_weather\\", ')


async def test_required_calls_are_written_and_read_in_xlam_format(sdk_serve) -> None:
    name, client = await sdk_serve(tool_call_parser="xlam")
    body = {"model": name, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 300, "seed": 1, "temperature": 1.0}
    whole = (await client.chat.completions.create(**body)).choices[0]
    assert checked_calls(await _streamed(client, **body)) == checked_calls(whole)


async def test_a_named_function_is_called_once(sdk_serve) -> None:
    await named_round_trip(sdk_serve, "xlam")
