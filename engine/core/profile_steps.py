"""The steps the start-up profile runs (``ModelRunner.profile``): the heaviest an engine
step can be, built from nothing (token 0 everywhere, a one-block scratch cache whose block
every table repeats), so that their peak is measured before the KV pool exists.

- ``prefill_step``: whole prompts of the longest a request has, no cache (the MLP's and
  the logits' peak);
- ``mixed_step``: decodes at the full context beside the longest later chunk of a prompt,
  which attends to its cached context (what attention gathers, or the paged kernel's
  partial outputs, at their largest);
- ``check_step``: the CPU's, one short prompt at the top of the context, which checks
  that the model runs (the CPU keeps no allocator statistics to measure).

Each is ``(token ids, positions, attention metadata, rows to return logits for)``, in
``ModelRunner.execute``'s order: prompt chunks first, then decodes."""

from __future__ import annotations

import itertools

import torch

from kvledger.engine.core.step_attention import StepAttention
from kvledger.engine.model.attention import AttentionMetadata
from kvledger.engine.planner.pool import blocks_for

Step = tuple[list[int], list[int], AttentionMetadata, list[int]]

# On the CPU the profile measures nothing: its step only checks that the model runs, on
# this many tokens at the top of the context (the rotary table's last positions), as
# vLLM's CPU runner skips its profile run when it compiles nothing.
CPU_CHECK_TOKENS = 16


def prefill_step(attention: StepAttention, num_tokens: int, max_model_len: int) -> Step:
    """Whole prompts of ``max_model_len - 1`` tokens (the longest a request has), the
    last one shorter."""
    longest = max(1, max_model_len - 1)
    lengths = [longest] * (num_tokens // longest)
    if num_tokens % longest:
        lengths.append(num_tokens % longest)
    positions = [p for n in lengths for p in range(n)]
    last_index = [end - 1 for end in itertools.accumulate(lengths)]
    return [0] * num_tokens, positions, attention.first_chunks(lengths), last_index


def check_step(attention: StepAttention, max_model_len: int) -> Step:
    """One prompt of ``CPU_CHECK_TOKENS`` tokens (fewer in a shorter context) ending at
    the context's last position."""
    n = min(CPU_CHECK_TOKENS, max_model_len)
    return [0] * n, list(range(max_model_len - n, max_model_len)), attention.first_chunks([n]), [n - 1]


def mixed_step(attention: StepAttention, num_tokens: int, max_model_len: int,
               max_num_seqs: int) -> Step:
    """The longest later chunk there can be (a prompt's last chunk, ending at position
    ``max_model_len - 1``), whole prompts with the rest of the prompt budget if any, then
    ``min(max_num_seqs, num_tokens) - 1`` decodes at position ``max_model_len - 1``."""
    bs = attention.block_size
    width = blocks_for(max_model_len, bs)
    num_decodes = min(max_num_seqs, num_tokens) - 1
    rest = num_tokens - num_decodes
    chunk = max(0, min(rest, max_model_len - 2))  # a later chunk starts at position >= 1
    chunks, positions, last_index = [], [], []
    if chunk:
        start = max_model_len - 1 - chunk
        chunks.append(([0] * width, start, chunk))
        positions, last_index = list(range(start, start + chunk)), [chunk - 1]
    if rest > chunk:
        _, more_positions, more, more_last = prefill_step(attention, rest - chunk, max_model_len)
        chunks += [([], 0, span.length) for span in more.prefills]
        positions += more_positions
        last_index += [chunk + i for i in more_last]
    decodes = [([0] * width, max_model_len)] * num_decodes
    positions += [max_model_len - 1] * num_decodes
    last_index += range(rest, num_tokens)
    # Every token writes into the scratch block (repeated slots: the values do not matter).
    slots = torch.arange(num_tokens, device=attention.device) % bs
    return [0] * num_tokens, positions, attention.metadata(chunks, decodes, slots), last_index
