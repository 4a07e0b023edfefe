"""Pick each sequence's next token from its logits: greedy, temperature, top-k, top-p.

A request with a ``seed`` draws from its own generator, so its tokens do not depend on
what else is in the batch; the others share the engine's generator.
"""

from __future__ import annotations

import torch

from kvledger.engine.sequence import Sequence


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """``logits``: float32 ``[len(seqs), vocab]``, one row per sequence in order.

        Everything stays on the logits' device until one copy of the token ids at the
        end: on CUDA a step waits for the device once, however many rows it samples."""
        token_ids = logits.argmax(dim=-1)
        rows = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
        if rows:
            sampled = torch.cat([self._sample_row(logits[row], seqs[row]) for row in rows])
            index = torch.tensor(rows, dtype=torch.long, device=logits.device)
            token_ids = token_ids.index_copy(0, index, sampled)
        return token_ids.tolist()

    def _sample_row(self, logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """One token id drawn from ``logits`` ``[vocab]``, as a ``[1]`` tensor."""
        params = seq.params
        logits = logits / params.temperature
        if params.top_k > 0 and params.top_k < logits.shape[-1]:
            kth = torch.topk(logits, params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always the top token).
            drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
            drop[0] = False  # a top_p below float32's smallest (1e-300) would drop every token
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        generator = seq.generator or self.generator
        return torch.multinomial(probs, 1, generator=generator)
