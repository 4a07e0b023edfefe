"""deepseek_v3 and deepseek_v31: DeepSeek's calls read as vLLM 0.32's parsers read a whole
answer (cases from vLLM's own tests and its code's edge cases), streams that add up to
the whole at every split, and ``required``/named calls written in DeepSeek's format by a
tiny model whose tokenizer holds DeepSeek's markers as added tokens, through the SDK."""

from __future__ import annotations

import pytest
from _tool_sdk import marker_llm, named_round_trip, required_round_trip
from _tool_streams import assembled, split_once_everywhere

from kvledger.engine.server.tools.calls import template_parser
from kvledger.engine.server.tools.deepseek_format import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    MARKERS,
    SEP,
)
from kvledger.engine.server.tools.parsers import CallScanner
from kvledger.engine.settings.tool_parsers import REFUSED_TOOL_PARSERS, VLLM_TOOL_PARSERS
from kvledger.engine.settings.vllm_rules import PARSERS


def v3(name: str, arguments: str, kind: str = "function") -> str:
    return f"{CALL_BEGIN}{kind}{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def v31(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"


CASES = [  # parser, text, content, calls: as vLLM 0.32's extract_tool_calls answers
    ("deepseek_v31", "Let me check." + CALLS_BEGIN + v31("foo", '{"x":1}') + CALLS_END,
     "Let me check.", [("foo", '{"x":1}')]),
    ("deepseek_v31", CALLS_BEGIN + v31("foo", '{"x":1}') + v31("bar", '{"y":2}') + CALLS_END,
     "", [("foo", '{"x":1}'), ("bar", '{"y":2}')]),
    ("deepseek_v31", "no calls " + v31("foo", "{}"), "no calls " + v31("foo", "{}"), []),
    # the calls are found in the whole answer, the content before the marker kept
    ("deepseek_v31", v31("a", "{}") + CALLS_BEGIN + v31("b", "{}"), v31("a", "{}"),
     [("a", "{}"), ("b", "{}")]),
    ("deepseek_v31", CALLS_BEGIN + CALL_BEGIN + "f" + SEP + '{"a":\n1}' + CALL_END, "", []),
    ("deepseek_v31", CALLS_BEGIN + CALL_BEGIN + "f" + SEP + '{"a": 1', "", []),  # cut off
    ("deepseek_v3", "Hi" + CALLS_BEGIN + v3("get_weather", '{"city": "Paris"}') + "\n"
     + v3("get_time", "{}") + CALLS_END, "Hi",
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("deepseek_v3", CALLS_BEGIN + v3("f", "not json") + CALLS_END, "", [("f", "not json")]),
    # a type other than function: vLLM's whole answer is content
    ("deepseek_v3", "Hi " + CALLS_BEGIN + v3("f", "{}") + v3("g", "{}", "tool"),
     "Hi " + CALLS_BEGIN + v3("f", "{}") + v3("g", "{}", "tool"), []),
    ("deepseek_v3", CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "f\n```json\n{\n}\n```"
     + CALL_END, "", []),  # arguments over two lines: no match
]


def _whole(parser: str, text: str):
    scanner = CallScanner(parser)
    scanner.feed(text, final=True)
    return scanner.content, [(c.name, c.arguments) for c in scanner.calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_answers_read_as_vllm_reads_them(parser, text, content, calls) -> None:
    assert _whole(parser, text) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_a_stream_adds_up_to_the_whole_answer_at_every_split(parser, text, content,
                                                             calls) -> None:
    for cut, got_content, got_calls in split_once_everywhere(lambda: CallScanner(parser), text):
        assert (got_content.rstrip(), got_calls) == (content, calls), cut


def test_v31_calls_go_out_as_each_ends() -> None:
    scanner = CallScanner("deepseek_v31")
    text = "Sure." + CALLS_BEGIN + v31("a", '{"x": 1}')
    first = scanner.feed(text, False)
    assert assembled(first)[:2] == ("Sure.", [("a", '{"x": 1}')])  # before the text ends
    rest = scanner.feed(text + v31("b", "{}") + CALLS_END, True)
    assert assembled(first + rest)[1] == [("a", '{"x": 1}'), ("b", "{}")]


def test_the_template_chooses_the_format_and_every_vllm_name_is_known() -> None:
    assert template_parser(f"{{{{ '{CALLS_BEGIN}' }}}}\n```json\n") == "deepseek_v3"
    assert template_parser(f"{{{{ '{CALLS_BEGIN}{SEP}' }}}}") == "deepseek_v31"
    assert len(VLLM_TOOL_PARSERS) == 54  # vLLM 0.32's registry
    assert {"deepseek_v3", "deepseek_v31"} <= set(PARSERS)
    assert not set(PARSERS) & set(REFUSED_TOOL_PARSERS)
    assert all(why and "\n" not in why for why in REFUSED_TOOL_PARSERS.values())


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return marker_llm(tiny_llama_dir, tmp_path_factory, "deepseek", list(MARKERS))


@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v31"])
async def test_required_calls_are_written_and_read_in_deepseek_format(sdk_serve, llm,
                                                                      parser) -> None:
    await required_round_trip(sdk_serve, llm, parser, CALLS_BEGIN)


@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v31"])
async def test_a_named_function_is_called_once(sdk_serve, parser) -> None:
    await named_round_trip(sdk_serve, parser)
