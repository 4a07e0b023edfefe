"""Pick each sequence's next token from its logits: logits processing (bias, penalties,
grammar, min_tokens) for the rows that ask, then greedy, temperature, top-k, top-p; and
logprobs, from the raw logits (under the grammar's mask, as vLLM's) or, by
``--logprobs-mode``, those sampled from, for the rows that ask.

A request with a ``seed`` draws from its own generator, so its tokens do not depend on
what else is in the batch; the others share the engine's generator. A batch of
default requests costs what it did before any of these features: one argmax, the
sampled rows, one copy. ``sample_each`` confines a fault to the row that raised it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvledger.engine.errors import NonFiniteLogits
from kvledger.engine.sampling.bad_words import BadWordsMatcher
from kvledger.engine.sampling.logprobs import TokenLogprobs, logprobs_of
from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.sampling.penalties import PenaltyCounts

NEG_INF = float("-inf")
Sampled = tuple[int, TokenLogprobs | None]  # one row's token, and its logprobs if asked


class Sequence(Protocol):
    """What the sampler reads of a request (``core.sequence.Sequence`` is one)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    matcher: Any  # its grammar's state (grammar_matcher), or None
    bad_words_matcher: BadWordsMatcher | None  # which of its bad words its output has begun
    penalty_counts: PenaltyCounts | None  # its penalties' counts, kept by the sampler

    def allowed_index(self, device: torch.device) -> torch.Tensor: ...


@dataclass
class SamplerOutput:
    token_ids: list[int]                 # one per row
    logprobs: dict[int, TokenLogprobs]   # by row, only for the rows whose request asked


def sample_each(sampler: Callable[[torch.Tensor, list[Sequence]], SamplerOutput],
                logits: torch.Tensor, seqs: list[Sequence],
                shared_generator: torch.Generator) -> list[Sampled | Exception]:
    """Each sequence's token from ``sampler`` (a ``Sampler``), with its logprobs where
    asked; when the batched call fails, each row alone, so a fault belongs to the sequence
    that raised it (its entry is the exception). A row whose logits are not finite (its
    adapter or its input overflowed) is not sampled: its entry is ``NonFiniteLogits``.
    ``shared_generator``: the one the rows without a seed draw from."""
    # NaN anywhere in a row makes its max NaN; +inf makes it inf: one pass finds both.
    finite = torch.isfinite(logits.amax(dim=1)).tolist() if seqs else []
    if not all(finite):
        rows = [row for row, ok in enumerate(finite) if ok]
        kept = iter(sample_each(sampler, logits[rows], [seqs[row] for row in rows],
                                shared_generator))
        return [next(kept) if ok else NonFiniteLogits() for ok in finite]
    # The batched call may fail after some rows drew: their generators go back to where
    # they stood, so each row alone draws what it would have in the batch and a seeded
    # request never notices the fault of another.
    generators = {id(g): g for seq in seqs if not seq.params.greedy
                  for g in (seq.generator or shared_generator,)}
    states = [(g, g.get_state()) for g in generators.values()]
    try:
        out = sampler(logits, seqs)
        return [(token_id, out.logprobs.get(row)) for row, token_id in enumerate(out.token_ids)]
    except Exception:
        for generator, state in states:
            generator.set_state(state)
    tokens: list[Sampled | Exception] = []
    for row, seq in enumerate(seqs):
        try:
            out = sampler(logits[row:row + 1], [seq])
            tokens.append((out.token_ids[0], out.logprobs.get(0)))
        except Exception as exc:
            tokens.append(exc)
    return tokens


