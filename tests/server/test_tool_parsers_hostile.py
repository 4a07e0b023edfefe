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
from kvledger.engine.server.tools.poolside_format import _call as poolside_call
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
    # content up to the block's tag as it streams, then all held to the end (timed below)
    "olmo3": ("<function_calls>", "x <function_calls>", "a <function_call", "f(x=1)\n",
              "<function_calls>f()</function_calls>", " " * 50 + "x"),
    # content up to the first call as it streams, then all held to the end (timed below)
    "poolside_v1": ("<tool_call>", "x <tool_call>", "<tool_call>f</tool_call>",
                    "<tool_call>f" + KEY_START, KEY_START + "k" + KEY_END + " " * 20,
                    "<tool_call><tool_call>", " " * 50 + "x"),
    # the group is read whole at its end (its pairs: below)
    "k2_horizon": ("<ifm|tool_calls>", "x <ifm|tool_calls>", "<ifm|tool_calls></ifm|tool_calls>",
                   "<ifm|tool_calls><ifm|tool_call>f</ifm|tool_call></ifm|tool_calls>",
                   "a <ifm|tool_call", " " * 50 + "x"),
    # content before the start token as it streams, the rest at the end (timed below)
    "lfm2": ("<|tool_call_start|>", "x <|tool_call_start|>", "a <|tool_call_st",
             "[f(x=1)]<|tool_call_end|>", " " * 50 + "x"),
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
    # the content before a marker as it streams (the answer is read whole once, timed below)
    "granite": ("x" * 50 + " ", "a <|tool_call", "<|tool_call|>", "<tool_call>[", "<tool_call>]"),
    "granite4": ("x" * 50 + " ", "a <tool_call", "a </tool_call", "<tool_call>"),
    "granite-20b-fc": ("x" * 50 + " ", "a <function_call", "<function_call>"),
    "phi4_mini_json": ("x" * 50 + " ", "a functools", "functools["),
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


@pytest.mark.parametrize(("unit", "name"), [("<tool_call>x<", None), ("<tool_call> \n ", ""),
                                            ("<tool_call>\n<tool_call>", None),
                                            ("<tool_call>x\ny<arg_key>", None)])
def test_a_poolside_call_searches_its_text_once(unit: str, name: str | None) -> None:
    # vLLM's pattern is searched from each <tool_call> inside a call: each search reads
    # only up to the next '<'.
    block = Searched("<tool_call>" + unit * 4000)
    Searched.read = 0
    assert (poolside_call(block) or (None,))[0] == name
    assert Searched.read <= 4 * len(block)


@pytest.mark.parametrize("unit", ["<arg_key>k</arg_key>   ", "<arg_key>k</arg_key><arg_value>v",
                                  "<tool_call>f</tool_call>",
                                  "<arg_key>k</arg_key><arg_value>[[1]]</arg_value>"])
def test_poolside_calls_are_read_in_one_pass(unit: str) -> None:
    # The calls are read from the held text at its end (slices, unseen by Searched):
    # timed, with a margin of 20x over the 10-100 ms one pass takes here.
    text = "<tool_call>f" + unit * 1000 + "</tool_call>"
    scanner, seconds = fed_in_steps("poolside_v1", text)
    assert seconds < 2.0
    assert scanner.calls


