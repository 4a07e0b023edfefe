"""--reasoning-parser's promise under random outputs: what a stream sends (reasoning and
content deltas) adds up to exactly what the whole answer holds, for every rule, thinking
on or off, however the tokens are chunked into steps, and both agree on
``reasoning_tokens``. The outputs mix ordinary text, the markers (repeated, nested,
adjacent, first or last), ordinary tokens that spell a marker's text, and multi-byte
characters cut into byte-fallback tokens; the text is the engine's own
``IncrementalDetokenizer``'s, fed to the splitter as ``answer_stream`` feeds it (the whole
text and ids so far at each step).

The reference is a token-level reading of vLLM 0.32's rules (vLLM cannot be imported
here): the parser engine's transitions (``vllm/parser/qwen3.py``, ``glm47_moe.py``,
``mistral.py``...: REASONING + THINK_START: dropped; REASONING + THINK_END: to CONTENT,
dropped; CONTENT + THINK_END: dropped; CONTENT + THINK_START: to REASONING where the
grammar has it; a tool opener ends reasoning; the reasoning's trailing whitespace cut; the
tokens it read as reasoning counted, tool markup not) and ``DeepSeekR1ReasoningParser``'s
token-id streaming rule, with ``count_reasoning_tokens``' depth count.
KVLEDGER_FUZZ_EXAMPLES hunts harder.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.engine.model.detokenizer import IncrementalDetokenizer
from kvledger.engine.server.reasoning import ReasoningPlan, ReasoningTokens
from kvledger.engine.server.reasoning_rules import RULES

FUZZ = settings(max_examples=int(os.environ.get("KVLEDGER_FUZZ_EXAMPLES", "200")),
                deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

START, END, CALL, TOOL = 1000, 1001, 1002, 1003  # a rule's markers' ids


def _markers(name: str) -> dict[int, str]:
    """The rule's markers by id: start, end, implicit end, a tool marker (where the rule
    has none, Qwen's, as tokens the rule does not read), and what it requires."""
    rule = RULES[name]
    markers = {START: rule.start or "<think>", END: rule.end,
               CALL: rule.implicit_end or "<tool_call>",
               TOOL: (rule.tool_markers or ("</tool_call>",))[0]}
    extra = [text for text in rule.requires if text not in markers.values()]
    return markers | dict(enumerate(extra, TOOL + 1))  # poolside_v1's <assistant>


# Ordinary tokens (ids 1..): text, pieces that spell part of the markers' text, and (the
# last three) ordinary tokens that spell the rule's start, end and implicit end
PIECES = ["a", "b", " ", "\n", "<", ">", "/", "</", "thin", "tool", "{}", "é", "[", "]"]
FAKE_START, FAKE_END, FAKE_CALL = range(len(PIECES) + 1, len(PIECES) + 4)
BYTE_BASE = 2000  # byte-fallback tokens: 2000 + byte
WIDE = ["é", "€", "😀"]  # 2, 3 and 4 UTF-8 bytes


class ByteTokenizer:
    """A rule's markers as added tokens (special or not), ordinary text pieces, and one
    token per byte: a multi-byte character decodes only once all its bytes are there."""

    def __init__(self, special: bool, name: str = "qwen3") -> None:
        self.markers = _markers(name)
        self.texts = {i + 1: p for i, p in enumerate(PIECES)} | {
            FAKE_START: self.markers[START], FAKE_END: self.markers[END],
            FAKE_CALL: self.markers[CALL]}
        self.added_texts = dict(self.markers)
        self.special_ids = frozenset(self.markers) if special else frozenset()

    def token_to_id(self, text: str) -> int | None:
        return next((i for i, m in self.markers.items() if m == text), None)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = b""
        for i in ids:
            if i in self.markers:
                if not (skip_special_tokens and i in self.special_ids):
                    out += self.markers[i].encode()
            elif i >= BYTE_BASE:
                out += bytes([i - BYTE_BASE])
            else:
                out += self.texts[i].encode()
        return out.decode("utf-8", errors="replace")