class Sampler:
    def __init__(self, seed: int, device: torch.device, eos_token_ids: Iterable[int] = (),
                 logprobs_mode: str = "raw_logprobs") -> None:
        """``logprobs_mode``: vLLM's ``--logprobs-mode``, what a row's logprobs report:
        ``raw_*`` the model's logits (or their log_softmax), the grammar's mask applied as
        vLLM applies it before sampling; ``processed_*`` those the token was drawn from
        (processed, then temperature, min_p, top_k and top_p's exclusions at ``-inf``; a
        greedy row's processed only)."""
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.eos_token_ids = frozenset(eos_token_ids)  # masked out until min_tokens
        self.processed = logprobs_mode.startswith("processed")
        self.as_logits = logprobs_mode.endswith("logits")

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """``logits``: float32 ``[len(seqs), vocab]`` (raw), one row per sequence in order.
        Returns each row's token, and the logprobs of the rows whose request asked.

        Everything stays on the logits' device until the copies at the end: on CUDA a
        step waits for the device once, however many rows it samples."""
        raw = logits
        processed, sampled, asked = [], [], []
        for row, seq in enumerate(seqs):
            params = seq.params
            if params.processes_logits or (params.min_tokens
                                           and len(seq.output_token_ids) < params.min_tokens):
                processed.append(row)
            if not params.greedy:
                sampled.append(row)
            if params.logprobs is not None:
                asked.append(row)
        if processed:
            logits = logits.clone()
            for row in processed:
                logits[row] = process_logits(raw[row], seqs[row], self.eos_token_ids)
        token_ids = logits.argmax(dim=-1)
        drawn_from = {}  # a sampled row's logits after temperature, min_p, top_k, top_p
        if sampled:
            draws = []
            for row in sampled:
                drawn, filtered = self._sample_row(logits[row], seqs[row])
                draws.append(drawn)
                if self.processed:
                    drawn_from[row] = filtered
            index = torch.tensor(sampled, dtype=torch.long, device=logits.device)
            token_ids = token_ids.index_copy(0, index, torch.cat(draws))
        if not asked:
            return SamplerOutput(token_ids.tolist(), {})
        index = torch.tensor(asked, dtype=torch.long, device=logits.device)
        reported = (logits if self.processed else raw)[index]  # a copy of the rows asked
        for at, row in enumerate(asked):
            if row in drawn_from:
                reported[at] = drawn_from[row]
            elif not self.processed and (matcher := seqs[row].matcher) is not None \
                    and not matcher.dead_end:
                # vLLM masks the grammar's tokens before its sampler: its raw values of a
                # constrained row are the allowed tokens' (the mask just computed, again).
                matcher.apply_mask(reported[at])
        read = logprobs_of(reported, token_ids[index],
                           [seqs[row].params.logprobs for row in asked], self.as_logits)
        token_id_list = token_ids.tolist()  # the one wait for the device; the rest is copied
        return SamplerOutput(token_id_list, dict(zip(asked, read(), strict=True)))

    def _sample_row(self, logits: torch.Tensor, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """One token id drawn from ``logits`` ``[vocab]``, as a ``[1]`` tensor, and the
        logits it was drawn from: scaled by the temperature, what min_p and top_k (and,
        in a ``processed_*`` logprobs mode, top_p) leave out at ``-inf``."""
        params = seq.params
        logits = logits / params.temperature
        if params.min_p > 0.0:  # probability under min_p x the top one's: out (never the top)
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < params.min_p * probs.max(), NEG_INF)
        if params.top_k > 0 and params.top_k < logits.shape[-1]:
            kth = torch.topk(logits, params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, NEG_INF)
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always the top token).
            drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
            drop[0] = False  # a top_p below float32's smallest (1e-300) would drop every token
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            if self.processed:  # what top_p left out, in the logits too
                logits = logits.masked_fill(torch.zeros_like(drop).scatter_(0, order, drop),
                                            NEG_INF)
        generator = seq.generator or self.generator
        return torch.multinomial(probs, 1, generator=generator), logits


def process_logits(logits: torch.Tensor, seq: Sequence, eos_token_ids: frozenset[int]) -> torch.Tensor:
    """``seq``'s processed copy of its raw logits row ``[vocab]`` (``SamplingParams``
    says the order). Never all ``-inf``: the grammar's mask wins over min_tokens', and a
    grammar that allows nothing, or bad words that take out every allowed token, leave the
    raw row: its matcher, at a dead end, refuses the token and the request finishes with
    ``"grammar"`` (``Sequence.append``), so argmax and multinomial always get a token to
    pick and none outside the constraint is ever written."""
    params = seq.params
    row = logits.clone()
    vocab = row.shape[-1]
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=row.device)
        values = torch.tensor(list(params.logit_bias.values()), dtype=row.dtype, device=row.device)
        row.index_add_(0, ids, values)
    if params.has_penalties:  # counts kept on the sequence: a step reads its new ids only
        if seq.penalty_counts is None:
            seq.penalty_counts = PenaltyCounts(seq.prompt_token_ids, vocab)
        row = seq.penalty_counts.apply(row, seq.output_token_ids, params)
    if seq.bad_words_matcher is not None:  # reads the tokens added since the last step
        banned = seq.bad_words_matcher.banned(seq.output_token_ids)
        if banned:
            row = row.index_fill(0, torch.tensor(banned, dtype=torch.long, device=row.device),
                                 NEG_INF)
    if params.allowed_token_ids is not None:  # those logits selected into a row of -inf
        ids = seq.allowed_index(row.device)
        row = torch.full_like(row, NEG_INF).index_copy_(0, ids, row.index_select(0, ids))
    if seq.matcher is not None:
        seq.matcher.fill_mask(row)
    if len(seq.output_token_ids) < params.min_tokens:
        stops = params.stop_token_set if params.ignore_eos else params.stop_token_set | eos_token_ids
        ids = [t for t in stops if t < vocab]
        if ids:
            masked = row.index_fill(0, torch.tensor(ids, dtype=torch.long, device=row.device), NEG_INF)
            row = torch.where((masked > NEG_INF).any(), masked, row)
    return torch.where((row > NEG_INF).any(), row, logits)  # no sync: a device-side choice
