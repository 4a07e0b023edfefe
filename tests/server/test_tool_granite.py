"""granite4 and granite-20b-fc: IBM Granite's JSON calls, ``<tool_call>`` segments and
``<function_call>`` objects, read back whole and streamed as vLLM 0.32's
``Granite4ToolParser`` and ``Granite20bFCToolParser`` read them (checked against them on
random texts), the format chosen by a template that shows it, and ``required``/named calls
written in it through the SDK by the tiny model (Granite 4's markers as added tokens)."""

from __future__ import annotations

import pytest
from _tool_sdk import marker_llm, named_round_trip, read_whole, required_round_trip
from _tool_streams import split_once_everywhere

from kvledger.engine.server.tools.calls import template_parser, tool_plan
from kvledger.engine.server.tools.parsers import CallScanner
from kvledger.engine.server.tools.protocol import Tool

F = '{"name": "f", "arguments": {"a": "é", "b": [1]}}'
G = '{"name": "g", "arguments": "{\\"b\\": 2}"}'
F_CALL, G_AS_WRITTEN = ("f", '{"a": "é", "b": [1]}'), ("g", '{"b": 2}')
GRANITE4 = [
    ("no calls", "no calls", []),
    (f"Sure. <tool_call>\n{F}\n</tool_call>\n<tool_call>{G}</tool_call> done",
     "Sure. \n done", [F_CALL, G_AS_WRITTEN]),
    ('<tool_call>{"name": "h", "arguments": [1, NaN]}</tool_call>', "", [("h", "[1, NaN]")]),
    # anything amiss makes the whole answer content: markers out of turn, an empty call,
    # one left open, no JSON object, null arguments, a name that is no string
    (f"a <tool_call>{F}</tool_call><tool_call>", f"a <tool_call>{F}</tool_call><tool_call>", []),
    (f"a </tool_call>{F}", f"a </tool_call>{F}", []),
    (f"<tool_call>{F}<tool_call>{F}</tool_call>", f"<tool_call>{F}<tool_call>{F}</tool_call>", []),
    (f"<tool_call></tool_call><tool_call>{F}</tool_call>",
     f"<tool_call></tool_call><tool_call>{F}</tool_call>", []),
    ('<tool_call>{"name": "f", "arguments": null}</tool_call>',
     '<tool_call>{"name": "f", "arguments": null}</tool_call>', []),
    ('<tool_call>{"name": 1, "arguments": {}}</tool_call>',
     '<tool_call>{"name": 1, "arguments": {}}</tool_call>', []),
    (f"<tool_call>[{F}]</tool_call>", f"<tool_call>[{F}]</tool_call>", []),
]
GRANITE_20B = [
    ("no calls", "no calls", []),
    # the text after each object up to the next marker is dropped; strings are dumped JSON
    (f"Sure. <function_call> {F} and <function_call>\u3000{G}\nbye", "Sure.",
     [F_CALL, ("g", '"{\\"b\\": 2}"')]),
    ('<function_call>{"name": "h", "arguments": 3}', "", [("h", "3")]),
    (f"a <function_call> {F} <function_call> x", f"a <function_call> {F} <function_call> x", []),
    ('a <function_call>{"name": "f", "arguments": {}', 'a <function_call>{"name": "f", "arguments": {}', []),
    ('a <function_call>{"name": "f"}', 'a <function_call>{"name": "f"}', []),
    # the blanks vLLM's \s skips are not the separators str.isspace counts
    (f"<function_call>\x1c{F}", f"<function_call>\x1c{F}", []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"),
                         [("granite4", *case) for case in GRANITE4]
                         + [("granite-20b-fc", *case) for case in GRANITE_20B])
def test_calls_are_read_as_vllm_reads_them_whole_and_streamed(parser, text, content,
                                                              calls) -> None:
    scanner = CallScanner(parser)
    assert read_whole(scanner, text) == (content, calls)
    for cut, got_content, got_calls in split_once_everywhere(lambda: CallScanner(parser), text):
        assert (got_content, got_calls) == (content, calls), cut


@pytest.mark.parametrize(("parser", "marker"), [("granite4", "<tool_call>"),
                                                ("granite-20b-fc", "<function_call>")])
def test_content_streams_until_the_first_marker_and_the_calls_at_the_end(parser, marker) -> None:
    scanner = CallScanner(parser)
    assert scanner.feed("Let me check", False) == ["Let me check"]
    assert scanner.feed(f"Let me check {marker[:4]}", False) == []
    assert scanner.feed(f"Let me check {marker}{F}", False) == []
    assert scanner.calls == []  # (a later call can still make it all content)


def test_the_template_chooses_the_format() -> None:
    granite4 = "<|start_of_role|>assistant<|end_of_role|>{{ '<tool_call>\\n' }}"
    assert template_parser(granite4) == "granite4"
    assert template_parser(granite4.replace("<|start_of_role|>", "")) == "hermes"
    assert template_parser("{{- '<function_call> ' + tc|tojson }}") == "granite-20b-fc"


def test_the_grammars_write_granite_calls() -> None:
    tools = [Tool.model_validate({"type": "function", "function": {"name": "f"}})]
    plan = tool_plan(tools, "required", True, auto_enabled=False, parser="granite-20b-fc",
                     chat_template=None)
    assert plan.grammar.splitlines()[0] == "start: call (call)*"
    assert plan.grammar.splitlines()[2].startswith(
        'call_0: "<function_call> {\\"name\\": \\"f\\", \\"arguments\\": " args_0 "}"')
    plan = tool_plan(tools, "required", False, auto_enabled=False, parser=None,
                     chat_template="<|start_of_role|><tool_call>", specials={"<tool_call>": 7})
    assert plan.parser == "granite4" and plan.kept_ids == frozenset({7})
    assert plan.grammar.splitlines()[2].startswith('call_0: <[7]> "\\n{\\"name\\": \\"f\\"')


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return marker_llm(tiny_llama_dir, tmp_path_factory, "granite4",
                      ["<tool_call>", "</tool_call>"])


async def test_required_calls_are_written_and_read_in_granite4_format(sdk_serve, llm) -> None:
    await required_round_trip(sdk_serve, llm, "granite4", "<tool_call>")


@pytest.mark.parametrize("parser", ["granite4", "granite-20b-fc"])
async def test_a_named_function_is_called_once(sdk_serve, parser) -> None:
    await named_round_trip(sdk_serve, parser)
