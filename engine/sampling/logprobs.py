"""Logprobs as vLLM reports them: one position's, from the model's raw logits (or, under
``--logprobs-mode``, the logits themselves, or those the token was sampled from: the
sampler's), and how a batch of rows' are computed at once (``logprobs_of``), for sampled
tokens and prompt tokens alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class TokenLogprobs:
    """One position's logprobs, from the model's raw logits (before temperature,
    penalties and bias; a grammar's mask applied, as vLLM applies it before its sampler:
    vLLM's ``raw_logprobs``, the default
    ``--logprobs-mode``; under another mode its values, ``logprob`` and ``top``'s, are
    what that mode reports)."""

    token_id: int      # the token at this position (sampled, or the prompt's)
    logprob: float
    rank: int          # 1 = the most likely token at this position
    top: list[tuple[int, float]]   # the k most likely (token_id, logprob), best first; [] when k == 0


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor, num_top: list[int],
                as_logits: bool = False) -> Callable[[], list[TokenLogprobs]]:
    """Logprobs of ``logits`` ``[n, vocab]`` (``as_logits``: the logits' own values, as
    vLLM's ``*_logits`` modes report them): for row i, ``targets[i]``'s value and rank and
    the ``num_top[i]`` most likely tokens. One log_softmax and one topk for all rows,
    queued on the logits' device; returns a function that copies the results to the host
    and builds the ``TokenLogprobs`` (call it after the step's other work is queued, so
    the device is waited for once)."""
    logprobs = logits.float() if as_logits else torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, targets[:, None])
    ranks = (logprobs > chosen).sum(-1) + 1
    k = min(max(num_top), logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)

    def build() -> list[TokenLogprobs]:
        values = top_values.tolist() if k else [[]] * len(num_top)
        ids = top_ids.tolist() if k else [[]] * len(num_top)
        return [TokenLogprobs(token_id, logprob, rank, list(zip(i[:n], v[:n], strict=True)))
                for token_id, logprob, rank, i, v, n in zip(
                    targets.tolist(), chosen[:, 0].tolist(), ranks.tolist(), ids, values, num_top,
                    strict=True)]

    return build
