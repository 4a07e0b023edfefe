"""vLLM's repetition, frequency and presence penalties, from counts each sequence keeps.

A request with penalties is sampled every step, and its output grows every step: counting
its whole output again at each step would cost the engine thread (every tenant's step) the
square of its length. ``PenaltyCounts`` keeps the counts on the host and folds in only the
ids its output added since the last step; a step then costs one copy of a vocabulary-sized
row to the logits' device (what a step's counts cost before any output: the device holds
no more than it did), whatever the output's length.
"""

from __future__ import annotations

import torch

from kvledger.engine.sampling.params import SamplingParams


class PenaltyCounts:
    """One sequence's output token counts (and, for the repetition penalty, its prompt's
    tokens), brought up to date by ``apply`` from the ids added since the last call. The
    output only grows (``Sequence.append``); one that is shorter than what was counted (a
    list replaced) is counted again from its start."""

    def __init__(self, prompt_token_ids: list[int], vocab: int) -> None:
        self._prompt_ids = prompt_token_ids
        self._prompt_seen: torch.Tensor | None = None  # built at the first repetition penalty
        self.counts = torch.zeros(vocab, dtype=torch.int32)
        self.counted = 0  # how many of the output's ids ``counts`` holds

    def update(self, output_token_ids: list[int]) -> None:
        """Count the ids of ``output_token_ids`` added since the last update."""
        if len(output_token_ids) < self.counted:
            self.counts.zero_()
            self.counted = 0
        new = output_token_ids[self.counted:]
        if new:
            ids = torch.tensor(new, dtype=torch.long)
            self.counts.index_add_(0, ids, torch.ones(len(new), dtype=torch.int32))
            self.counted += len(new)

    def apply(self, logits: torch.Tensor, output_token_ids: list[int],
              params: SamplingParams) -> torch.Tensor:
        """vLLM's penalties on one row ``[vocab]``: repetition over the prompt and output
        (a seen token's logit divided by the penalty when positive, multiplied when not),
        then frequency and presence over the output (``logit -= frequency * count +
        presence * (count > 0)``)."""
        self.update(output_token_ids)
        counts = self.counts.to(logits.device, non_blocking=True)
        if params.repetition_penalty != 1.0:
            seen = (counts > 0) | self._prompt_mask().to(logits.device, non_blocking=True)
            penalty = params.repetition_penalty
            logits = torch.where(seen, torch.where(logits > 0, logits / penalty,
                                                   logits * penalty), logits)
        if params.frequency_penalty:
            logits = logits - params.frequency_penalty * counts
        if params.presence_penalty:
            logits = logits - params.presence_penalty * (counts > 0)
        return logits

    def _prompt_mask(self) -> torch.Tensor:
        """Which tokens the prompt holds, built once (the prompt does not change)."""
        if self._prompt_seen is None:
            self._prompt_seen = torch.zeros(self.counts.shape[0], dtype=torch.bool).index_fill_(
                0, torch.tensor(self._prompt_ids, dtype=torch.long), True)
        return self._prompt_seen
