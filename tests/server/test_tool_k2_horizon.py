"""k2_horizon: K2 Horizon's group of calls, GLM's pairs in IFM's tags, read back as vLLM
0.32's ``K2HorizonToolParser`` reads a whole answer in its default ``xml`` layout (each
case's answer is its own, with the request's tools: anything malformed anywhere in the
group makes the whole answer content), streams that add up to the whole at every split,
another layout asked of the template refused, and ``required``/named calls written in it
by a tiny model whose tokenizer holds the tags as added tokens, through the SDK."""

from __future__ import annotations

import openai
import pytest
from _tool_sdk import marker_llm, named_round_trip, read_whole, required_round_trip
from _tool_streams import split_once_everywhere
from test_tool_calls_sdk import ASK, TOOLS

from kvledger.engine.server.tools.calls import template_parser, tool_plan
from kvledger.engine.server.tools.k2_horizon_format import (
    CALL_END,
    CALL_START,
    GROUP_END,
    GROUP_START,
    MARKERS,
    PAIRS,
)
from kvledger.engine.server.tools.parsers import CallScanner
from kvledger.engine.server.tools.protocol import Tool
from kvledger.engine.server.validation import Refusal

DECLARED = [Tool.model_validate(t) for t in [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "n": {"type": "number"},
            "maybe": {"type": ["integer", "null"]}, "deep": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "get_time"}}]]


def kv(key: str, value: str) -> str:
    return f"{PAIRS.key_start}{key}{PAIRS.key_end}{PAIRS.value_start}{value}{PAIRS.value_end}"


def group(*calls: str) -> str:
    return GROUP_START + "".join(CALL_START + c + CALL_END for c in calls) + GROUP_END


TYPED = (PAIRS.key_start + "days" + PAIRS.key_end + PAIRS.type_start + "integer"
         + PAIRS.type_end + PAIRS.value_start + "3" + PAIRS.value_end)
CASES = [  # text, with the tools declared, content, calls: as vLLM 0.32's parser answers
    ("Let me check." + group("get_weather" + kv("city", " Paris ") + kv("days", " 3 "),
                             "get_time") + " Done.", True,
     "Let me check. Done.", [("get_weather", '{"city": " Paris ", "days": 3}'),
                             ("get_time", "{}")]),
    (GROUP_START + "\n" + CALL_START + "get_weather\n" + kv("maybe", " null ") + "\n"
     + kv("deep", '{"n": 1}') + kv("n", "inf") + CALL_END + "\n" + GROUP_END, True,
     "", [("get_weather", '{"maybe": null, "deep": {"n": 1}, "n": "inf"}')]),
    (group("nope"), False, "", [("nope", "{}")]),  # any name when none is declared
    # an undeclared name, a key twice, a type, text between calls, no end: all content
    (group("nope"), True, group("nope"), []),
    (group("get_weather" + kv("city", "a") + kv("city", "b")), True,
     group("get_weather" + kv("city", "a") + kv("city", "b")), []),
    (group("get_weather" + TYPED), True, group("get_weather" + TYPED), []),
    ("Hi " + group("get_time")[:-len(GROUP_END)] + " x" + GROUP_END, True,
     "Hi " + group("get_time")[:-len(GROUP_END)] + " x" + GROUP_END, []),
    ("Hi " + GROUP_START + CALL_START + "get_time" + CALL_END, True,
     "Hi " + GROUP_START + CALL_START + "get_time" + CALL_END, []),
]


@pytest.mark.parametrize(("text", "declared", "content", "calls"), CASES)
def test_calls_are_read_as_vllm_reads_them_whole_and_streamed(text, declared, content,
                                                              calls) -> None:
    tools = DECLARED if declared else ()
    scanner = CallScanner("k2_horizon", None, tools)
    assert read_whole(scanner, text) == (content, calls)
    for cut, got_content, got_calls in split_once_everywhere(
            lambda: CallScanner("k2_horizon", None, tools), text):
        assert (got_content, got_calls) == (content, calls), cut


def test_the_template_chooses_the_format_and_its_xml_layout_alone_is_read() -> None:
    assert template_parser("{{- '<ifm|tool_calls><ifm|tool_call>' }}") == "k2_horizon"
    for layout in ("json", "xml_typed", 3):
        with pytest.raises(Refusal, match=r"'chat_template_kwargs\.tool_call_format'"):
            tool_plan(DECLARED, "auto", True, auto_enabled=True, parser="k2_horizon",
                      chat_template=None, template_kwargs={"tool_call_format": layout})
    plan = tool_plan(DECLARED, "required", True, auto_enabled=False, parser="k2_horizon",
                     chat_template=None, template_kwargs={"tool_call_format": "xml"})
    assert plan.grammar.startswith('start: "<ifm|tool_calls>" call ("\\n" call)* '
                                   '"</ifm|tool_calls>"\n')
    assert tool_plan(DECLARED, "auto", True, auto_enabled=True, parser="glm45",
                     chat_template=None, template_kwargs={"tool_call_format": "json"})


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return marker_llm(tiny_llama_dir, tmp_path_factory, "k2-horizon", list(MARKERS))


async def test_required_calls_are_written_and_read_in_k2_horizon_format(sdk_serve, llm) -> None:
    await required_round_trip(sdk_serve, llm, "k2_horizon", GROUP_START)


async def test_a_named_function_is_called_once(sdk_serve) -> None:
    await named_round_trip(sdk_serve, "k2_horizon")


async def test_a_layout_it_does_not_read_is_a_400(sdk_serve) -> None:
    name, client = await sdk_serve(tool_call_parser="k2_horizon")
    with pytest.raises(openai.BadRequestError, match="tool_call_format"):
        await client.chat.completions.create(
            model=name, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=20,
            extra_body={"chat_template_kwargs": {"tool_call_format": "json"}})
