"""poolside_v1: GLM-4's <tool_call> with <arg_key>/<arg_value> pairs read as vLLM 0.32's
``PoolsideV1ToolParser`` reads a whole answer (each case's answer is its own, with the
request's tools: no name checked, a value kept as written where the schema's type is
"string", else JSON or a Python literal), streams that add up to the whole at every
split, and ``required``/named calls written in GLM's layout by a tiny model whose
tokenizer holds the markers as added tokens, through the SDK."""

from __future__ import annotations

import pytest
from _tool_sdk import marker_llm, named_round_trip, read_whole, required_round_trip
from _tool_streams import split_once_everywhere

from kvledger.engine.server.tools.calls import tool_plan
from kvledger.engine.server.tools.glm_format import CALL_END, CALL_START, MARKERS
from kvledger.engine.server.tools.parsers import CallScanner
from kvledger.engine.server.tools.protocol import Tool
from kvledger.engine.server.validation import Refusal

DECLARED = [Tool.model_validate(t) for t in [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "maybe": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "get_time"}}]]


def kv(key: str, value: str) -> str:
    return f"<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n"


C, E = CALL_START, CALL_END
CASES = [  # text, with the tools declared, content, calls: as vLLM 0.32's parser answers
    ("Let me check.\n" + C + "get_weather\n" + kv("city", " Paris ") + kv("days", " 3 ") + E,
     True, "Let me check.", [("get_weather", '{"city": " Paris ", "days": 3}')]),
    # any name; values JSON, else Python literals, else the text; text after calls dropped
    ("  Hi " + C + "unknown\n" + kv("a", "[1, 2]") + kv("b", "(1, 'x')") + kv("c", "None")
     + kv("d", "abc") + E + " bye", True,
     "  Hi", [("unknown", '{"a": [1, 2], "b": [1, "x"], "c": null, "d": "abc"}')]),
    # only "type": "string" keeps the text; without tools nothing does
    (C + "get_weather\n" + kv("city", "1") + kv("maybe", " 1 ") + E + "\n" + C + "get_time" + E,
     True, "", [("get_weather", '{"city": "1", "maybe": 1}'), ("get_time", "{}")]),
    (C + "get_weather\n" + kv("city", "1") + E, False, "", [("get_weather", '{"city": 1}')]),
    # blanks alone name a call ""; a later <tool_call> inside a call is searched
    (C + " \n " + kv("a", "1") + E, True, "", [("", '{"a": 1}')]),
    (C + "a" + C + "get_time" + E, True, "", [("get_time", "{}")]),
    # no closing tag, a line break or a '<' in the name, a set: all content
    ("Hi " + C + "get_time", True, "Hi " + C + "get_time", []),
    (C + "get weather\nx" + E, True, C + "get weather\nx" + E, []),
    (C + "get_time<x>" + E + " after", True, C + "get_time<x>" + E + " after", []),
    (C + "get_time\n" + kv("s", "{1, 2}") + E + C + "get_time" + E, True,
     C + "get_time\n" + kv("s", "{1, 2}") + E + C + "get_time" + E, []),
]


@pytest.mark.parametrize(("text", "declared", "content", "calls"), CASES)
def test_calls_are_read_as_vllm_reads_them_whole_and_streamed(text, declared, content,
                                                              calls) -> None:
    tools = DECLARED if declared else ()
    scanner = CallScanner("poolside_v1", None, tools)
    assert read_whole(scanner, text) == (content, calls)
    for cut, got_content, got_calls in split_once_everywhere(
            lambda: CallScanner("poolside_v1", None, tools), text):
        assert (got_content, got_calls) == (content, calls), cut


def test_content_streams_until_the_first_call() -> None:
    scanner = CallScanner("poolside_v1")
    assert scanner.feed("Sure.<tool_c", False) == ["Sure."]
    assert scanner.feed("Sure.<tool_call>get_time</tool_call> more", False) == []


def test_the_grammar_writes_glm_calls_strings_bare_only_where_typed_string() -> None:
    tools = [Tool.model_validate({"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "required": ["s"], "properties": {
            "s": {"type": "string"}, "n": {"type": ["string", "null"]}}}}})]
    plan = tool_plan(tools, "required", True, auto_enabled=False, parser="poolside_v1",
                     chat_template=None)
    glm = tool_plan(tools, "required", True, auto_enabled=False, parser="glm45",
                    chat_template=None)
    assert plan.grammar.splitlines()[:3] == glm.grammar.splitlines()[:3]  # start, call, s
    assert "%json" in plan.grammar.split("p_0_1:")[1] and "%json" not in glm.grammar
    bad = [Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {" k": {"type": "integer"}}}}})]
    with pytest.raises(Refusal, match="neither begins nor ends blank"):
        tool_plan(bad, "required", True, auto_enabled=False, parser="poolside_v1",
                  chat_template=None)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return marker_llm(tiny_llama_dir, tmp_path_factory, "poolside", list(MARKERS))


async def test_required_calls_are_written_and_read_in_glm_layout(sdk_serve, llm) -> None:
    await required_round_trip(sdk_serve, llm, "poolside_v1", CALL_START)


async def test_a_named_function_is_called_once(sdk_serve) -> None:
    await named_round_trip(sdk_serve, "poolside_v1")
