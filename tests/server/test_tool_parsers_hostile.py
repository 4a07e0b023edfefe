"""Tool-call readers on answers a client steers (logit_bias, a prompt, an adapter): the
text a reader searches costs the answer's length once, whatever markup the model repeats.

``CallScanner.feed`` runs on the server's event loop, so a reader that searches the whole
rest of the answer at every tag holds every other tenant's requests for a time quadratic
in the attacker's answer: qwen3_coder looked for ``<function=`` to the end after each
``<tool_call>`` (and for ``<tool_call>`` after each ``<function=``), 4 s for 16,000
``<tool_call></tool_call>`` (368,000 characters, 32,000 tokens)."""

from __future__ import annotations

import time

import pytest

from kvledger.engine.server.tools.deepseek_format import CALL_BEGIN, CALL_END, CALLS_BEGIN, SEP
from kvledger.engine.server.tools.glm_format import KEY_END, KEY_START, VALUE_START
from kvledger.engine.server.tools.internlm_format import ACTION_END, CALL_START
from kvledger.engine.server.tools.jamba_format import TAG_END, TAG_START
from kvledger.engine.server.tools.kimi_format import ARGUMENT_BEGIN as KIMI_ARGUMENTS
from kvledger.engine.server.tools.kimi_format import CALL_BEGIN as KIMI_CALL
from kvledger.engine.server.tools.kimi_format import SECTION_BEGIN as KIMI_SECTION
from kvledger.engine.server.tools.longcat_format import TAG_END as LONGCAT_END
from kvledger.engine.server.tools.longcat_format import TAG_START as LONGCAT_START
from kvledger.engine.server.tools.parsers import CallScanner
from kvledger.engine.server.tools.step3_format import CALLS_BEGIN as STEP3_BLOCK
from kvledger.engine.server.tools.step3_format import CALLS_END as STEP3_BLOCK_END
from kvledger.engine.server.tools.step3_format import INVOKE as STEP3_INVOKE


class Searched(str):
    """A text that counts the characters its ``find`` calls read (to the match or the
    end), on the class so the slices readers take stay plain strings."""

    read = 0

    def find(self, sub, start=None, end=None):
        at = super().find(sub, start, end)
        begin = 0 if start is None else start
        Searched.read += (at + len(sub) if at >= 0 else len(self)) - begin
        return at


REPEATS = {
    "qwen3_coder": ("<tool_call></tool_call>", "<function=a></function>",
                    "<tool_call><function=f>\n<parameter=x>\n1\n</parameter>\n</function>"
                    "</tool_call>", "text <tool_call>"),
    "seed_oss": ("<seed:tool_call></seed:tool_call>", "<seed:tool_call><function=f>\n"
                 "<parameter=x>\n1\n</parameter>\n</function></seed:tool_call>",
                 "<seed:tool_call><tool_call>", "text <seed:tool_call>"),
    "hermes": ("<tool_call></tool_call>", "<tool_call>{}</tool_call>"),
    "mistral": ("[TOOL_CALLS]", "[TOOL_CALLS]f[ARGS]{}"),
    # vLLM's DeepSeek patterns as regexes backtrack over a line of call markers: 32 s to
    # stream 1,000 <｜tool▁call▁begin｜> (a regex search from the last call each step)
    "deepseek_v31": (CALLS_BEGIN + CALL_BEGIN, CALLS_BEGIN + CALL_BEGIN + "f" + SEP,
                     CALL_BEGIN + "f" + SEP + "{}" + CALL_END + CALL_BEGIN),
    "deepseek_v3": (CALLS_BEGIN + CALL_BEGIN, CALL_BEGIN + "function" + SEP + "f"),
    "kimi_k2": (KIMI_SECTION, KIMI_SECTION + KIMI_CALL, KIMI_CALL + "f:0" + KIMI_ARGUMENTS,
                KIMI_CALL + "f" + KIMI_ARGUMENTS + '"name" : "name"  ', " " * 50 + "x"),
    # a call is read whole at its end: its pairs, keys that no <arg_value> follows
    "glm45": ("<tool_call>", "<tool_call>f</tool_call>", "<tool_call>f" + KEY_START,
              KEY_START + "k" + KEY_END + " " * 20, KEY_START + "k" + KEY_END + VALUE_START,
              KEY_END + "  x", " " * 50 + "x", "<tool_call>" + '"name" : "name"  '),
    # markers cut at each '<', '"', "'", '>'; a call's parameters read whole at its end
    "minimax_m2": ("<minimax:tool_call>", "<invoke name=", '<invoke name="f', '">', "'>>",
                   '<invoke name="f"><parameter name="k', "<parameter name=k>v",
                   "< parameter  name = 'k' >v</ parameter >", " " * 50 + "x",
                   '<invoke name="">"name" : "name"  ', "<think>"),
    # a block is read whole at its end (its calls: below)
    "step3": (STEP3_BLOCK, STEP3_BLOCK + STEP3_BLOCK_END, " " * 50 + "x",
              STEP3_BLOCK + STEP3_INVOKE + "f" + STEP3_BLOCK_END + " "),
    # the content before a marker as it streams (the answer is read whole once, timed below)
    "xlam": ("x" * 50 + " ", "a " + "[TOOL_CALLS" * 3, "a </think"),
    # a block is read whole at its end, jamba's at its closing tag, the others' calls at
    # the answer's end (vLLM's lazy patterns, <think>(.*?)</think> among them, read forward)
    "jamba": (TAG_START, TAG_START + "[" + TAG_END, TAG_START + "[]" + TAG_END + " x",
              " " * 50 + "x", "a <tool_calls"),
    "hunyuan_a13b": (TAG_START, TAG_START + "[]" + TAG_END, "<think>" + TAG_START + "[]"
                     + TAG_END, "<think>", "</think>" + TAG_START, "助手：", "助手" + TAG_START,
                     " " * 50 + "x"),
    "internlm": (CALL_START, CALL_START + "{", CALL_START + '{"name": "f"}' + ACTION_END,
                 "<|action_start|>", " " * 50 + "x"),
    "longcat": (LONGCAT_START, LONGCAT_START + LONGCAT_END, LONGCAT_START + '{"name": "f", '
                '"arguments": {}}' + LONGCAT_END + " x", "a <longcat_tool"),
}


