"""Tool calls read back from text (``parsers``) and the grammar that constrains them
(``calls``), without a model."""

from __future__ import annotations

import json

import pytest
from _tool_streams import assembled

from kvledger.engine.server.tools.calls import (
    FORMATS,
    MISTRAL_V11,
    calls_grammar,
    template_parser,
    tool_plan,
)
from kvledger.engine.server.tools.parsers import ArgumentsDelta, CallScanner, ToolCall
from kvledger.engine.server.tools.protocol import Tool
from kvledger.engine.server.validation import Refusal

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
TIME = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})


def _whole(parser: str, text: str, max_calls: int | None = None) -> CallScanner:
    scanner = CallScanner(parser, max_calls)
    scanner.feed(text, final=True)
    return scanner


def _pieces(parser: str, text: str, max_calls: int | None = None) -> list:
    """The text fed a character at a time: what a stream sends."""
    scanner = CallScanner(parser, max_calls)
    pieces = []
    for end in range(1, len(text) + 1):
        pieces += scanner.feed(text[:end], final=end == len(text))
    return pieces


def _streamed(parser: str, text: str, max_calls: int | None = None):
    """The content and calls a stream sends, assembled as the SDK does: each call named
    first (no arguments yet), then its arguments' fragments appended by index."""
    content, calls, _ = assembled(_pieces(parser, text, max_calls))
    return content, calls


def _calls(scanner: CallScanner) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in scanner.calls]


HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_hermes_calls_and_the_text_before_them() -> None:
    scanner = _whole("hermes", HERMES)
    assert _calls(scanner) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert scanner.content == "Let me look."
    assert all(c.id.startswith("call_") for c in scanner.calls)
    assert len({c.id for c in scanner.calls}) == 2


@pytest.mark.parametrize("text", [
    HERMES,
    "no calls here < tool_call > at all <tool_",
    '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call> and after',
    '<tool_call>{"name": "f", "arguments": {"x": "é"}}',  # unclosed: still a call
    '<tool_call>\n{"name": "f", "arguments": {"a": \n</tool_call>',  # malformed: text
])
def test_a_stream_adds_up_to_the_whole_answer(text) -> None:
    whole = _whole("hermes", text)
    assert _streamed("hermes", text) == (whole.content, _calls(whole))


def test_text_that_is_not_a_well_formed_call_stays_text() -> None:
    for text in ('<tool_call>\n{"arguments": {}}\n</tool_call>',
                 '<tool_call>\n{"name": "f" "arguments": {}}\n</tool_call>',
                 '<tool_call>\n{"name": "f", "arguments": "not an object"}\n</tool_call>'):
        scanner = _whole("hermes", text)
        assert (scanner.calls, scanner.content) == ([], text)


def test_a_named_call_is_a_call_even_if_its_arguments_break_off() -> None:
    """Once named, a call has gone out to a stream: it stays a call, with the arguments
    as far as they were written (the end tag, or the end of the text, ends them)."""
    text = '<tool_call>\n{"name": "f", "arguments": {"a": \n</tool_call>'
    assert _calls(_whole("hermes", text)) == [("f", '{"a":')]
    assert _streamed("hermes", text) == ("", [("f", '{"a":')])
    cut = '<tool_call>\n{"name": "f", "arguments": {"a": "Par'
    assert _streamed("hermes", cut) == ("", [("f", '{"a": "Par')])


def test_arguments_stream_as_they_are_written() -> None:
    pieces = _pieces("hermes", HERMES)
    first = next(i for i, p in enumerate(pieces) if isinstance(p, ToolCall))
    assert pieces[first].name == "get_weather"
    fragments = [p.text for p in pieces if isinstance(p, ArgumentsDelta) and p.index == 0]
    assert len(fragments) > 10  # about one a character, as fed (a space waits for more)
    assert "".join(fragments) == '{"city": "Paris"}'
    braces = '<tool_call>{"name": "f", "arguments": {"s": "} {\\" ]"}}</tool_call>'
    assert _streamed("hermes", braces) == ("", [("f", '{"s": "} {\\" ]"}')])


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    assert _calls(_whole("hermes", HERMES, max_calls=1)) == [("get_weather", '{"city": "Paris"}')]
    assert _streamed("hermes", HERMES, max_calls=1) == \
        ("Let me look.", [("get_weather", '{"city": "Paris"}')])


MISTRAL_V3 = ('Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_time", "arguments": {}}]')
MISTRAL_NEW = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'


