"""qwen3_coder's calls (Qwen3-Coder, Qwen3.5: ``<function=NAME>`` and
``<parameter=KEY>\\nVALUE\\n</parameter>``) read back as vLLM 0.32 reads them, whole and
streamed, and the grammar of ``required``/a named function, without a model. The
expected calls are vLLM 0.32's own (its parser engine run on the same texts)."""

from __future__ import annotations

import json
import random
import re

import pytest
from _tool_streams import assembled

from kvledger.engine.server.tools.calls import template_parser, tool_plan
from kvledger.engine.server.tools.parsers import CallScanner, ToolCall
from kvledger.engine.server.tools.protocol import NamedToolChoice, Tool
from kvledger.engine.server.validation import Refusal

TOOLS = [Tool.model_validate(t) for t in [
    {"type": "function", "function": {"name": "get_current_weather", "parameters": {
        "type": "object", "required": ["city", "state"], "properties": {
            "city": {"type": "string"}, "state": {"type": "string"},
            "unit": {"type": "string", "enum": ["fahrenheit", "celsius"]}}}}},
    {"type": "function", "function": {"name": "calculate_area", "parameters": {
        "type": "object", "properties": {
            "shape": {"type": "string"}, "dimensions": {"type": "object"},
            "precision": {"type": "integer"}, "ratio": {"type": "float"},  # vLLM's alias
            "exact": {"type": "boolean"}, "note": {"type": ["string", "null"]}}}}}]]
WEATHER = ("<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n"
           "</parameter>\n<parameter=state>\nTX\n</parameter>\n</function>\n</tool_call>")
DALLAS = ("get_current_weather", '{"city": "Dallas", "state": "TX"}')
AREA = ('<tool_call>\n<function=calculate_area>\n<parameter=shape>\nrectangle\n</parameter>\n'
        '<parameter=dimensions>\n{"width": 10, \n "height": 20}\n</parameter>\n'
        '<parameter=precision>\n2\n</parameter>\n<parameter=ratio>\n1.50\n</parameter>\n'
        '<parameter=exact>\nTrue\n</parameter>\n<parameter=note>\nNull\n</parameter>\n'
        '</function>\n</tool_call>')

CASES = [  # text, content, calls: vLLM 0.32's (its stream's content where they differ)
    ("Sure! Let me check the weather for you." + WEATHER,
     "Sure! Let me check the weather for you.", [DALLAS]),
    (WEATHER + "\n" + AREA, "", [DALLAS, ("calculate_area", (
        '{"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2, '
        '"ratio": 1.5, "exact": true, "note": null}'))]),
    ("<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n</function>",
     "", [("get_current_weather", '{"city": "Dallas"}')]),  # no <tool_call>: still a call
    ("<tool_call>\n<function=lookup>\n<parameter=count>\n3\n</parameter>\n</function>\n"
     "</tool_call>", "", [("lookup", '{"count": "3"}')]),  # undeclared: values stay strings
    ("<tool_call>\n<function=calculate_area>\n<parameter=precision>\nabout two\n</parameter>\n"
     "<parameter=ratio>\ninf\n</parameter>\n<parameter=dimensions>\n[1, 2]\n</parameter>\n"
     "</function>\n</tool_call>", "", [("calculate_area",  # what fits no type stays text
                                        '{"precision": "about two", "ratio": "inf", '
                                        '"dimensions": [1, 2]}')]),
    ("<tool_call>\n<function=get_current_weather>\n<parameter=city>\nline one\n\nline <b>two"
     "</b>\n\n</parameter>\n</function>\n</tool_call>", "",
     [("get_current_weather", '{"city": "line one\\n\\nline <b>two</b>\\n"}')]),
    ("<tool_call>\n<function= >\n<parameter=city>\nDallas\n</parameter>\n</function>\n"
     "</tool_call>", "", []),  # a blank name: no call
    ('<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Dallas"}}\n'
     "</tool_call>", "", []),  # hermes' JSON inside: dropped, as vLLM's engine drops it
    (WEATHER + " All done.", " All done.", [DALLAS]),  # (vLLM's whole answer drops it)
    ("No call here: a <tool_ and a </function> and x > y.",
     "No call here: a <tool_ and a </function> and x > y.", []),
]


def _scanner(max_calls: int | None = None) -> CallScanner:
    return CallScanner("qwen3_coder", max_calls, TOOLS)


def _whole(text: str, max_calls: int | None = None) -> tuple[str, list[tuple[str, str]]]:
    scanner = _scanner(max_calls)
    scanner.feed(text, final=True)
    return scanner.content, [(c.name, c.arguments) for c in scanner.calls]


def _streamed(text: str, cuts: list[int], max_calls: int | None = None):
    """The content and calls a stream fed at ``cuts`` sends, assembled as the SDK does."""
    scanner, pieces = _scanner(max_calls), []
    for n, end in enumerate(cuts):
        pieces += scanner.feed(text[:end], final=n == len(cuts) - 1)
    content, calls, fragments = assembled(pieces)
    return (content, calls), fragments


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_calls_are_read_as_vllm_reads_them(text, content, calls) -> None:
    assert _whole(text) == (content, calls)
    for call in _scanner_calls(text):
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", call.id)  # vLLM 0.32's ids