def fed_in_steps(parser: str, text: str, step: int = 997, start: int = 0):
    """A scanner of ``parser`` fed ``text`` as a stream, ``step`` characters more each
    time, then whole: the scanner and the seconds it took."""
    scanner = CallScanner(parser)
    started = time.perf_counter()
    for end in range(start, len(text), step):
        scanner.feed(text[:end], False)
    scanner.feed(text, True)
    return scanner, time.perf_counter() - started


@pytest.mark.parametrize(("parser", "unit"), [(p, u) for p, units in REPEATS.items()
                                              for u in units])
@pytest.mark.parametrize("stream", [False, True])
def test_repeated_markup_is_searched_once(parser: str, unit: str, stream: bool) -> None:
    text = unit * 4000
    scanner = CallScanner(parser)
    Searched.read = 0
    if stream:  # fed as the engine feeds it: the whole text so far, a piece at a time
        for end in range(len(unit) * 2, len(text), 97):
            scanner.feed(Searched(text[:end]), False)
    scanner.feed(Searched(text), True)
    if not stream:
        assert Searched.read <= 4 * len(text), (parser, unit, Searched.read)
    else:  # each feed may look again at what a marker's start held back (< a marker)
        assert Searched.read <= 4 * len(text) + 64 * (len(text) // 97), (
            parser, unit, Searched.read)


@pytest.mark.parametrize("parser", ["deepseek_v31", "deepseek_v3"])
def test_a_line_of_call_markers_does_not_backtrack(parser: str) -> None:
    # A regex's search is not seen by Searched: timed instead, with a margin of 100x
    # (vLLM's patterns as regexes took 32 s to stream 1,000 markers, 0.1 s whole).
    text = CALLS_BEGIN + (CALL_BEGIN + "f" + SEP) * 2000
    scanner, seconds = fed_in_steps(parser, text, step=16, start=len(CALLS_BEGIN))
    assert seconds < 2.0
    assert scanner.calls == []


@pytest.mark.parametrize("unit", ["<arg_key>k</arg_key>   ", "<arg_key>k</arg_key><arg_value>v",
                                  "<arg_key>k</arg_key><arg_value>v</arg_value>"])
def test_glm_pairs_are_read_in_one_pass(unit: str) -> None:
    # A call's pairs are read from its text (a slice, unseen by Searched): timed, with a
    # margin of 30x over the 12-64 ms one pass takes here.
    text = "<tool_call>f" + unit * 20000 + "</tool_call>"
    scanner, seconds = fed_in_steps("glm45", text)
    assert seconds < 2.0
    assert [c.name for c in scanner.calls] == ["f"]


