"""lfm2 (LiquidAI LFM2, LFM2.5): pythonic's call lists between ``<|tool_call_start|>`` and
``<|tool_call_end|>``, read back as vLLM 0.32's ``Lfm2ToolParser`` reads a whole answer
(each case's answer is its own, checked on random texts: its rewrites of calls that do
not parse, its dropping of echoed calls), streams that add up to the whole at every
split, the format chosen by a template that shows it, and ``required``/named calls
written in it through the SDK by a tiny model whose tokenizer holds LFM2's tokens."""

from __future__ import annotations

import pytest
from _tool_sdk import marker_llm, named_round_trip, read_whole, required_round_trip
from _tool_streams import split_once_everywhere

from kvledger.engine.server.tools.calls import template_parser, tool_plan
from kvledger.engine.server.tools.lfm2_format import CALL_END, CALL_START
from kvledger.engine.server.tools.parsers import CallScanner
from kvledger.engine.server.tools.protocol import Tool
from kvledger.engine.server.tools.python_repairs import MAX_ENDS_TRIED, closed_nested_quotes

S, E = CALL_START, CALL_END
CASES = [  # text, content, calls: as vLLM 0.32 reads them
    (S + '[get_weather(city="Paris")]' + E + "The weather in Paris is sunny.",
     "The weather in Paris is sunny.", [("get_weather", '{"city": "Paris"}')]),
    ("Sure. " + S + "[get_weather(city='Paris'), get_time()]" + E, "Sure.",
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    (S + "[get_time()]", "", [("get_time", "{}")]),  # no end token
    (" \n" + S + "[f(x=1)]" + E, "", [("f", '{"x": 1}')]),
    # what does not parse, rewritten: zero-padded integers (and the echo after the end
    # dropped, the content stripped and joined), raw line breaks, nested quotes, keywords
    ("  Hi\n" + S + " [f(month=07)]\n" + E + "[f(month=07)]" + E + " Done. ", "Hi\nDone.",
     [("f", '{"month": 7}')]),
    (S + "[f(cmd='a\nb\tc')]" + E, "", [("f", '{"cmd": "a\\nb\\tc"}')]),
    (S + "[f(q='sed -n '1,9p' f.py')]" + E, "", [("f", '{"q": "sed -n \'1,9p\' f.py"}')]),
    (S + "[f(from=1, x=2)]" + E, "", [("f", '{"from": 1, "x": 2}')]),
    # no list, an empty one, bytes, two rewrites needed at once: all content
    (S + "get_time()" + E, S + "get_time()" + E, []),
    (S + "[]" + E, S + "[]" + E, []),
    (S + "[f(x=b'1')]" + E + " after", S + "[f(x=b'1')]" + E + " after", []),
    (S + "[f(q='sed -n '1,9p' f.py', from=1)]" + E,
     S + "[f(q='sed -n '1,9p' f.py', from=1)]" + E, []),
    ("Just text", "Just text", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_calls_are_read_as_vllm_reads_them_whole_and_streamed(text, content, calls) -> None:
    scanner = CallScanner("lfm2")
    assert read_whole(scanner, text) == (content, calls)
    for cut, got_content, got_calls in split_once_everywhere(lambda: CallScanner("lfm2"), text):
        assert (got_content, got_calls) == (content, calls), cut


def test_content_streams_unless_the_answer_begins_blank() -> None:
    scanner = CallScanner("lfm2")
    assert scanner.feed("Sure, here  <|tool_c", False) == ["Sure, here"]
    blank = CallScanner("lfm2")
    assert blank.feed("\nSure, here it is", False) == []  # stripped only if calls come


def test_a_string_broken_in_more_places_than_tried_is_left_as_written() -> None:
    # vLLM parses the whole text once per place the string may end; kvledger at most
    # MAX_ENDS_TRIED times (more is taken as ambiguous).
    few = "[f(q='a 'b' c')]"
    assert closed_nested_quotes(few) == ("[f(q='a \\'b\\' c')]", True)
    many = "[f(q='a '" + "x', " * MAX_ENDS_TRIED + "')]"
    assert closed_nested_quotes(many) == (many, False)


def test_the_template_chooses_the_format_and_the_grammar_writes_it() -> None:
    assert template_parser("{{- '<|tool_call_start|>' + calls + '<|tool_call_end|>' }}") == "lfm2"
    tools = [Tool.model_validate({"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"k": {"type": "integer"}}}}})]
    plan = tool_plan(tools, "required", True, auto_enabled=False, parser="lfm2",
                     chat_template=None, specials={S: 7, E: 8})
    assert plan.kept_ids == frozenset({7, 8})
    assert plan.grammar.startswith('start: <[7]> "[" call (", " call)* "]" <[8]>\n')


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return marker_llm(tiny_llama_dir, tmp_path_factory, "lfm2", [S, E])


async def test_required_calls_are_written_and_read_in_lfm2_format(sdk_serve, llm) -> None:
    await required_round_trip(sdk_serve, llm, "lfm2", S)


async def test_a_named_function_is_called_once(sdk_serve) -> None:
    await named_round_trip(sdk_serve, "lfm2")