def _scanner_calls(text: str) -> list[ToolCall]:
    scanner = _scanner()
    scanner.feed(text, final=True)
    return scanner.calls


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_a_stream_adds_up_to_the_whole_answer(text, content, calls) -> None:
    rng = random.Random(len(text))
    by_character = list(range(1, len(text) + 1))
    assert _streamed(text, by_character)[0] == (content, calls)
    for _ in range(20):
        cuts = sorted(rng.sample(by_character, k=min(len(text), rng.randint(1, 8))))
        assert _streamed(text, cuts if cuts[-1] == len(text) else [*cuts, len(text)])[0] == \
            (content, calls)


def test_string_values_stream_as_written_and_typed_ones_once_closed() -> None:
    long = "x" * 40
    text = (f"<tool_call>\n<function=calculate_area>\n<parameter=shape>\n{long}\n</parameter>\n"
            "<parameter=precision>\n12345\n</parameter>\n</function>\n</tool_call>")
    (_, calls), fragments = _streamed(text, list(range(1, len(text) + 1)))
    assert calls == [("calculate_area", f'{{"shape": "{long}", "precision": 12345}}')]
    assert len(fragments) > 30  # about one a character of the string
    assert any("12345" in f for f in fragments)  # the number once closed, whole


def test_the_cases_vllm_reads_otherwise_are_read_so_a_stream_can_add_up() -> None:
    """vLLM 0.32 drops a parameter left open when the call ends (its stream has then sent
    part of it), and keeps the last of a parameter written twice (its stream, the first):
    here the open one is kept and the first value wins, whole and streamed alike."""
    cut = "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDal"
    twice = ("<function=get_current_weather>\n<parameter=city>\nA\n</parameter>\n"
             "<parameter=city>\nB\n</parameter>\n</function>")
    for text, call in ((cut, '{"city": "Dal"}'), (twice, '{"city": "A"}')):
        assert _whole(text) == ("", [("get_current_weather", call)])
        assert _streamed(text, list(range(1, len(text) + 1)))[0] == _whole(text)


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    assert _whole(WEATHER + "\n" + AREA, max_calls=1) == ("", [DALLAS])


def test_the_format_comes_from_the_flag_else_the_template() -> None:
    template = "{{- '\\n<tool_call>\\n<function=' + name + '>\\n<parameter=' + key }}"
    assert template_parser(template) == "qwen3_coder"
    plan = tool_plan(TOOLS, "required", True, auto_enabled=False, parser=None,
                     chat_template=template)
    assert plan.parser == "qwen3_coder" and "<parameter=city>" in plan.grammar
    assert _whole(WEATHER) == ("", [DALLAS])
    scanner = CallScanner("qwen3_xml", None, TOOLS)  # vLLM's other name for it
    scanner.feed(AREA, final=True)
    assert json.loads(scanner.calls[0].arguments)["precision"] == 2


SPECIALS = {"<tool_call>": 5, "</tool_call>": 6}


def test_the_grammar_writes_each_declared_parameter_in_order() -> None:
    plan = tool_plan(TOOLS, _named("calculate_area"), True, auto_enabled=False,
                     parser="qwen3_coder", chat_template=None, specials=SPECIALS)
    lines = plan.grammar.splitlines()
    assert lines[0] == "start: call" and lines[1] == "call: call_0"  # named: that one, once
    call = next(line for line in lines if line.startswith("call_0: "))
    assert call.startswith('call_0: <[5]> "\\n<function=calculate_area>\\n" (p_0_0)? ')
    assert call.endswith('"</function>\\n" <[6]>')
    shape = next(line for line in lines if line.startswith("p_0_0: "))
    assert shape == 'p_0_0: "<parameter=shape>\\n" V_0_0 "\\n"'  # a string: written bare
    precision = next(line for line in lines if line.startswith("v_0_2: "))
    assert json.loads(precision.removeprefix("v_0_2: %json "))["type"] == "integer"
    parallel = tool_plan(TOOLS, "required", True, auto_enabled=False, parser="qwen3_coder",
                         chat_template=None, specials=SPECIALS)
    assert parallel.grammar.startswith('start: call ("\\n" call)*\n')
    assert "call_0: " in parallel.grammar and "call_1: " in parallel.grammar


def _named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "object", "properties": {"n": {"type": ["string", "integer"]}}},
     "'tools[0].function.parameters.properties.n' (f): a qwen3_coder string is written "
     "bare, constrained by type, enum, const, pattern, minLength, maxLength and anyOf/oneOf "
     "of those; not by a string beside ['integer']"),
    ({"type": "object", "properties": {"day": {"type": "string", "format": "date"}}},
     "not by 'format'"),
    ({"type": "object", "properties": {"a>b": {"type": "integer"}}},
     "'tools[0].function.parameters.properties.a>b' (f): a qwen3_coder parameter's name"),
    ({"type": "object", "properties": {}, "minProperties": 1},
     "'tools[0].function.parameters' (f): a qwen3_coder call writes each declared property "
     "in turn, which cannot honour 'minProperties'"),
])
def test_what_the_format_cannot_write_is_refused_by_name(schema, message) -> None:
    tool = Tool.model_validate({"type": "function",
                                "function": {"name": "f", "parameters": schema}})
    with pytest.raises(Refusal, match=re.escape(message)):
        tool_plan([tool], "required", True, auto_enabled=False, parser="qwen3_coder",
                  chat_template=None)