@pytest.mark.parametrize("unit", ["<parameter name=\"k", "<parameter name=k>v",
                                  "<parameter name='k'   ", "< parameter name = k>v</parameter",
                                  "<parameter name=\"k\">v</parameter>", '"', "<"])
def test_minimax_parameters_are_read_in_one_pass(unit: str) -> None:
    # A call's parameters are read from its text at its end (regexes and slices unseen by
    # Searched): timed, with a margin of 100x over the 2-20 ms one pass takes here (a
    # reader searching again from each '<' would read 10^9 characters).
    text = '<invoke name="f">' + unit * 2000 + "</invoke>"
    scanner, seconds = fed_in_steps("minimax_m2", text)
    assert seconds < 2.0
    assert [c.name for c in scanner.calls] == ["f"]


@pytest.mark.parametrize(("unit", "names"), [
    ("<｜tool_call_begin｜>function<｜tool_sep｜>" + STEP3_INVOKE, []),
    ("<｜tool_call_begin｜>function<｜tool_sep｜>" + STEP3_INVOKE + 'f"x', []),
    ('<steptml:parameter name="k', ["f"]), ('<steptml:parameter name="k">v', ["f"]),
    ('<steptml:parameter name="k">v</steptml:parameter>', ["f"]),
    (STEP3_INVOKE + 'f">', ["f"])])
def test_step3_blocks_are_read_in_one_pass(unit: str, names: list[str]) -> None:
    # A block's calls are read from its text (a slice, unseen by Searched): timed, with
    # a margin of 100x over the 10 ms at most one pass takes here.
    call = "<｜tool_call_begin｜>function<｜tool_sep｜>" + STEP3_INVOKE + 'f">'
    text = STEP3_BLOCK + call + unit * 4000 + "<｜tool_call_end｜>" + STEP3_BLOCK_END
    scanner, seconds = fed_in_steps("step3", text)
    assert seconds < 2.0
    assert [c.name for c in scanner.calls] == names


@pytest.mark.parametrize("unit", ["```", "```json ", "[TOOL_CALLS]", "<tool_call>", "</think>",
                                  "<tool_call>[]</tool_call>", "```[]```", "[", "{"])
def test_xlam_answers_are_read_in_one_pass(unit: str) -> None:
    # vLLM's lazy patterns (```[\s\S]*?```) search to the end from every fence: timed,
    # with a margin of 100x over the 10 ms at most one reading takes here; deep nesting
    # ([[[...) makes vLLM's parser fail, so the answer is content, never an error.
    text = "x " + unit * 4000
    scanner, seconds = fed_in_steps("xlam", text)
    assert seconds < 2.0
    assert scanner.calls == [] and scanner.content


@pytest.mark.parametrize(("parser", "text", "names"), [
    ("jamba", TAG_START + "[" + '{"name": "f", "arguments": {}}, ' * 4000 + "1]" + TAG_END, []),
    ("jamba", TAG_START * 4000 + TAG_END * 4000, []),
    ("hunyuan_a13b", ("<think>" + TAG_START + "[{" + TAG_END) * 4000, []),
    ("hunyuan_a13b", "<think>" * 4000 + (TAG_START + "[]" + TAG_END) * 4000 + "</think>", []),
    ("hunyuan_a13b", "助手：" * 4000 + (TAG_START + "[" + TAG_END) * 4000 + TAG_START
     + '[{"name": "f", "arguments": {}}]' + TAG_END, ["f"]),
    ("internlm", (CALL_START + '{"name": "f"}' + ACTION_END) * 4000, ["f"] * 4000),
    ("internlm", CALL_START + "{" * 4000 + ACTION_END * 4000, []),
    ("longcat", (LONGCAT_START + '{"name": "f", "arguments": {}}' + LONGCAT_END) * 4000,
     ["f"] * 4000),
    ("longcat", LONGCAT_START * 4000 + "x", []),
])
def test_tagged_json_answers_are_read_in_one_pass(parser: str, text: str,
                                                  names: list[str]) -> None:
    # The calls are read from slices at the end (unseen by Searched): timed, with a margin
    # of 100x over the 20 ms at most one reading takes here (vLLM's lazy patterns search to
    # the end again from each opening tag that no closing one follows).
    scanner, seconds = fed_in_steps(parser, text)
    assert seconds < 2.0
    assert [c.name for c in scanner.calls] == names
