"""step3: Step-3's calls, ``<｜tool_calls_begin｜>`` blocks of steptml invokes, read back
whole and streamed as vLLM 0.32's ``Step3ToolParser`` reads them (checked against it on
random texts), the format chosen by a template that shows it, and ``required``/named
calls written in it through the SDK by a tiny model whose tokenizer holds Step's markers
as added tokens."""

from __future__ import annotations

import pytest
from _tool_sdk import marker_llm, named_round_trip, read_whole, required_round_trip
from _tool_streams import split_once_everywhere

from kvledger.engine.server.tools.calls import template_parser, tool_plan
from kvledger.engine.server.tools.parsers import CallScanner
from kvledger.engine.server.tools.protocol import Tool
from kvledger.engine.server.tools.step3_format import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    MARKERS,
    SEP,
)
from kvledger.engine.server.validation import Refusal

DECLARED = [Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "x": {"type": "number"},
        "flag": {"type": "boolean"}, "n": {"type": "null"}, "deep": {"type": "object"}}}}})]


def call(name: str, *params: tuple[str, str], kind: str = "function") -> str:
    body = "".join(f'<steptml:parameter name="{k}">{v}</steptml:parameter>' for k, v in params)
    return (f'{CALL_BEGIN}{kind}{SEP}<steptml:invoke name="{name}">{body}'
            f"</steptml:invoke>{CALL_END}")


WEATHER = call("get_weather", ("city", " Paris "), ("days", "3"), ("x", "2"),
               ("flag", "TRUE"), ("n", "null"), ("deep", '{"a": 1}'))
TYPED = ("get_weather", '{"city": "Paris", "days": 3, "x": 2.0, "flag": true, "n": null, '
         '"deep": "{\\"a\\": 1}"}')
CASES = [
    ("no calls", "no calls", []),
    (f"  Sure. {CALLS_BEGIN}{WEATHER}{CALLS_END}  done ", "Sure.   done", [TYPED]),
    (f"{CALLS_BEGIN}\n{WEATHER}\n{call('f', ('a', 'b<c'), ('a', ' 1 '))}{CALLS_END}\n ok",
     "ok", [TYPED, ("f", '{"a": "1"}')]),
    # no end of the block, or no call in it: the whole answer is content
    (f" a {CALLS_BEGIN}{WEATHER}", f" a {CALLS_BEGIN}{WEATHER}", []),
    (f" a {CALLS_BEGIN}{call('f', kind='fn')}{CALLS_END} b",
     f" a {CALLS_BEGIN}{call('f', kind='fn')}{CALLS_END} b", []),
    (f'{CALLS_BEGIN}{CALL_BEGIN} function {SEP}x<steptml:invoke name="">'
     f'<steptml:invoke name="g">{CALL_END}{CALLS_END}', "", [("g", "{}")]),
    (f"{CALLS_BEGIN}{call('get_weather', ('days', 'three'), ('x', 'inf'))}{CALLS_END}", "",
     [("get_weather", '{"days": "three", "x": "inf"}')]),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_calls_are_read_as_vllm_reads_them_whole_and_streamed(text, content, calls) -> None:
    scanner = CallScanner("step3", None, DECLARED)
    assert read_whole(scanner, text) == (content, calls)
    for cut, got_content, got_calls in split_once_everywhere(
            lambda: CallScanner("step3", None, DECLARED), text):
        assert (got_content, got_calls) == (content, calls), cut


def test_the_template_chooses_the_format() -> None:
    template = "{{- '<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜>' }}"
    assert template_parser(template) == "step3"
    assert template_parser(template.replace("_", "▁")) == "deepseek_v31"


def test_the_grammar_writes_step3_calls_and_refuses_what_it_cannot_type() -> None:
    specials = {m: 10 + i for i, m in enumerate(MARKERS)}
    tools = [Tool.model_validate({"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "required": ["s"], "properties": {
            "s": {"type": "string", "enum": ["a b"]}, "k": {"type": "integer"}}}}})]
    plan = tool_plan(tools, "required", False, auto_enabled=False, parser=None,
                     chat_template=CALLS_BEGIN, specials=specials)
    assert plan.parser == "step3" and plan.kept_ids == frozenset(specials.values())
    assert plan.grammar.startswith("start: <[10]> call <[11]>\n")
    assert 'call_0: <[12]> "function" <[14]> "<steptml:invoke name=\\"f\\">"' in plan.grammar
    assert "[^\\s<]" in plan.grammar  # a string is written as vLLM strips it
    with pytest.raises(Refusal, match="step3 call cannot write one of 'object'"):
        tool_plan(DECLARED, "required", True, auto_enabled=False, parser="step3",
                  chat_template=None)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return marker_llm(tiny_llama_dir, tmp_path_factory, "step3", list(MARKERS))


async def test_required_calls_are_written_and_read_in_step3_format(sdk_serve, llm) -> None:
    await required_round_trip(sdk_serve, llm, "step3", CALLS_BEGIN)


async def test_a_named_function_is_called_once(sdk_serve) -> None:
    await named_round_trip(sdk_serve, "step3")