@st.composite
def outputs(draw) -> list[int]:
    """An output's ids: runs of text, markers and whole or cut multi-byte characters."""
    ids: list[int] = []
    for _ in range(draw(st.integers(0, 14))):
        kind = draw(st.sampled_from(["text", "text", "marker", "wide", "cut"]))
        if kind == "text":
            ids.append(draw(st.integers(1, FAKE_CALL)))
        elif kind == "marker":
            ids.extend(draw(st.lists(st.sampled_from([START, END, CALL, TOOL]), min_size=1,
                                     max_size=3)))
        else:
            raw = draw(st.sampled_from(WIDE)).encode()
            if kind == "cut":  # a character's first bytes only: a marker may follow
                raw = raw[:draw(st.integers(1, len(raw) - 1))]
            ids.extend(BYTE_BASE + b for b in raw)
    return ids


def _steps(tok: ByteTokenizer, kept: frozenset[int], ids: list[int], cuts: list[bool],
           hold: int = 0):
    """The engine's outputs as a stream sees them: (text, ids so far, final) per step,
    and each token's own text (what ``add`` returned for it). ``hold``: the characters a
    request with stop strings holds back until it finishes (``core.outputs``)."""
    detok = IncrementalDetokenizer(tok, [1, 2], kept)
    steps, pieces = [], []
    for n, token_id in enumerate(ids, 1):
        pieces.append(detok.add(token_id))
        if n == len(ids) or cuts[n - 1]:
            final = n == len(ids)
            text = detok.text if final else detok.text[:max(0, len(detok.text) - hold)]
            steps.append((text, ids[:n], final))
    return steps or [("", [], True)], pieces


def _reference(name: str, thinking: bool, ids: list[int], pieces: list[str]):
    """The token-level rule: each token's text goes where the state says."""
    rule = RULES[name]
    start = START if rule.start else None
    call = CALL if rule.implicit_end else None
    reasoning, content, count = "", "", 0
    in_reasoning = thinking and rule.starts_in_reasoning
    for token_id, piece in zip(ids, pieces, strict=True):
        if not thinking:
            content += piece
        elif in_reasoning:
            if token_id in (END, call):
                in_reasoning = False
                content += piece if token_id == call else ""
            elif token_id != start:
                reasoning += piece
                count += token_id != TOOL or not rule.tool_markers
        elif rule.reopens and token_id == start:
            in_reasoning = True
        elif not (rule.drops_late_end and token_id == END):
            content += piece
    if rule.strips_trailing_space:
        reasoning = reasoning.rstrip()
    if not rule.counts_unopened:  # count_reasoning_tokens: between <think> and </think>
        count = depth = 0
        for token_id in ids:
            depth += token_id == start
            depth -= token_id == END and depth > 0
            count += depth > 0 and token_id not in (start, END)
    return reasoning, content, count if thinking else 0


@FUZZ
@given(ids=outputs(), cuts=st.lists(st.booleans(), min_size=60, max_size=60),
       name=st.sampled_from(sorted(RULES)), thinking=st.booleans(),
       special=st.booleans(), hold=st.sampled_from([0, 0, 1, 3, 8]))
def test_stream_adds_up_to_the_whole_answer(ids, cuts, name, thinking, special,
                                            hold) -> None:
    check(ids, cuts, name, thinking, special, hold)


