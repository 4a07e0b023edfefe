"""What each token of an engine step attends to (``AttentionMetadata``), from the step's
prompt chunks and decoding sequences, on either attention path (planner/attention.py):

- ``TORCH_SDPA``: a later chunk gathers its blocks under a causal mask; decodes are cut
  into groups (``_group_bounds``) whose block tables are padded to the group's longest,
  under an additive mask over each row's context;
- ``TRITON_ATTN`` (``paged``): nothing is gathered. The later chunks are ``PagedChunks``,
  read in place tile by tile of queries; every decode token is a row of ``PagedRows``,
  reading its own positions of the pool in place; no mask.

A first chunk (a prompt from position 0) attends to itself alone on both (SDPA, causal,
within a sliding window): its K/V are the step's own, dense already."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from kvledger.engine.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    PagedChunks,
    PagedRows,
    PrefillSpan,
)
from kvledger.engine.planner.pool import blocks_for


@dataclass
class StepAttention:
    """The run's fixed facts each step's metadata is built from."""

    block_size: int
    max_model_len: int
    sliding_window: int | None
    dtype: torch.dtype  # an additive mask's
    device: torch.device
    paged: bool
    # The window of the sliding layers of a model whose layers differ (Gemma 3): each
    # step's metadata then carries what they see (``AttentionMetadata.sliding``).
    layer_window: int | None = None

    def metadata(self, chunks: list[tuple[list[int], int, int]],
                   decodes: list[tuple[list[int], int]],
                   slot_mapping: torch.Tensor) -> AttentionMetadata:
        """What the step's tokens attend to: prompt chunks ``(block ids, start, length)``
        first, then decoding sequences ``(block ids, tokens incl. this one)``."""
        meta = self._metadata(chunks, decodes, slot_mapping)
        if self.layer_window is not None:
            meta.sliding = self.sliding_layers().metadata(chunks, decodes, slot_mapping)
        return meta

    def first_chunks(self, lengths: list[int]) -> AttentionMetadata:
        """Prompts of ``lengths`` tokens from position 0 and no cache (the profile's)."""
        meta = AttentionMetadata(None, [PrefillSpan(0, n, self.window_mask(n)) for n in lengths], [])
        if self.layer_window is not None:
            meta.sliding = self.sliding_layers().first_chunks(lengths)
        return meta

    def sliding_layers(self) -> StepAttention:
        """What a hybrid model's sliding layers see: these facts under their window."""
        return replace(self, sliding_window=self.layer_window, layer_window=None)

    def _metadata(self, chunks: list[tuple[list[int], int, int]],
                  decodes: list[tuple[list[int], int]],
                  slot_mapping: torch.Tensor) -> AttentionMetadata:
        if self.paged:
            return self._paged(chunks, decodes, slot_mapping)
        groups, start = [], 0
        for end in _group_bounds([len(block_ids) for block_ids, _ in decodes]):
            group = decodes[start:end]
            groups.append(self.decode_group([ids for ids, _ in group], [n for _, n in group]))
            start = end
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            prefills=[self._prefill_span(ids, start, length) for ids, start, length in chunks],
            decode_groups=groups,
        )

    def _paged(self, chunks: list[tuple[list[int], int, int]],
               decodes: list[tuple[list[int], int]],
               slot_mapping: torch.Tensor) -> AttentionMetadata:
        """``metadata`` where everything past a first chunk reads the pool in place: each
        later chunk is a chunk of ``PagedChunks`` (its queries read the context a tile at a
        time, ``prefill_attention.py``, where one by one each would read it all again: a
        2,048-token chunk over 8k cached tokens, ~58 GB a layer for Llama-3-8B), each
        decoding sequence's token a row of ``PagedRows``, seeing its context (its last
        ``sliding_window``)."""
        prefills, later, token = [], [], 0
        for block_ids, start, length in chunks:
            if start == 0:  # dense already: SDPA over its own K/V
                prefills.append(self._prefill_span(block_ids, start, length))
            else:
                prefills.append(PrefillSpan(start, length, None, in_place=True))
                later.append((block_ids[:blocks_for(start + length, self.block_size)],
                              token, start, length))
            token += length
        tables, table_rows, ends, tokens = [], [], [], []
        for block_ids, num_tokens in decodes:
            table_rows.append(len(tables))
            tables.append(block_ids)
            ends.append(num_tokens)
            tokens.append(token)
            token += 1
        meta = AttentionMetadata(slot_mapping=slot_mapping, prefills=prefills, decode_groups=[])

        def ints(values: list, dtype=torch.int32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        if later:
            blocks, q_starts, starts, lengths = zip(*later, strict=True)
            meta.chunks = PagedChunks(
                block_tables=padded_tables(list(blocks)).to(self.device),
                q_starts=ints(q_starts), starts=ints(starts), lengths=ints(lengths),
                max_tokens=max(lengths), sliding_window=self.sliding_window)
        if not tokens:
            return meta
        starts = self.first_seen(ends)
        meta.paged = PagedRows(
            tokens=ints(tokens, torch.long),
            block_tables=padded_tables(tables).to(self.device),
            table_rows=ints(table_rows), starts=ints(starts), ends=ints(ends),
            max_positions=self.max_model_len)
        return meta

    def first_seen(self, ends: list[int]) -> list[int]:
        """The first position each decode row sees, its context ending at ``ends``: 0, or
        the start of its last ``sliding_window`` positions."""
        window = self.sliding_window
        return [0] * len(ends) if window is None else [max(0, end - window) for end in ends]

    def _prefill_span(self, block_ids: list[int], start: int, length: int) -> PrefillSpan:
        if start == 0:
            return PrefillSpan(0, length, self.window_mask(length))
        # A later chunk of a prompt: attend to the cache (earlier chunks and this one).
        num_blocks = blocks_for(start + length, self.block_size)
        table = torch.tensor([block_ids[:num_blocks]], dtype=torch.long, device=self.device)
        query = torch.arange(start, start + length, device=self.device)[:, None]
        key = torch.arange(num_blocks * self.block_size, device=self.device)[None, :]
        mask = key <= query
        if self.sliding_window is not None:
            mask &= key > query - self.sliding_window
        return PrefillSpan(start, length, mask[None, None], table)

    def decode_group(self, tables: list[list[int]], contexts: list[int]) -> DecodeGroup:
        """Sequences with these block tables and context lengths (tokens incl. this one)."""
        width = max(len(table) for table in tables)
        # Padded with the row's own first block, never another's: the mask hides the
        # padding, and what a row reads is its own (an additive mask cannot cancel a NaN).
        block_tables = torch.tensor([table + table[:1] * (width - len(table)) for table in tables],
                                    dtype=torch.long, device=self.device)
        context = torch.tensor(contexts, dtype=torch.long, device=self.device)
        slot = torch.arange(width * self.block_size, device=self.device)[None, :]
        mask = slot < context[:, None]
        window = self.sliding_window
        if window is not None:
            mask &= slot > (context[:, None] - 1 - window)
        additive = torch.zeros(mask.shape, dtype=self.dtype, device=self.device)
        return DecodeGroup(len(tables), block_tables,
                           additive.masked_fill_(~mask, float("-inf"))[:, None, None, :])

    def window_mask(self, length: int) -> torch.Tensor | None:
        """Causal mask limited to the sliding window; None (plain causal) when it cannot bite."""
        window = self.sliding_window
        if window is None or length <= window:
            return None
        i = torch.arange(length, device=self.device)
        return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)


def padded_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one int32 ``[rows, longest]`` host tensor, each row's blocks then
    zeros, never read (no row reads past its context). numpy fills a row from a list in
    C: 2.2 ms for 256 tables of ~500 blocks, where padding the lists took 7.4 ms."""
    out = np.zeros((len(tables), max(len(table) for table in tables)), dtype=np.int32)
    for row, table in enumerate(tables):
        out[row, :len(table)] = table
    return torch.from_numpy(out)


def _group_bounds(widths: list[int], max_groups: int = 4) -> list[int]:
    """Split decodes, sorted by ascending width (blocks), into groups so that padding
    each to its longest wastes little: repeatedly cut the first group where it saves the
    most padded blocks, while a cut saves at least an eighth. Returns the groups' ends."""
    ends = [len(widths)] if widths else []
    while ends and len(ends) < max_groups:
        n = ends[0]
        cost = n * widths[n - 1]
        best_k = min(range(1, n), default=None,
                     key=lambda k: k * widths[k - 1] + (n - k) * widths[n - 1])
        if best_k is None:
            break
        saved = cost - (best_k * widths[best_k - 1] + (n - best_k) * widths[n - 1])
        if saved * 8 < cost:
            break
        ends.insert(0, best_k)
    return ends
