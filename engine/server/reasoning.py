"""``--reasoning-parser``: a think-tag model's answer split into its reasoning and its
content, as vLLM 0.32's parsers split it, on token ids.

- ``deepseek_r1`` (``DeepSeekR1ReasoningParser``): the answer starts in reasoning (the
  template puts ``<think>`` in the prompt) and stays there until ``</think>``; with none,
  it is all reasoning. ``<think>`` tokens inside reasoning are dropped.
- ``qwen3`` (vLLM 0.32's ``Qwen3Parser`` engine, not the older text rule): the same,
  and a duplicate ``</think>`` after reasoning is dropped; ``<tool_call>`` ends reasoning
  too and stays in the content for the tool parser; ``enable_thinking: false`` (the
  chat's template variables) makes the whole answer content.

The markers must each be one token of the model's vocabulary: ``ReasoningTokens.of``
refuses a model without them when the server starts. One ``ReasoningSplitter`` reads a
choice's text and ids as they grow, for streamed and whole answers alike, so what a
stream sends adds up to what the whole answer holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvledger.engine.errors import BadInput
from kvledger.engine.sampling.grammar_gate import GrammarGate
from kvledger.engine.settings.vllm_rules import REASONING_PARSERS


@dataclass(frozen=True)
class ReasoningRule:
    """How one parser reads an answer: its start and end markers, a marker that ends
    reasoning and stays in the content (``implicit_end``), whether a later end marker is
    dropped from the content, and whether the chat's ``enable_thinking`` turns it off."""

    start: str
    end: str
    implicit_end: str | None = None
    drops_late_end: bool = False
    reads_enable_thinking: bool = False
    counts_unopened: bool = True  # reasoning tokens count without a <think> in the output


RULES: dict[str, ReasoningRule] = {
    "deepseek_r1": ReasoningRule("<think>", "</think>", counts_unopened=False),
    "qwen3": ReasoningRule("<think>", "</think>", implicit_end="<tool_call>",
                           drops_late_end=True, reads_enable_thinking=True),
}


@dataclass(frozen=True)
class ReasoningTokens:
    """A rule bound to a tokenizer: its markers' ids (``implicit_id`` None where the
    vocabulary lacks that marker: then only the end marker ends reasoning)."""

    name: str
    rule: ReasoningRule
    start_id: int
    end_id: int
    implicit_id: int | None
    kept_ids: frozenset[int] = frozenset()  # markers decoding drops (special): kept in text
    # the tokenizer's decode: how many marker texts ordinary tokens spell (None: none)
    decode: Callable[[list[int]], str] | None = field(default=None, compare=False,
                                                      repr=False)

    @classmethod
    def of(cls, name: str, tokenizer) -> ReasoningTokens:
        """The parser ``name`` for ``tokenizer``; BadInput (exit 2) when a marker is not
        one token of its vocabulary, as vLLM refuses it at start-up."""
        rule = RULES[name]
        ids = {text: _single_token(tokenizer, text) for text in (rule.start, rule.end)}
        missing = [text for text, token_id in ids.items() if token_id is None]
        if missing:
            raise BadInput(f"--reasoning-parser {name}: the model's tokenizer has no single "
                           f"token for {' or '.join(missing)}; this parser needs a model "
                           "that writes them (Qwen3, DeepSeek-R1 and its distills)")
        implicit = None if rule.implicit_end is None else _single_token(tokenizer,
                                                                         rule.implicit_end)
        markers = [ids[rule.start], ids[rule.end]] + ([] if implicit is None else [implicit])
        kept = frozenset(i for i in markers if tokenizer.decode([i]) == "")
        return cls(name, rule, ids[rule.start], ids[rule.end], implicit, kept,
                   tokenizer.decode)

    def thinking(self, template_kwargs: Mapping[str, Any]) -> bool:
        """Whether a chat rendered with ``template_kwargs`` reasons (Qwen3's
        ``enable_thinking: false`` does not)."""
        return not (self.rule.reads_enable_thinking
                    and template_kwargs.get("enable_thinking", True) is False)


@dataclass(frozen=True)
class ReasoningPlan:
    """How one chat's answers are split: the parser's tokens, whether the chat reasons at
    all (Qwen3's ``enable_thinking``), and whether its reasoning is sent
    (``include_reasoning``, vLLM's field)."""

    tokens: ReasoningTokens
    thinking: bool = True
    include: bool = True

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.tokens, self.thinking)

    def grammar_gate(self) -> GrammarGate | None:
        """Where an output constraint starts: at the reasoning's end, the marker ids the
        splitter cuts at (None: the chat does not reason, so from the first token)."""
        if not self.thinking:
            return None
        t = self.tokens
        return GrammarGate(frozenset({t.end_id}),
                           frozenset() if t.implicit_id is None else frozenset({t.implicit_id}))

    def usage_details(self, splitters: list[ReasoningSplitter],
                      outputs_ids: list[list[int]]) -> dict[str, int]:
        """vLLM's ``completion_tokens_details`` of the choices' answers."""
        return {"reasoning_tokens": sum(
            reasoning_token_count(self.tokens, s, ids)
            for s, ids in zip(splitters, outputs_ids, strict=True))}


def _single_token(tokenizer, text: str) -> int | None:
    token_id = tokenizer.token_to_id(text)
    if token_id is None:
        return None
    return token_id if tokenizer.decode([token_id], skip_special_tokens=False) == text \
        else None


