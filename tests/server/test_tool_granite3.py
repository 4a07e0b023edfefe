"""granite: Granite 3's JSON list after ``<|tool_call|>`` (or ``<tool_call>``), read back
whole and streamed as vLLM 0.32's parser engine reads it (checked against vLLM's own
``GraniteEngineToolParser`` on random texts, with declared tools), the format chosen by
a template that shows it, and ``required``/named calls written in it through the SDK by
a tiny model whose tokenizer holds ``<|tool_call|>`` as an added token."""

from __future__ import annotations

import pytest
from _tool_sdk import marker_llm, named_round_trip, read_whole, required_round_trip
from _tool_streams import split_once_everywhere

from kvledger.engine.server.tools.calls import template_parser, tool_plan
from kvledger.engine.server.tools.granite3_format import TOOL_TOKEN
from kvledger.engine.server.tools.parsers import CallScanner
from kvledger.engine.server.tools.protocol import Tool

DECLARED = [Tool.model_validate({"type": "function", "function": {
    "name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "string"},
        "o": {"type": "object", "properties": {"x": {"type": "integer"}}}}}}})]
F = '{"name": "f", "arguments": {"a": "1", "b": 2, "o": {"x": "3"}, "z": "4"}}'
F_TYPED = ("f", '{"a": 1, "b": "2", "o": {"x": 3}, "z": "4"}')
CASES = [
    ("no calls", "no calls", []),
    # the list's calls, typed by the declared schema; text after the list is dropped once
    # a call is named by its "name" field
    (f"  Sure. {TOOL_TOKEN} [{F}, {{\"name\": \"g\"}}] done", "Sure.", [F_TYPED, ("g", "{}")]),
    ('<tool_call>[{"arguments": {"k": [1]}, "name": " h "}]', "", [("h", '{"k": [1]}')]),
    # the first name field empty: the element read whole (a string's arguments kept so),
    # and, no element named by its field, the text after the list kept
    (f'{TOOL_TOKEN}[{{"name" : null}}, {{"x": {{"name": ""}}, "name": "g", "parameters": "s"}}] ok',
     "ok", [("g", "s")]),
    # an element cut by the end of the answer keeps what it has
    (f'{TOOL_TOKEN}[{{"name": "g", "arguments": {{"k": 1', "", [("g", '{"k": 1')]),
    # no list after the marker: the marker goes, the rest is content; a marker the list
    # stops at is content whole
    (f"a {TOOL_TOKEN} b", "a b", []),
    (f"a {TOOL_TOKEN}[{TOOL_TOKEN}] b", f"a {TOOL_TOKEN}] b", []),
    ('a <tool_call>[{"name": ""}] b', "a  b", []),
    # where vLLM's own reading fails (a name that is no string), all content
    (f'a {TOOL_TOKEN}[{{"name": 5, "arguments": {{}}}}]',
     f'a {TOOL_TOKEN}[{{"name": 5, "arguments": {{}}}}]', []),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_calls_are_read_as_vllm_reads_them_whole_and_streamed(text, content, calls) -> None:
    scanner = CallScanner("granite", None, DECLARED)
    assert read_whole(scanner, text) == (content, calls)
    for cut, got_content, got_calls in split_once_everywhere(
            lambda: CallScanner("granite", None, DECLARED), text):
        assert (got_content, got_calls) == (content, calls), cut


def test_content_streams_until_a_marker_unless_it_begins_blank() -> None:
    scanner = CallScanner("granite")
    assert scanner.feed("Sure <|tool", False) == ["Sure"]
    assert scanner.feed(f"Sure {TOOL_TOKEN}[{F}", False) == []
    assert CallScanner("granite").feed(" Sure", False) == []


def test_the_template_chooses_the_format_and_the_grammar_writes_the_list() -> None:
    template = "{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + calls }}"
    assert template_parser(template) == "granite"
    plan = tool_plan(DECLARED, "required", True, auto_enabled=False, parser=None,
                     chat_template=template, specials={TOOL_TOKEN: 9})
    assert plan.parser == "granite" and plan.kept_ids == frozenset({9})
    assert plan.grammar.splitlines()[0] == 'start: <[9]> "[" call (", " call)* "]"'


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return marker_llm(tiny_llama_dir, tmp_path_factory, "granite", [TOOL_TOKEN])


async def test_required_calls_are_written_and_read_in_granite_format(sdk_serve, llm) -> None:
    await required_round_trip(sdk_serve, llm, "granite", TOOL_TOKEN, seed=2)


async def test_a_named_function_is_called_once(sdk_serve) -> None:
    await named_round_trip(sdk_serve, "granite")
