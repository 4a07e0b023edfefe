"""longcat: LongCat-Flash's calls, JSON objects in ``<longcat_tool_call>`` tags, read back
whole and streamed as vLLM 0.32's ``LongcatFlashToolParser`` reads them (its hermes
parser in these tags, all the calls or none; checked against it on random texts), the
format chosen by a template that shows it, and ``required``/named calls written in it
through the SDK by a tiny model whose tokenizer holds the tags as added tokens."""

from __future__ import annotations

import pytest
from _tool_sdk import marker_llm, named_round_trip, read_whole, required_round_trip
from _tool_streams import split_once_everywhere

from kvledger.engine.server.tools.calls import template_parser, tool_plan
from kvledger.engine.server.tools.longcat_format import MARKERS, TAG_END, TAG_START
from kvledger.engine.server.tools.parsers import CallScanner
from kvledger.engine.server.tools.protocol import Tool

CALL = f'{TAG_START}\n{{"name": "f", "arguments": {{"a":  1.5e3}}}}\n{TAG_END}'
CASES = [
    ("no calls", "no calls", []),
    (f"Sure. {CALL} x {TAG_START}{{\"name\": \"g\", \"arguments\": \"s\"}}",
     "Sure.", [("f", '{"a": 1500.0}'), ("g", '"s"')]),  # (as json.dumps writes them)
    # one call vLLM's parser cannot read: the whole answer is content
    (f"{CALL}{TAG_START}{TAG_END}", f"{CALL}{TAG_START}{TAG_END}", []),
    (f'a {TAG_START}{{"name": "f"}}{TAG_END}', f'a {TAG_START}{{"name": "f"}}{TAG_END}', []),
    (f"{CALL}<tool_call>", "", [("f", '{"a": 1500.0}')]),  # (text after a call: dropped)
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_calls_are_read_as_vllm_reads_them_whole_and_streamed(text, content, calls) -> None:
    scanner = CallScanner("longcat")
    assert read_whole(scanner, text) == (content, calls)
    for cut, got_content, got_calls in split_once_everywhere(
            lambda: CallScanner("longcat"), text):
        assert (got_content, got_calls) == (content, calls), cut


def test_the_template_chooses_the_format() -> None:
    assert template_parser("{{- '<longcat_tool_call>\\n' + call + '</longcat_tool_call>' }}") \
        == "longcat"


def test_the_grammar_writes_each_call_in_its_tags() -> None:
    specials = {m: 10 + i for i, m in enumerate(MARKERS)}
    tools = [Tool.model_validate({"type": "function", "function": {"name": "f"}})]
    plan = tool_plan(tools, "required", True, auto_enabled=False, parser="longcat",
                     chat_template=None, specials=specials)
    assert plan.grammar.splitlines()[0] == 'start: call ("\\n" call)*'
    assert plan.grammar.splitlines()[2].startswith('call_0: <[10]> "\\n{\\"name\\": \\"f\\", ')


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return marker_llm(tiny_llama_dir, tmp_path_factory, "longcat", list(MARKERS))


async def test_required_calls_are_written_and_read_in_longcat_format(sdk_serve, llm) -> None:
    await required_round_trip(sdk_serve, llm, "longcat", TAG_START, seed=2)


async def test_a_named_function_is_called_once(sdk_serve) -> None:
    await named_round_trip(sdk_serve, "longcat")
