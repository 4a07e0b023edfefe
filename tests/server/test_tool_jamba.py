"""jamba and hunyuan_a13b: the JSON list of calls in ``<tool_calls>`` tags, read back whole
and streamed as vLLM 0.32's ``JambaToolParser`` and ``HunyuanA13BToolParser`` read them
(checked against them on random texts), the format chosen by a template that shows it,
and ``required``/named calls written in it through the SDK by a tiny model whose
tokenizer holds the tags as added tokens."""

from __future__ import annotations

import pytest
from _tool_sdk import marker_llm, named_round_trip, read_whole, required_round_trip
from _tool_streams import split_once_everywhere

from kvledger.engine.server.tools.calls import template_parser, tool_plan
from kvledger.engine.server.tools.jamba_format import MARKERS, TAG_END, TAG_START
from kvledger.engine.server.tools.parsers import CallScanner
from kvledger.engine.server.tools.protocol import Tool

LIST = '[{"name": "f", "arguments": {"a":  "é"}}, {"name": "g", "arguments": "x"}]'
BLOCK = f"{TAG_START}{LIST}{TAG_END}"
CALLS = [("f", '{"a": "é"}'), ("g", '"x"')]  # (as json.dumps writes each)
AS_WRITTEN = [("f", '{"a": "é"}'), ("g", "x")]  # (hunyuan's: a string as written)
JAMBA = [
    ("no calls", "no calls", []),
    (f" Sure. {BLOCK} after", " Sure.", CALLS),
    (f"{TAG_START} [] {TAG_END} x", "", []),  # (a block of no calls: the rest dropped too)
    (f"{BLOCK}{TAG_START}[{{}}]{TAG_END}", "", CALLS),  # only the first block counts
    # no closing tag, no list of calls, a name that is no string: all content
    (f"a {TAG_START}{LIST}", f"a {TAG_START}{LIST}", []),
    (f"a {TAG_START}[1]{TAG_END} b", f"a {TAG_START}[1]{TAG_END} b", []),
    (f'{TAG_START}[{{"name": 3, "arguments": {{}}}}]{TAG_END}',
     f'{TAG_START}[{{"name": 3, "arguments": {{}}}}]{TAG_END}', []),
    (f"{TAG_START}{'[' * 100000}{TAG_END}", f"{TAG_START}{'[' * 100000}{TAG_END}", []),
]
HUNYUAN = [
    ("助手：no calls 助手：", "no calls 助手：", []),
    (f"助手：Sure. {BLOCK} after", "Sure.", AS_WRITTEN),  # (vLLM keeps that 助手：)
    (f"<think>{BLOCK}</think>\n{TAG_START}oops{TAG_END} {BLOCK} x",
     f"<think>{BLOCK}</think>\n{TAG_START}oops{TAG_END}", AS_WRITTEN),
    (f"<think>{BLOCK}", "<think>", AS_WRITTEN),  # (an unclosed <think> holds no block)
    (f'{TAG_START}[{{"name": "f", "arguments": [1]}}]{TAG_END} 助手：',
     f'{TAG_START}[{{"name": "f", "arguments": [1]}}]{TAG_END} 助手：', []),
    (f'{TAG_START}[{{"name": "f"}}, 1]{TAG_END}', "", []),  # (skipped: no call, no content)
    (f"{TAG_START}{{}}{TAG_END}", f"{TAG_START}{{}}{TAG_END}", []),  # (JSON, no list)
    (f"a {TAG_START}[{TAG_END} 助手：b", f"a {TAG_START}[{TAG_END} b", []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"),
                         [("jamba", *case) for case in JAMBA]
                         + [("hunyuan_a13b", *case) for case in HUNYUAN])
def test_calls_are_read_as_vllm_reads_them_whole_and_streamed(parser, text, content,
                                                              calls) -> None:
    scanner = CallScanner(parser)
    assert read_whole(scanner, text) == (content, calls)
    if len(text) > 300:  # (cut once everywhere: the short ones)
        return
    for cut, got_content, got_calls in split_once_everywhere(lambda: CallScanner(parser), text):
        assert (got_content, got_calls) == (content, calls), cut


def test_content_streams_until_the_block_and_jamba_calls_at_its_end() -> None:
    scanner = CallScanner("jamba")
    assert scanner.feed("Sure. <tool_ca", False) == ["Sure."]
    assert scanner.feed(f"Sure. {TAG_START}{LIST}", False) == []
    assert [c.name for c in scanner.feed(f"Sure. {BLOCK}", False)[::2]] == ["f", "g"]
    scanner = CallScanner("hunyuan_a13b")
    assert scanner.feed("助手：Hello, ", False) == ["Hello,"]
    assert scanner.feed(f"助手：Hello, {BLOCK}", False) == []


def test_the_template_chooses_the_format() -> None:
    assert template_parser("{{- '<tool_calls>' + calls + '</tool_calls>' }}") == "jamba"
    assert template_parser("以助手：开头 ... <tool_calls>[...]</tool_calls>") == "hunyuan_a13b"


@pytest.mark.parametrize("parser", ["jamba", "hunyuan_a13b"])
def test_the_grammar_writes_the_list_in_its_tags(parser: str) -> None:
    specials = {m: 10 + i for i, m in enumerate(MARKERS)}
    tools = [Tool.model_validate({"type": "function", "function": {"name": "f"}})]
    plan = tool_plan(tools, "required", True, auto_enabled=False, parser=parser,
                     chat_template=None, specials=specials)
    assert plan.grammar.splitlines()[0] == 'start: <[10]> "[" call (", " call)* "]" <[11]>'
    assert plan.kept_ids == frozenset(specials.values())


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return marker_llm(tiny_llama_dir, tmp_path_factory, "jamba", list(MARKERS))


@pytest.mark.parametrize("parser", ["jamba", "hunyuan_a13b"])
async def test_required_calls_are_written_and_read_in_the_format(sdk_serve, llm,
                                                                 parser: str) -> None:
    await required_round_trip(sdk_serve, llm, parser, TAG_START, seed=2)


@pytest.mark.parametrize("parser", ["jamba", "hunyuan_a13b"])
async def test_a_named_function_is_called_once(sdk_serve, parser: str) -> None:
    await named_round_trip(sdk_serve, parser)
