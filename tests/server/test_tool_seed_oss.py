"""seed_oss: Seed-OSS's calls, qwen3_coder's ``<function=NAME>``/``<parameter=KEY>`` in
``<seed:tool_call>``/``</seed:tool_call>`` (vLLM 0.32's ``SeedOssParser`` is its
``Qwen3Parser`` with those wrapper tags), read back whole and streamed, the format chosen
by a template that shows it, and ``required``/named calls written in it through the SDK by
a tiny model whose tokenizer holds Seed-OSS's markers as added tokens."""

from __future__ import annotations

import pytest
from _tool_sdk import VLLM_ID, marker_llm, named_round_trip, required_round_trip
from _tool_streams import split_once_everywhere
from test_tool_qwen3_coder import CASES
from test_tool_qwen3_coder import TOOLS as DECLARED

from kvledger.engine.server.tools.calls import template_parser, tool_plan
from kvledger.engine.server.tools.parsers import CallScanner
from kvledger.engine.server.tools.xml_format import QWEN3, SEED


def seed(text: str) -> str:
    """A Qwen3 answer as Seed-OSS writes it (its wrapper tags)."""
    return text.replace(QWEN3.tool_start, SEED.tool_start).replace(QWEN3.tool_end,
                                                                     SEED.tool_end)


def _read(text: str, parser: str = "seed_oss") -> tuple[str, list[tuple[str, str]]]:
    scanner = CallScanner(parser, None, DECLARED)
    scanner.feed(text, final=True)
    assert all(VLLM_ID.match(c.id) for c in scanner.calls)
    return scanner.content, [(c.name, c.arguments) for c in scanner.calls]


# Each qwen3_coder case in Seed-OSS's tags: read as vLLM's SeedOssParser reads it (checked
# against it on random texts: the same answers as Qwen3's with the tags swapped).
@pytest.mark.parametrize(("text", "content", "calls"),
                         [(seed(t), seed(c), k) for t, c, k in CASES])
def test_qwen3_coder_calls_in_seed_tags_are_read_alike(text, content, calls) -> None:
    assert _read(text) == (content, calls)
    for cut, got_content, got_calls in split_once_everywhere(
            lambda: CallScanner("seed_oss", None, DECLARED), text):
        assert (got_content, got_calls) == (content, calls), cut


def test_qwen3s_own_tags_are_text_to_seed_oss() -> None:
    weather = ("<function=get_current_weather>\n<parameter=city>\n<tool_call>\n</parameter>\n"
               "</function>")
    assert _read("a <tool_call>b</tool_call>") == ("a <tool_call>b</tool_call>", [])
    assert _read(f"{SEED.tool_start}\n{weather}\n{SEED.tool_end}") == (
        "", [("get_current_weather", '{"city": "<tool_call>"}')])
    # inside Seed's wrapper, Qwen3's closing tag is dropped text, not the wrapper's end
    assert _read(f"{SEED.tool_start}</tool_call>{weather}{SEED.tool_end}ok")[0] == "ok"
    assert _read(f"<tool_call>{weather}</tool_call>", "qwen3_coder")[1] == \
        _read(f"{SEED.tool_start}{weather}{SEED.tool_end}")[1]


def test_the_template_chooses_the_format() -> None:
    template = ("{{- '<seed:tool_call>\\n<function=' + name + '>\\n<parameter=' + key + '>' }}"
                "{{- '</function>\\n</seed:tool_call>' }}")
    assert template_parser(template) == "seed_oss"
    assert template_parser(template.replace("seed:", "")) == "qwen3_coder"


def test_the_grammar_writes_seed_oss_wrapper_tags() -> None:
    specials = {SEED.tool_start: 7, SEED.tool_end: 8, QWEN3.tool_start: 5}
    plan = tool_plan(DECLARED, "required", True, auto_enabled=False, parser=None,
                     chat_template="<seed:tool_call><function=x><parameter=y>",
                     specials=specials)
    assert plan.parser == "seed_oss" and plan.kept_ids == frozenset({7, 8})
    call = next(line for line in plan.grammar.splitlines() if line.startswith("call_0: "))
    assert call.startswith('call_0: <[7]> "\\n<function=get_current_weather>\\n"')
    assert call.endswith('"</function>\\n" <[8]>') and "<[5]>" not in plan.grammar


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return marker_llm(tiny_llama_dir, tmp_path_factory, "seed-oss",
                      [SEED.tool_start, SEED.tool_end])


async def test_required_calls_are_written_and_read_in_seed_oss_format(sdk_serve, llm) -> None:
    await required_round_trip(sdk_serve, llm, "seed_oss", SEED.tool_start)


async def test_a_named_function_is_called_once(sdk_serve) -> None:
    await named_round_trip(sdk_serve, "seed_oss")
