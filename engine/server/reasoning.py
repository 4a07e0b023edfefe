"""``--reasoning-parser``: a think-tag model's answer split into its reasoning and its
content, as vLLM 0.32's parser of that name splits a whole answer (``reasoning_rules.py``
holds each parser's rule), read on token ids.

The markers must each be one token of the model's vocabulary: ``ReasoningTokens.of``
refuses a model without them when the server starts. One ``ReasoningSplitter`` reads a
choice's text and ids as they grow, for streamed and whole answers alike, so what a
stream sends adds up to what the whole answer holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvledger.engine.errors import BadInput
from kvledger.engine.sampling.grammar_gate import GrammarGate, PromptEnd
from kvledger.engine.server.marker_scan import MarkerLook, MarkerScan, without
from kvledger.engine.server.reasoning_rules import RULES, ReasoningRule
from kvledger.engine.server.text_pieces import TextPieces
from kvledger.engine.server.think_count import ThinkCount


@dataclass(frozen=True)
class ReasoningTokens:
    """A rule bound to a tokenizer: its markers' ids (``implicit_id`` None where the
    vocabulary lacks that marker: then only the end marker ends reasoning; ``start_id``
    None for a rule without a start marker), and the chat template its switch reads."""

    name: str
    rule: ReasoningRule
    start_id: int | None
    end_id: int
    implicit_id: int | None
    kept_ids: frozenset[int] = frozenset()  # markers decoding drops (special): kept in text
    # the tokenizer's decode: how many marker texts ordinary tokens spell (None: none)
    decode: Callable[[list[int]], str] | None = field(default=None, compare=False,
                                                      repr=False)
    template: str | None = None
    tool_ids: frozenset[int] = frozenset()  # the rule's ``tool_markers`` that are tokens
    prompt_end: PromptEnd | None = None  # whether a prompt already ends the reasoning

    @classmethod
    def of(cls, name: str, tokenizer) -> ReasoningTokens:
        """The parser ``name`` for ``tokenizer``; BadInput (exit 2) when a marker (or a
        token the parser requires) is not one token of its vocabulary, as vLLM refuses
        it at start-up."""
        rule = RULES[name]
        needed = [text for text in (rule.start, rule.end, *rule.requires) if text is not None]
        ids = {text: _single_token(tokenizer, text) for text in needed}
        missing = [text for text, token_id in ids.items() if token_id is None]
        if missing:
            raise BadInput(f"--reasoning-parser {name}: the model's tokenizer has no single "
                           f"token for {' or '.join(missing)}; this parser needs a model "
                           f"whose tokenizer has them ({rule.models})")
        implicit = None if rule.implicit_end is None else _single_token(tokenizer,
                                                                         rule.implicit_end)
        tool = frozenset(token_id for text in rule.tool_markers
                         if (token_id := _single_token(tokenizer, text)) is not None)
        markers = [ids[text] for text in (rule.start, rule.end) if text is not None] + (
            [] if implicit is None else [implicit]) + sorted(tool)
        kept = frozenset(i for i in markers if tokenizer.decode([i]) == "")
        start = None if rule.start is None else ids[rule.start]
        turns = frozenset(token_id for text in rule.turn_markers
                          if (token_id := _single_token(tokenizer, text)) is not None)
        prompt_end = PromptEnd(frozenset({ids[rule.end]} | ({implicit} - {None})), start,
                               turns, rule.prompt_end_anywhere)
        return cls(name, rule, start, ids[rule.end], implicit, kept, tokenizer.decode,
                   getattr(tokenizer, "chat_template", None), tool, prompt_end)

    def thinking(self, template_kwargs: Mapping[str, Any]) -> bool:
        """Whether a chat rendered with ``template_kwargs`` reasons (the rule's switch:
        Qwen3's ``enable_thinking: false`` does not)."""
        return self.rule.switch is None or self.rule.switch(template_kwargs, self.template)


@dataclass(frozen=True)
class ReasoningPlan:
    """How one chat's answers are split: the parser's tokens, whether the chat reasons at
    all (Qwen3's ``enable_thinking``), whether its reasoning is sent (``include_reasoning``,
    vLLM's field), and whether an output constraint covers the reasoning too
    (``--structured-outputs-config``'s ``enable_in_reasoning``)."""

    tokens: ReasoningTokens
    thinking: bool = True
    include: bool = True
    constrain_reasoning: bool = False

    def after_prompt(self, prompt_ids: list[int]) -> ReasoningPlan:
        """This plan for an answer that follows ``prompt_ids``: one whose prompt already
        ends the reasoning (the parser's ``PromptEnd``) is all content, as vLLM's stream
        reads it, and its constraint applies from the first token (the door reads the
        same rule off the gate)."""
        ended = self.tokens.prompt_end
        if self.thinking and ended is not None and ended.ended(prompt_ids):
            return replace(self, thinking=False)
        return self

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.tokens, self.thinking)

    def grammar_gate(self) -> GrammarGate | None:
        """Where an output constraint starts: at the reasoning's end, the marker ids the
        splitter cuts at (None: from the first token, where the chat does not reason or
        the answer starts in content, as Magistral's: vLLM's parser engine then counts the
        reasoning as ended before it starts, and the constraint leaves no room to open it;
        or where it covers the reasoning too, as vLLM's ``enable_in_reasoning`` has it)."""
        if (self.constrain_reasoning or not self.thinking
                or not self.tokens.rule.starts_in_reasoning):
            return None
        t = self.tokens
        return GrammarGate(frozenset({t.end_id}),
                           frozenset() if t.implicit_id is None else frozenset({t.implicit_id}),
                           t.prompt_end)

    def usage_details(self, splitters: list[ReasoningSplitter],
                      outputs_ids: list[list[int]]) -> dict[str, int]:
        """vLLM's ``completion_tokens_details`` of the choices' answers (none for a chat
        that does not think: vLLM's parser then reads no reasoning). ``outputs_ids``: each
        splitter's answer's ids so far; a stream's calls, chunk after chunk, cost only the
        ids new since the last."""
        return {"reasoning_tokens": sum(
            reasoning_token_count(self.tokens, s, ids) if self.thinking else 0
            for s, ids in zip(splitters, outputs_ids, strict=True))}


