"""kimi_k2: Kimi's sections of calls read as vLLM 0.32's parser engine reads a whole answer
(its own cases and its edge cases: ids, names from the arguments, text dropped after the
section), streams that add up to the whole at every split, and ``required``/named calls
written in Kimi's format by a tiny model whose tokenizer holds Kimi's markers as added
tokens, through the SDK."""

from __future__ import annotations

import re

import pytest
from _tool_sdk import marker_llm, named_round_trip, required_round_trip
from _tool_streams import assembled, split_once_everywhere

from kvledger.engine.server.tools.calls import template_parser
from kvledger.engine.server.tools.kimi_format import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    MARKERS,
    SECTION_BEGIN,
    SECTION_END,
)
from kvledger.engine.server.tools.parsers import CallScanner

KIMI_ID = re.compile(r"^functions\.[a-z_]+:[0-9]+$")


def call(header: str, arguments: str | None, end: str = CALL_END) -> str:
    body = "" if arguments is None else ARGUMENT_BEGIN + arguments
    return f"{CALL_BEGIN}{header}{body}{end}"


CASES = [  # text, content, calls (id, name, arguments): as vLLM 0.32's parser answers
    ("Let me check." + SECTION_BEGIN + call("functions.get_weather:0", '{"city": "Paris"}')
     + SECTION_END, "Let me check.",
     [("functions.get_weather:0", "get_weather", '{"city": "Paris"}')]),
    (SECTION_BEGIN + call(" functions.a:0 \n", ' {"x": 1} \n') + call("functions.b:1", "")
     + SECTION_END, "", [("functions.a:0", "a", '{"x": 1}'), ("functions.b:1", "b", "{}")]),
    ("no section " + call("functions.f:0", "{}"), "no section " + call("functions.f:0", "{}"),
     []),
    # after the section's start, text outside calls is dropped, the section's end too
    ("Hi" + SECTION_BEGIN + "junk" + call("functions.f:0", "{}") + SECTION_END + " bye"
     + call("functions.g:1", "{}"), "Hi",
     [("functions.f:0", "f", "{}"), ("functions.g:1", "g", "{}")]),
    # the section's end closes a call too; another marker inside is part of the arguments
    (SECTION_BEGIN + call("functions.f:0", '{"q": "' + CALL_BEGIN + '"}', SECTION_END), "",
     [("functions.f:0", "f", '{"q": "' + CALL_BEGIN + '"}')]),
    # the id is the header up to its last :DIGITS, the name before its first ':'
    (SECTION_BEGIN + call("ns.tool:2:3x", "{}"), "", [("ns.tool:2:3", "ns.tool", "{}")]),
    # a header that is no id: named by the arguments' "name" (a random id), or unnamed
    (SECTION_BEGIN + call("oops", '{"name": "get_time", "x": 1}'), "",
     [(None, "get_time", '{"name": "get_time", "x": 1}')]),
    (SECTION_BEGIN + call("oops", '{"x": 1}'), "", []),
    (SECTION_BEGIN + call("get_time", ""), "", [(None, "get_time", "{}")]),
    (SECTION_BEGIN + call("functions.f:0", '{"a": 1'), "", [("functions.f:0", "f", '{"a": 1')]),
    ("<think>hm</think>ok" + SECTION_BEGIN, "<think>hm</think>ok", []),  # no reasoning parser
]


def _whole(text: str):
    scanner = CallScanner("kimi_k2")
    scanner.feed(text, final=True)
    calls = [(None if c.id.startswith("chatcmpl-tool-") else c.id, c.name, c.arguments)
             for c in scanner.calls]
    return scanner.content, calls


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_whole_answers_read_as_vllm_reads_them(text, content, calls) -> None:
    assert _whole(text) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_a_stream_adds_up_to_the_whole_answer_at_every_split(text, content, calls) -> None:
    for cut, got_content, got_calls in split_once_everywhere(lambda: CallScanner("kimi_k2"),
                                                            text):
        assert (got_content.rstrip(), got_calls) == (content, [c[1:] for c in calls]), cut


def test_a_named_call_streams_its_arguments_as_written() -> None:
    scanner = CallScanner("kimi_k2")
    text = "Sure." + SECTION_BEGIN + CALL_BEGIN + "functions.a:0" + ARGUMENT_BEGIN + ' {"x": 1, '
    first = scanner.feed(text, False)
    assert assembled(first)[:2] == ("Sure.", [("a", '{"x": 1,')])  # the space waits
    rest = scanner.feed(text + '"y": 2} ' + CALL_END, True)
    assert assembled(first + rest)[1] == [("a", '{"x": 1, "y": 2}')]
    assert scanner.calls[0].id == "functions.a:0"


def test_the_template_chooses_the_format() -> None:
    assert template_parser(f"{{{{ '{SECTION_BEGIN}' }}}}{CALL_BEGIN}") == "kimi_k2"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return marker_llm(tiny_llama_dir, tmp_path_factory, "kimi", list(MARKERS))


def kimi_id(call) -> bool:
    """Kimi's own id, naming the function it calls."""
    return bool(KIMI_ID.match(call.id)) and call.id.startswith(f"functions.{call.function.name}:")


async def test_required_calls_are_written_and_read_in_kimi_format(sdk_serve, llm) -> None:
    await required_round_trip(sdk_serve, llm, "kimi_k2", SECTION_BEGIN, kimi_id, with_ids=True)


async def test_a_named_function_is_called_once(sdk_serve) -> None:
    await named_round_trip(sdk_serve, "kimi_k2", kimi_id, with_ids=True)