def check(ids, cuts, name, thinking, special, hold=0) -> None:
    tok = ByteTokenizer(special, name)
    tokens = ReasoningTokens.of(name, tok)
    plan = ReasoningPlan(tokens, thinking if tokens.rule.switch is not None else True)
    steps, pieces = _steps(tok, tokens.kept_ids, ids, cuts, hold)
    streamed, reasoning, content = plan.splitter(), "", ""
    for text, so_far, final in steps:
        r, c = streamed.feed(text, so_far, final)
        reasoning, content = reasoning + r, content + c
    whole = plan.splitter()
    whole.feed(steps[-1][0], ids, final=True)
    assert (reasoning, content) == (streamed.reasoning, streamed.content)
    assert (reasoning, content) == (whole.reasoning, whole.content)
    count = plan.usage_details([whole], [ids])["reasoning_tokens"]
    assert plan.usage_details([streamed], [ids])["reasoning_tokens"] == count
    if "".join(pieces) == steps[-1][0] and all(
            p == tok.markers[i] for i, p in zip(ids, pieces, strict=True) if i in tok.markers):
        # each token's text is its own (no character held across a marker): vLLM's rule
        assert (whole.reasoning, whole.content, count) == _reference(
            name, plan.thinking, ids, pieces)


# Found by the property above (held back: a stop string's possible start, core.outputs)
HELD = [  # (parser, thinking, ids, one token a step, hold)
    ("qwen3", False, [1, 1000, 1001, 1000], 1),       # a late </think>'s text held back
    ("qwen3", True, [1, 1001, 1, 1001, 2], 2),        # the same after reasoning
    ("deepseek_r1", True, [1, 1000, 2, 1001, 1], 3),  # a <think> in reasoning held back
]


def test_a_markers_text_held_back_is_dropped_when_it_comes() -> None:
    for name, thinking, ids, hold in HELD:
        for special in (False, True):
            check(ids, [True] * len(ids), name, thinking, special, hold)


def test_ordinary_tokens_spelling_a_marker_before_the_marker() -> None:
    """An ordinary token that writes ``</think>`` just before the real one, in the same
    step (a whole answer is one step): the cut is at the marker's token, not at the first
    ``</think>`` of the text (the ids between markers are decoded to count such text)."""
    tok = ByteTokenizer(special=True)
    plan = ReasoningPlan(ReasoningTokens.of("qwen3", tok))
    whole = plan.splitter()
    whole.feed("</think></think>", [FAKE_END, 1001], final=True)
    assert (whole.reasoning, whole.content) == ("</think>", "")  # vLLM's token rule
    late = plan.splitter()  # and after the reasoning: the late marker dropped, not the text
    late.feed("a</think></think></think>b", [1, 1001, FAKE_END, 1001, 2], final=True)
    assert (late.reasoning, late.content) == ("a", "</think>b")
    for name in ("qwen3", "deepseek_r1"):  # a start spelled as text stays in the reasoning
        split = ReasoningPlan(ReasoningTokens.of(name, tok)).splitter()
        split.feed("<think><think>x</think>y", [FAKE_START, 1000, 1, 1001, 2], final=True)
        assert (split.reasoning, split.content) == ("<think>x", "y")


def test_a_streamed_answers_markers_cost_its_length_once() -> None:
    """A client can make a model write markers all along (``logit_bias``): a stream fed a
    token at a time decodes each id a bounded number of times, not once a step (which
    held the event loop for seconds at a few thousand tokens)."""

    class Counting(ByteTokenizer):
        decoded = 0

        def decode(self, ids, skip_special_tokens: bool = True) -> str:
            Counting.decoded += len(ids)
            return super().decode(ids, skip_special_tokens)

    tok = Counting(special=False)
    for unit in ([1, 1001], [FAKE_END, 1001], [1000, 1, 1001, 1]):
        ids = [1001] + unit * 1000
        splitter = ReasoningPlan(ReasoningTokens.of("glm45", tok)).splitter()
        text, seen = "", []
        Counting.decoded = 0
        for k, token_id in enumerate(ids):
            seen.append(token_id)
            text += ByteTokenizer.decode(tok, [token_id])
            splitter.feed(text, seen, final=k == len(ids) - 1)
        assert Counting.decoded <= 4 * len(ids), (unit, Counting.decoded)