class ReasoningSplitter:
    """A choice's answer, fed as it grows (each ``feed`` the whole text and ids so far),
    as reasoning and content pieces. The ids decide where reasoning ends; the text is cut
    at that marker's text in the part the new ids wrote (vLLM's streaming rule). Text
    already handed out is never taken back."""

    def __init__(self, tokens: ReasoningTokens, thinking: bool = True) -> None:
        self.tokens = tokens
        self.in_reasoning = thinking
        self.reasoning = ""
        self.content = ""
        self.reasoning_tokens = 0  # output tokens read as reasoning (markers not counted)
        self._ids_seen = 0
        self._text_seen = 0

    def feed(self, text: str, ids: list[int], final: bool) -> tuple[str, str]:
        """The reasoning and the content that ``text`` and ``ids`` add. A marker whose id
        came but whose text has not (held back behind a stop string's possible start)
        holds back what follows until its text comes, so that the marker's text is
        dropped the same however the answer was cut into steps."""
        t = self.tokens
        i, p = self._ids_seen, self._text_seen  # the ids and the text read so far
        reasoning = content = ""
        if self.in_reasoning:
            cut = next((k for k in range(i, len(ids))
                        if ids[k] in (t.end_id, t.implicit_id)), None)
            if cut is None:
                if not final and self._places(text, ids, t.rule.start, t.start_id, i) is None:
                    return "", ""  # a <think>'s text is still to come: wait for it
                reasoning = self._reasoning_text(text, ids, i, len(ids), p, len(text))
                i, p = len(ids), len(text)
            else:
                implicit = ids[cut] != t.end_id
                marker = t.rule.implicit_end if implicit else t.rule.end
                places = self._places(text, ids[:cut + 1], marker, ids[cut], cut)
                if places is None and not final:
                    return "", ""  # the marker's text is not written yet: wait for it
                # cut off (a stop string): what came is reasoning
                at = len(text) if places is None else places[0]
                reasoning = self._reasoning_text(text, ids, i, cut, p, at)
                self.in_reasoning = False
                i, p = cut + (0 if implicit else 1), min(len(text), at + (
                    0 if implicit else len(marker)))
        if p < len(text) or i < len(ids):
            content = text[p:]
            if t.rule.drops_late_end and t.end_id in ids[i:]:
                places = self._places(text, ids, t.rule.end, t.end_id, i)
                if places is None and not final:
                    self.reasoning += reasoning  # the reasoning is sent, the content waits
                    self._ids_seen, self._text_seen = i, p
                    return reasoning, ""
                content = content.replace(t.rule.end, "", ids[i:].count(t.end_id)) \
                    if places is None else _without(content, [at - p for at in places],
                                                    len(t.rule.end))
        self._ids_seen, self._text_seen = len(ids), max(self._text_seen, len(text))
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def _reasoning_text(self, text: str, ids: list[int], first: int, end: int,
                        start: int, stop: int) -> str:
        """The reasoning ``ids[first:end]`` wrote, ``text[start:stop]``, without its start
        markers."""
        t = self.tokens
        starts = ids[first:end].count(t.start_id)
        self.reasoning_tokens += end - first - starts
        piece = text[start:stop]
        if not starts:
            return piece
        places = self._places(text, ids[:end], t.rule.start, t.start_id, first)
        return piece.replace(t.rule.start, "", starts) if places is None \
            else _without(piece, [at - start for at in places], len(t.rule.start))

    def _places(self, text: str, ids: list[int], marker: str, marker_id: int,
                first: int) -> list[int] | None:
        """Where in ``text`` (written by ``ids``) each ``marker_id`` from ``ids[first]`` on
        wrote ``marker``, in order; None while one's text is not written yet. Ordinary
        tokens that spell the marker's text (the ids between the markers, decoded) are
        passed over, so a reasoning that writes ``</think>`` as text is not cut there. Read
        from the output's start (text may lag its ids: a stop string's possible start is
        held back), so only where a marker came."""
        places: list[int] = []
        if marker_id not in ids[first:]:
            return places
        start, ordinary = 0, []
        for k, token_id in enumerate(ids):
            if token_id != marker_id:
                ordinary.append(token_id)
                continue
            spelled = self.tokens.decode(ordinary).count(marker) \
                if ordinary and self.tokens.decode is not None else 0
            ordinary = []
            for _ in range(spelled + 1):
                at = text.find(marker, start)
                if at < 0:
                    return None
                start = at + len(marker)
            if k >= first:
                places.append(start - len(marker))
        return places


def _without(text: str, places: list[int], width: int) -> str:
    """``text`` less the ``width`` characters at each of ``places``."""
    kept, start = [], 0
    for at in places:
        kept.append(text[start:at])
        start = at + width
    return "".join(kept) + text[start:]


def reasoning_token_count(tokens: ReasoningTokens, splitter: ReasoningSplitter,
                          output_ids: list[int]) -> int:
    """vLLM's ``completion_tokens_details.reasoning_tokens``: Qwen3's engine counts the
    tokens it read as reasoning; DeepSeek-R1's (the think-tag base rule) only those
    between a ``<think>`` and its ``</think>`` in the output itself."""
    if tokens.rule.counts_unopened:
        return splitter.reasoning_tokens
    count = depth = 0
    for token_id in output_ids:
        if token_id == tokens.start_id:
            depth += 1
        elif token_id == tokens.end_id:
            depth = max(0, depth - 1)
        elif depth > 0:
            count += 1
    return count


assert set(RULES) == set(REASONING_PARSERS), "a --reasoning-parser name without its rule"