@pytest.mark.parametrize("parser", ["olmo3", "lfm2"])
@pytest.mark.parametrize("unit", [" ", "a", "\n "])
def test_an_answer_read_a_character_at_a_time_is_read_once(parser: str, unit: str) -> None:
    # Blanks, or a name, that keep the answer's reading undecided are read on from where
    # the last feed stopped (read again at each feed: 2 * 10^8 characters here). Timed,
    # with a margin of 10x over the 0.2 s 20,000 feeds take here.
    text = unit * (20000 // len(unit))
    scanner, seconds = fed_in_steps(parser, text, step=1, start=1)
    assert seconds < 2.0
    assert (scanner.calls, scanner.content) == ([], text.strip())


@pytest.mark.parametrize("unit", ["f(x=1)\n", "<function_calls>", "f(x='" + "(" * 20,
                                  "<function_calls>f(x=[1])\n", "f(x=" + "[" * 50])
def test_olmo3_answers_are_read_in_one_pass(unit: str) -> None:
    # An answer that may be calls is parsed once, at its end: timed (the parse of 4,000
    # calls takes 0.1-0.3 s here, beside other work; the rest 20 ms at most).
    text = unit * 4000
    scanner, seconds = fed_in_steps("olmo3", text)
    assert seconds < 2.0
    assert scanner.calls or scanner.content


@pytest.mark.parametrize("unit", ["<ifm|arg_key>k</ifm|arg_key>   ", "<ifm|arg_key>k</ifm|arg_key>"
                                  "<ifm|arg_type>t</ifm|arg_type>x",
                                  "<ifm|arg_key>k</ifm|arg_key><ifm|arg_type>t",
                                  "</ifm|arg_key><ifm|arg_type>t</ifm|arg_type> ",
                                  "</ifm|arg_key><ifm|arg_value>v</ifm|arg_value>"])
def test_k2_horizon_pairs_are_read_in_one_pass(unit: str) -> None:
    # A key runs to the first of its ends that a type or a value follows, a type to the
    # first of its ends that a value follows: each looked for once (a reader trying every
    # type's end after every key's end reads 10^8 characters here). Read from a slice,
    # unseen by Searched: timed, with a margin of 100x over the 20 ms one pass takes.
    text = ("<ifm|tool_calls><ifm|tool_call>f<ifm|arg_key>k" + unit * 4000
            + "<ifm|arg_value>v</ifm|arg_value></ifm|tool_call></ifm|tool_calls>")
    scanner, seconds = fed_in_steps("k2_horizon", text)
    assert seconds < 2.0
    assert scanner.calls or scanner.content


@pytest.mark.parametrize("unit", ["'a', ", "x='a 'b' c', ", "from=1, ", "07, ", "'\n', ",
                                  "'a '", "\\'", "f(x=1), "])
def test_lfm2_rewrites_read_the_calls_in_one_pass(unit: str) -> None:
    # Calls that do not parse are rewritten, each rewrite one pass; a broken string is
    # tried closed at most MAX_ENDS_TRIED places (vLLM's looks for each string's end to
    # the end of the text, and parses it all once per place the broken one may end:
    # 10^8 characters here). Timed, with a margin of 100x over the 20 ms one pass takes.
    text = "<|tool_call_start|>[f(" + unit * 4000 + "y=1)]]<|tool_call_end|>"
    scanner, seconds = fed_in_steps("lfm2", text)
    assert seconds < 2.0
    assert scanner.calls or scanner.content


CALL = '{"name": "f", "arguments": {}}'


@pytest.mark.parametrize(("parser", "head", "unit", "calls"), [
    ("granite4", "", f"<tool_call>{CALL}</tool_call>", 400), ("granite4", "", "<tool_call>", 0),
    ("granite4", "", "</tool_call> ", 0), ("granite4", "<tool_call>", "[", 0),
    ("granite-20b-fc", "", f"<function_call> {CALL}", 400),
    ("granite-20b-fc", "", "<function_call>", 0), ("granite-20b-fc", "<function_call>", "[", 0),
    ("granite-20b-fc", "<function_call>", " ", 0),
    ("phi4_mini_json", f"functools[{CALL}", f", {CALL}", 401),
    ("phi4_mini_json", "", "functools[", 0), ("phi4_mini_json", "functools[", "[", 0),
    ("phi4_mini_json", "functools[", f"{CALL}]", 1),
    ("granite", "<|tool_call|>[", f"{CALL}, ", 400), ("granite", "", "<tool_call>", 0),
    ("granite", "", "<|tool_call|>[]", 0), ("granite", "<tool_call>[", "{", 0),
    ("granite", "<tool_call>[{", '"name" : ', 1), ("granite", "<tool_call>[{", '"arguments": ', 0),
    ("granite", "<tool_call>[", '{"name": ""}', 0)])
def test_json_answers_read_whole_are_read_in_one_pass(parser: str, head: str, unit: str,
                                                      calls: int) -> None:
    # The answer is read once at its end (slices and JSON decoding unseen by Searched):
    # timed, with a margin of 100x over the 15 ms at most one reading takes here (400
    # calls, or 4,000 repeats of markup that makes none); deep nesting makes vLLM's
    # parsers fail, so the answer is content, never an error.
    repeats = 400 if calls > 1 else 4000
    text = "x " + head + unit * repeats + ("]" if parser == "phi4_mini_json" and calls else "")
    scanner = CallScanner(parser)
    started = time.perf_counter()
    scanner.feed(text, True)
    assert time.perf_counter() - started < 2.0
    assert len(scanner.calls) == calls
