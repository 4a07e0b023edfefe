"""internlm: InternLM2's calls, a JSON object after ``<|action_start|><|plugin|>`` up to
``<|action_end|>``, read back whole and streamed as vLLM 0.32's ``Internlm2ToolParser``
reads them (checked against it on random texts; where it raises, as kvledger answers),
the format chosen by a template that shows it, and ``required``/named calls written in
it through the SDK by a tiny model whose tokenizer holds InternLM's markers as added
tokens."""

from __future__ import annotations

import pytest
from _tool_sdk import marker_llm, named_round_trip, read_whole, required_round_trip
from _tool_streams import split_once_everywhere

from kvledger.engine.server.tools.calls import template_parser, tool_plan
from kvledger.engine.server.tools.internlm_format import ACTION_END, CALL_START, MARKERS
from kvledger.engine.server.tools.parsers import CallScanner
from kvledger.engine.server.tools.protocol import Tool

CALL = f'{CALL_START}\n{{"name": "f", "parameters": {{"a":  "é"}}}}{ACTION_END}'
CASES = [
    ("no calls <|action_start|>", "no calls <|action_start|>", []),
    (f"Sure. {CALL}<|im_end|> after", "Sure.", [("f", '{"a": "é"}')]),
    # its arguments: parameters, else arguments, else {} (any JSON, as json.dumps writes it)
    (f'{CALL_START}x {{"name": "g", "arguments": [1,2]}}', "", [("g", "[1, 2]")]),
    (f'{CALL_START}{{"name": "g", "parameters": null, "arguments": {{}}}}', "", [("g", "null")]),
    (f'{CALL_START}{{"name": "g"}} {ACTION_END}', "", [("g", "{}")]),
    # a call vLLM's parser cannot read (it raises): all content
    (f"a {CALL_START}not json{ACTION_END}", f"a {CALL_START}not json{ACTION_END}", []),
    (f'a {CALL_START}{{"name": "f"}} x', f'a {CALL_START}{{"name": "f"}} x', []),
    (f'{CALL_START}{{"name": 1}}', f'{CALL_START}{{"name": 1}}', []),
    (f"{CALL_START}{'{' * 100000}", f"{CALL_START}{'{' * 100000}", []),
    # a second call (vLLM's parser raises): read too, or all content when one is unread
    (f"{CALL}{CALL}", "", [("f", '{"a": "é"}')] * 2),
    (f"{CALL} x {CALL_START}", f"{CALL} x {CALL_START}", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_calls_are_read_as_vllm_reads_them_whole_and_streamed(text, content, calls) -> None:
    scanner = CallScanner("internlm")
    assert read_whole(scanner, text) == (content, calls)
    if len(text) > 300:  # (cut once everywhere: the short ones)
        return
    for cut, got_content, got_calls in split_once_everywhere(
            lambda: CallScanner("internlm"), text):
        assert (got_content, got_calls) == (content, calls), cut


def test_content_streams_until_the_first_call_and_the_calls_at_the_end() -> None:
    scanner = CallScanner("internlm")
    assert scanner.feed("Sure. <|action_start|><|plu", False) == ["Sure."]
    assert scanner.feed(f"Sure. {CALL}", False) == []
    assert [c.name for c in scanner.feed(f"Sure. {CALL}", True)[::2]] == ["f"]


def test_the_template_chooses_the_format() -> None:
    template = '{{- "<|action_start|><|plugin|>\\n" }}{{- \'{"name": "\' + function.name }}'
    assert template_parser(template) == "internlm"


def test_the_grammar_writes_each_call_after_its_markers() -> None:
    specials = {m: 10 + i for i, m in enumerate(MARKERS)}
    tools = [Tool.model_validate({"type": "function", "function": {"name": "f"}})]
    plan = tool_plan(tools, "required", True, auto_enabled=False, parser="internlm",
                     chat_template=None, specials=specials)
    assert plan.grammar.splitlines()[0] == "start: call (call)*"
    assert plan.grammar.splitlines()[2].startswith(
        'call_0: <[10]> <[11]> "\\n{\\"name\\": \\"f\\", \\"arguments\\": " args_0 "}" <[12]>')
    assert plan.kept_ids == frozenset(specials.values())


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return marker_llm(tiny_llama_dir, tmp_path_factory, "internlm", list(MARKERS))


async def test_required_calls_are_written_and_read_in_internlm_format(sdk_serve, llm) -> None:
    await required_round_trip(sdk_serve, llm, "internlm", MARKERS[0], seed=2)


async def test_a_named_function_is_called_once(sdk_serve) -> None:
    await named_round_trip(sdk_serve, "internlm")
