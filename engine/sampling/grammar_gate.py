"""A constraint that starts part way into the output: where a thinking model's reasoning
ends (``--reasoning-parser``), as vLLM 0.32 applies ``response_format``, structured outputs
and a required or named tool call only to the answer after the reasoning.

A ``GrammarGate`` names the tokens that open the constraint: ``after`` (an end marker such
as ``</think>``: the constraint starts with the next token; the marker itself is
reasoning's) and ``at`` (a marker that ends the reasoning and is the answer's first token,
Qwen3's ``<tool_call>``: the grammar must accept it). Until one comes, the sequence samples
as if it had no grammar: no mask is filled, every token is accepted, and the grammar's
state is not advanced, so the reasoning is the model's own and costs no grammar work.
Once open, the gated matcher is the grammar's matcher. The gate reads the same marker ids
the server's reasoning splitter cuts at, so the constraint covers exactly the content.

A prompt may end the reasoning itself (an assistant turn ``<think>x</think>`` continued, a
template that writes an empty ``<think></think>``): ``PromptEnd`` reads that on the
prompt's ids as vLLM 0.32's parser of that name does (``is_reasoning_end`` on the prompt),
and the constraint then applies from the first token, as vLLM's does; the server reads the
same ``PromptEnd`` to send that answer as content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PromptEnd:
    """Whether a prompt's ids already end the reasoning, by one parser's rule: read back
    from the prompt's last id, an ``end_ids`` id (an end marker, or a tool-call opener
    that ends it implicitly) says yes; a ``start_id`` (the reasoning opened again) or a
    ``turn_ids`` id (the current turn's start: an earlier turn's markers do not count)
    says no, as does no marker at all. ``anywhere``: any ``end_ids`` id in the prompt says
    yes (Step3's rule)."""

    end_ids: frozenset[int]
    start_id: int | None = None
    turn_ids: frozenset[int] = frozenset()
    anywhere: bool = False

    def ended(self, prompt_ids: list[int]) -> bool:
        """The rule on ``prompt_ids``; each marker's last place is found by the list's own
        search (C speed), as a long prompt is read once per request on the event loop."""
        if self.anywhere:
            return any(i in prompt_ids for i in self.end_ids)
        backwards = prompt_ids[::-1]
        nearest, ended = len(backwards), False
        for ids, says in ((self.end_ids, True), (self.turn_ids, False),
                          (() if self.start_id is None else (self.start_id,), False)):
            for marker in ids:
                try:
                    at = backwards.index(marker, 0, nearest)
                except ValueError:
                    continue
                nearest, ended = at, says
        return ended


@dataclass(frozen=True)
class GrammarGate:
    """The tokens that open a gated constraint (see the module's docstring); ``prompt``:
    the rule under which a prompt has already opened it (None: no prompt does)."""

    after: frozenset[int]
    at: frozenset[int] = frozenset()
    prompt: PromptEnd | None = None

    def over(self, grammar: Any, prompts_ids: list[list[int]] = ()) -> Any:
        """``grammar`` (compiled, shared) applied from where this gate opens: from the
        first token (``grammar`` itself) where every prompt of ``prompts_ids`` (a chat has
        one) already ends the reasoning."""
        if prompts_ids and self.prompt is not None and all(
                self.prompt.ended(ids) for ids in prompts_ids):
            return grammar
        return GatedGrammar(grammar, self)


class GatedGrammar:
    """A compiled grammar behind a gate: each sequence's ``matcher()`` is a gated one."""

    def __init__(self, grammar: Any, gate: GrammarGate) -> None:
        self.grammar = grammar
        self.gate = gate

    def matcher(self) -> GatedMatcher:
        return GatedMatcher(self.grammar.matcher(), self.gate)


class GatedMatcher:
    """One sequence's state: closed (reasoning: no mask, every token accepted) until a
    token of its gate comes, then its grammar's matcher. Not thread-safe, as the matcher
    it wraps."""

    def __init__(self, inner: Any, gate: GrammarGate) -> None:
        self._inner = inner
        self._gate = gate
        self.open = False
        self._refused_opening = False  # the grammar refused the ``at`` token that opened it

    @property
    def dead_end(self) -> bool:
        return self.open and (self._refused_opening or self._inner.dead_end)

    @property
    def is_terminated(self) -> bool:
        return self.open and self._inner.is_terminated

    def fill_mask(self, logits_row: torch.Tensor) -> None:
        """The grammar's mask once open; nothing while the reasoning runs."""
        if self.open:
            self._inner.fill_mask(logits_row)

    def apply_mask(self, logits_row: torch.Tensor) -> None:
        """The mask ``fill_mask`` last applied, again (nothing while the reasoning runs)."""
        if self.open:
            self._inner.apply_mask(logits_row)

    def accept(self, token_id: int) -> bool:
        """Once open, the grammar's answer. Closed, every token is accepted; a gate token
        opens it (an ``at`` token is the grammar's first: refused there, the output can
        go no further as asked, a dead end, as a grammar's own)."""
        if self.open:
            return self._inner.accept(token_id)
        if token_id in self._gate.after:
            self.open = True
        elif token_id in self._gate.at:
            self.open = True
            if not self._inner.accept(token_id):
                self._refused_opening = True
                return False
        return True