def _single_token(tokenizer, text: str) -> int | None:
    token_id = tokenizer.token_to_id(text)
    if token_id is None:
        return None
    return token_id if tokenizer.decode([token_id], skip_special_tokens=False) == text \
        else None


# One step of a split: the ids and the text read up to, the piece, whether the state changed
_Step = tuple[int, int, str, bool]


class ReasoningSplitter:
    """A choice's answer, fed as it grows (each ``feed`` the whole text and ids so far),
    as reasoning and content pieces. The ids decide where the state changes; the text is
    cut at that marker's own text (vLLM's streaming rule). Text already handed out is
    never taken back."""

    def __init__(self, tokens: ReasoningTokens, thinking: bool = True) -> None:
        self.tokens = tokens
        self.splits = thinking  # a chat that does not think is all content, as written
        self.in_reasoning = thinking and tokens.rule.starts_in_reasoning
        self._reasoning, self._content = TextPieces(), TextPieces()
        self.reasoning_tokens = 0  # output tokens read as reasoning (markers not counted)
        self._ids_seen = 0
        self._text_seen = 0
        # the reasoning's trailing whitespace, held as it came (strips_trailing_space)
        self._space: list[str] = []
        self._scans: dict[int, MarkerScan] = {}  # each marker's tokens found in the text
        self.think_count = ThinkCount()  # the base rule's reasoning_tokens, read on
        self._look = MarkerLook()  # the next marker's id: a waiting step looks on

    def feed(self, text: str, ids: list[int], final: bool) -> tuple[str, str]:
        """The reasoning and the content that ``text`` and ``ids`` add. A marker whose id
        came but whose text has not (held back behind a stop string's possible start)
        holds back what follows until its text comes, so that the marker's text is
        dropped the same however the answer was cut into steps."""
        reasoning = content = ""
        while True:
            step = self._reasoning_step(text, ids, final) if self.in_reasoning \
                else self._content_step(text, ids, final)
            if step is None:
                break  # a marker's text is still to come: wait for it
            self._ids_seen, self._text_seen, piece, changed = step
            if self.in_reasoning:
                reasoning += self._without_trailing_space(piece)
            else:
                content += piece
            if not changed:
                break
            self.in_reasoning = not self.in_reasoning
        if final:
            self._space = []  # the reasoning's end: its trailing whitespace is cut
        self._reasoning.add(reasoning)
        self._content.add(content)
        return reasoning, content

    @property
    def reasoning(self) -> str:
        """All the reasoning handed out (joined when read: a stream reads its pieces)."""
        return self._reasoning.text()

    @property
    def content(self) -> str:
        return self._content.text()

    def _reasoning_step(self, text: str, ids: list[int], final: bool) -> _Step | None:
        """Reasoning up to its end marker (dropped) or implicit end (kept for the content),
        or all of it; None to wait for a marker's text."""
        t, i, p = self.tokens, self._ids_seen, self._text_seen
        cut = self._look.first(ids, i, (t.end_id, t.implicit_id))
        if cut is None:
            if not final and self._places(text, ids, t.rule.start, t.start_id, i,
                                                 len(ids)) is None:
                return None  # a <think>'s text is still to come
            return len(ids), max(p, len(text)), self._reasoning_text(
                text, ids, i, len(ids), p, len(text)), False
        implicit = ids[cut] != t.end_id
        marker = t.rule.implicit_end if implicit else t.rule.end
        places = self._places(text, ids, marker, ids[cut], cut, cut + 1)
        if places is None and not final:
            return None
        at = len(text) if places is None else places[0]  # cut off (a stop string): all came
        piece = self._reasoning_text(text, ids, i, cut, p, at)
        return cut + (0 if implicit else 1), at if implicit else min(
            len(text), at + len(marker)), piece, True

    def _content_step(self, text: str, ids: list[int], final: bool) -> _Step | None:
        """Content up to a start marker that opens reasoning again (``reopens``), or all
        of it, late end markers dropped (``drops_late_end``); None to wait."""
        t, rule, i, p = self.tokens, self.tokens.rule, self._ids_seen, self._text_seen
        if not self.splits:
            return len(ids), max(p, len(text)), text[p:], False
        opener = self._look.first(ids, i, (t.start_id,)) if rule.reopens else None
        stop, at = len(ids), len(text)
        if opener is not None:
            places = self._places(text, ids, rule.start, t.start_id, opener, opener + 1)
            if places is None and not final:
                return None
            stop, at = opener, len(text) if places is None else places[0]
        places = self._places(text, ids, rule.end, t.end_id, i, stop) \
            if rule.drops_late_end else []
        if places is None and not final:
            return None  # the reasoning is sent, the content waits
        piece = text[p:at]
        if places is None:  # cut off (a stop string): the markers' texts as counted
            piece = piece.replace(rule.end, "", ids[i:stop].count(t.end_id))
        elif places:
            piece = without(piece, [x - p for x in places], len(rule.end))
        if opener is None:
            return len(ids), max(p, len(text)), piece, False
        return opener + 1, min(len(text), at + len(rule.start)), piece, True

    def _reasoning_text(self, text: str, ids: list[int], first: int, end: int,
                        start: int, stop: int) -> str:
        """The reasoning ``ids[first:end]`` wrote, ``text[start:stop]``, without its start
        markers; its tokens counted, but the markers and the tool markup."""
        t = self.tokens
        starts = 0 if t.start_id is None else ids[first:end].count(t.start_id)
        self.reasoning_tokens += end - first - starts - sum(
            token_id in t.tool_ids for token_id in ids[first:end])
        piece = text[start:stop]
        if not starts:
            return piece
        places = self._places(text, ids, t.rule.start, t.start_id, first, end)
        return piece.replace(t.rule.start, "", starts) if places is None \
            else without(piece, [at - start for at in places], len(t.rule.start))

    def _places(self, text: str, ids: list[int], marker: str | None, marker_id: int | None,
                first: int, end: int) -> list[int] | None:
        """Where in ``text`` (written by ``ids``) each ``marker_id`` of ``ids[first:end]``
        wrote ``marker``, in order; None while one's text is not written yet. Ordinary
        tokens that spell the marker's text (the ids between the markers, decoded) are
        passed over, so a reasoning that writes ``</think>`` as text is not cut there. The
        text may lag its ids (a stop string's possible start is held back), so each
        marker's place is found from the output's start, once: ``MarkerScan`` keeps how
        far, so an answer's markers cost their output's length once, not once a step (nor
        once a step while one's text is awaited)."""
        if marker is None or marker_id is None:
            return []
        scan = self._scans.get(marker_id) or self._scans.setdefault(marker_id,
                                                                  MarkerScan(marker_id))
        if not scan.read(text, ids, end, marker, self.tokens.decode):
            return None
        return scan.between(first, end)

    def _without_trailing_space(self, piece: str) -> str:
        """``piece`` with its trailing whitespace held until more reasoning follows (and
        dropped at the end), where the rule cuts it (vLLM's engine defers it the same).
        Held as pieces, joined once other text follows: a long run costs its length once."""
        if not piece or not self.tokens.rule.strips_trailing_space:
            return piece
        kept = piece.rstrip()
        if not kept:
            self._space.append(piece)
            return ""
        rest = piece[len(kept):]
        kept, self._space = "".join(self._space) + kept, [rest] if rest else []
        return kept


def reasoning_token_count(tokens: ReasoningTokens, splitter: ReasoningSplitter,
                          output_ids: list[int]) -> int:
    """vLLM's ``completion_tokens_details.reasoning_tokens``: the parser engine counts the
    tokens it read as reasoning; the think-tag base rule (deepseek_r1) only those between
    a ``<think>`` and its ``</think>`` in the output itself. ``output_ids``: the ids
    ``splitter``'s answer has so far (each call's extend the last's: read on from there)."""
    if tokens.rule.counts_unopened:
        return splitter.reasoning_tokens
    return splitter.think_count.read(output_ids, tokens.start_id, tokens.end_id)
