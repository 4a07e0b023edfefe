"""olmo3 (OLMo 3): pythonic's calls one a line in ``<function_calls>``, read back as vLLM
0.32's ``Olmo3PythonicToolParser`` reads a whole answer (each case's calls are its own,
checked on random texts), streams that add up to the whole at every split, the format
chosen by a template that shows it, and ``required``/named calls written in it through
the SDK by a tiny model whose tokenizer holds OLMo's tags as added tokens."""

from __future__ import annotations

import pytest
from _tool_sdk import marker_llm, named_round_trip, read_whole, required_round_trip
from _tool_streams import split_once_everywhere

from kvledger.engine.server.tools.calls import template_parser, tool_plan
from kvledger.engine.server.tools.parsers import CallScanner
from kvledger.engine.server.tools.protocol import Tool
from kvledger.engine.server.tools.pythonic_format import FUNCTION_CALLS, FUNCTION_CALLS_END

WEATHER = ("get_weather", '{"city": "Paris"}')
BLOCK = FUNCTION_CALLS + "\nget_weather(city='Paris')\n" + FUNCTION_CALLS_END
CASES = [  # text, content, calls: as vLLM 0.32 reads them (but the one marked)
    (FUNCTION_CALLS + "\nget_weather(city='Paris', days=3)\nget_time()\n" + FUNCTION_CALLS_END,
     "", [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")]),
    (FUNCTION_CALLS + 'get_weather(city="Paris", ok=true, none=null, n=-1, t=(1, 2))'
     + FUNCTION_CALLS_END,
     "", [("get_weather", '{"city": "Paris", "ok": true, "none": null, "n": -1, "t": [1, 2]}')]),
    ("  \nget_weather(city='Paris')\n\nget_time()", "", [WEATHER, ("get_time", "{}")]),
    (BLOCK + "\nDone.", "", [WEATHER]),  # text after the block is dropped
    ("f(x=1) then " + FUNCTION_CALLS + "g()" + FUNCTION_CALLS_END, "", [("g", "{}")]),
    # kvledger's difference: text before the tag has streamed as content (vLLM drops it)
    ("Sure.\n" + BLOCK, "Sure.", [WEATHER]),
    # a positional argument, a list, no closing tag, text that is no call: all content
    (BLOCK.replace("city=", ""), BLOCK.replace("city=", ""), []),
    (BLOCK.replace("get_weather(city='Paris')", "[get_weather(city='Paris')]"),
     BLOCK.replace("get_weather(city='Paris')", "[get_weather(city='Paris')]"), []),
    (FUNCTION_CALLS + "\nget_time()\n", FUNCTION_CALLS + "\nget_time()", []),
    ("get_weather(city='Paris')\nThat is all.", "get_weather(city='Paris')\nThat is all.", []),
    ("get_weather is a tool (see docs)", "get_weather is a tool (see docs)", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_calls_are_read_as_vllm_reads_them_whole_and_streamed(text, content, calls) -> None:
    scanner = CallScanner("olmo3")
    assert read_whole(scanner, text) == (content, calls)
    for cut, got_content, got_calls in split_once_everywhere(lambda: CallScanner("olmo3"),
                                                             text):
        assert (got_content, got_calls) == (content, calls), cut


def test_content_streams_unless_the_answer_may_be_calls() -> None:
    scanner = CallScanner("olmo3")
    assert scanner.feed("Sure, let me", False) == ["Sure, let me"]
    assert scanner.feed("Sure, let me <function_c", False) == []  # a blank, maybe the tag
    assert scanner.feed("Sure, let me <function_cx", False) == [" <function_cx"]
    held = CallScanner("olmo3")
    assert held.feed("get_weather(city='Paris') is", False) == []  # calls until the end


def test_the_template_chooses_the_format() -> None:
    template = "{{- '<function_calls>' + tool_calls + '</function_calls>' }}"
    assert template_parser(template) == "olmo3"
    assert template_parser("{{- '<｜DSML｜function_calls>' }}") == "hermes"


def test_the_grammar_writes_one_call_a_line_in_the_tags() -> None:
    tools = [Tool.model_validate({"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "required": ["s"], "properties": {
            "s": {"type": "string"}, "k": {"type": "integer"}}}}})]
    specials = {FUNCTION_CALLS: 7, FUNCTION_CALLS_END: 8}
    plan = tool_plan(tools, "required", True, auto_enabled=False, parser="olmo3",
                     chat_template=None, specials=specials)
    assert plan.kept_ids == frozenset({7, 8})
    assert plan.grammar.startswith('start: <[7]> "\\n" call ("\\n" call)* "\\n" <[8]>\n')
    assert 'call_0: "f(" a_0_first_0 ")"' in plan.grammar


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return marker_llm(tiny_llama_dir, tmp_path_factory, "olmo3",
                      [FUNCTION_CALLS, FUNCTION_CALLS_END])


async def test_required_calls_are_written_and_read_in_olmo3_format(sdk_serve, llm) -> None:
    await required_round_trip(sdk_serve, llm, "olmo3", FUNCTION_CALLS)


async def test_a_named_function_is_called_once(sdk_serve) -> None:
    await named_round_trip(sdk_serve, "olmo3")