@pytest.mark.parametrize("text", [MISTRAL_V3, MISTRAL_NEW])
def test_mistral_calls_in_both_forms(text) -> None:
    scanner = _whole("mistral", text)
    assert _calls(scanner) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert scanner.content == ("Let me look." if text == MISTRAL_V3 else "")
    assert all(c.id.isalnum() and len(c.id) == 9 for c in scanner.calls)  # as vLLM's
    assert _streamed("mistral", text) == (scanner.content, _calls(scanner))


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("[TOOL_CALLS]not a call", "[TOOL_CALLS]not a call", []),
    ("half a marker [TOOL_", "half a marker [TOOL_", []),
    ('[TOOL_CALLS]{"name": "f", "arguments": {"a": 1}}', "", [("f", '{"a": 1}')]),
    ('[TOOL_CALLS][{"arguments": {"a": 1}, "name": "f"}]', "", [("f", '{"a": 1}')]),
    ('[TOOL_CALLS][{"nom": "f"}]', '[TOOL_CALLS][{"nom": "f"}]', []),
])
def test_mistral_text_that_is_not_a_call(text, content, calls) -> None:
    scanner = _whole("mistral", text)
    assert (scanner.content, _calls(scanner)) == (content, calls)
    assert _streamed("mistral", text) == (content, calls)


def test_llama3_json_calls() -> None:
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
            '{"name": "get_time", "parameters": {}}')
    scanner = _whole("llama3_json", text)
    assert _calls(scanner) == [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")]
    assert scanner.content == ""
    assert _streamed("llama3_json", text) == ("", _calls(scanner))
    for plain in ("The weather is fine.", '{"not": "a call"}'):
        assert _whole("llama3_json", plain).content == plain
        assert _streamed("llama3_json", plain) == (plain, [])


def test_the_format_comes_from_the_flag_else_the_template() -> None:
    assert template_parser("... <tool_call> ...") == "hermes"
    assert template_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert template_parser(None) == "hermes"
    assert template_parser("[AVAILABLE_TOOLS] ... [TOOL_CALLS][") == "mistral"
    plan = tool_plan([WEATHER], "required", True, auto_enabled=False, parser=None,
                     chat_template="{{ '<|python_tag|>' }}")
    assert plan.parser == "llama3_json" and '\\"parameters\\": ' in plan.grammar


def test_auto_needs_the_server_flags() -> None:
    with pytest.raises(Refusal, match="requires --enable-auto-tool-choice"):
        tool_plan([WEATHER], "auto", True, auto_enabled=False, parser=None, chat_template=None)
    plan = tool_plan([WEATHER], "auto", False, auto_enabled=True, parser="hermes",
                     chat_template=None)
    assert (plan.parser, plan.grammar, plan.max_calls) == ("hermes", None, 1)
    none = tool_plan([WEATHER], "none", True, auto_enabled=True, parser="hermes",
                     chat_template=None)
    assert none.scanner() is None


def test_the_grammar_holds_each_function_and_its_schema() -> None:
    grammar = calls_grammar(FORMATS["hermes"], [WEATHER, TIME], parallel=False)
    lines = grammar.splitlines()
    assert lines[0] == "start: call" and lines[1] == "call: call_0 | call_1"
    assert json.dumps('<tool_call>\n{"name": "get_weather", "arguments": ') in lines[2]
    schema = json.loads(lines[3].removeprefix("args_0: %json "))
    assert schema.pop("x-guidance")["whitespace_flexible"] is False
    assert schema == WEATHER.function.schema
    assert "additionalProperties" in lines[5]  # no parameters: no arguments
    parallel = calls_grammar(FORMATS["hermes"], [WEATHER], parallel=True)
    assert parallel.startswith('start: call ("\\n" call)*\n')


def test_mistral_grammars_write_the_special_tokens() -> None:
    specials = {"[TOOL_CALLS]": 6, "[ARGS]": 7}
    old = calls_grammar(FORMATS["mistral"], [WEATHER], parallel=True, specials=specials)
    assert old.splitlines()[0] == 'start: <[6]> "[" call (", " call)* "]"'
    new = calls_grammar(MISTRAL_V11, [WEATHER], parallel=False, specials=specials)
    assert new.splitlines()[2] == 'call_0: <[6]> "get_weather" <[7]> args_0'
    plan = tool_plan([WEATHER], "required", True, auto_enabled=False, parser=None,
                     chat_template="[TOOL_CALLS]", specials=specials)
    assert plan.parser == "mistral" and plan.kept_ids == {6, 7} and "<[7]>" in plan.grammar
    hermes = tool_plan([WEATHER], "required", True, auto_enabled=False, parser="hermes",
                       chat_template=None, specials=specials)
    assert hermes.kept_ids == frozenset()  # hermes' markers are not special tokens here


@pytest.mark.parametrize(("alias", "parser", "text"), [
    ("qwen3_json", "hermes", HERMES),
    ("llama4_json", "llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}'),
])
def test_vllms_other_names_for_a_parser_read_and_write_as_it(alias, parser, text) -> None:
    """vLLM 0.32 registers qwen3_json as its hermes parser and llama4_json as its
    llama3_json one: the same reading, the same grammar."""
    assert _calls(_whole(alias, text)) == _calls(_whole(parser, text))
    assert _whole(alias, text).content == _whole(parser, text).content
    grammars = [tool_plan([WEATHER], "required", True, auto_enabled=False, parser=name,
                          chat_template=None).grammar for name in (alias, parser)]
    assert grammars[0] == grammars[1]
