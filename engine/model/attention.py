"""One engine step's attention over the paged KV pool: what each token attends to
(``AttentionMetadata``, built by ``core/step_attention.py``) and the computation on each
path (``attend``), which every decoder layer runs after writing the step's K and V.

Tokens are ordered: every prompt chunk, then one token per decoding sequence.

- A first chunk (a prompt from position 0, no cached prefix) is dense already: SDPA over
  its own K/V, causal (within a sliding window), on both paths.
- On ``TORCH_SDPA`` (the CPU's path) a later chunk gathers its sequence's blocks into a
  dense tensor for SDPA under a causal mask, and the decodes are gathered in groups
  padded to their longest, under an additive mask.
- On ``TRITON_ATTN`` (a GPU's path) nothing is gathered: the later chunks read the pool
  in place through the query-tiled kernel (``prefill_attention.py``), the decodes through
  the decode kernel (``paged_attention.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvledger.engine.model.lora import LoraBatch
from kvledger.engine.model.paged_attention import paged_attention
from kvledger.engine.model.prefill_attention import chunk_attention


@dataclass
class PrefillSpan:
    """One prompt chunk: ``length`` query tokens starting at position ``start``.

    The first chunk of a prompt attends to itself only (``block_table`` None; ``mask``
    None means plain causal). A later chunk attends to the cached blocks of everything
    before it plus itself: gathered (``block_table`` ``[1, blocks]``, ``mask`` ``[1, 1,
    length, blocks * block_size]``), or ``in_place``, read from the pool by
    ``AttentionMetadata.chunks`` and skipped here."""

    start: int
    length: int
    mask: torch.Tensor | None
    block_table: torch.Tensor | None = None
    in_place: bool = False


@dataclass
class DecodeGroup:
    """Decoding sequences attended together: block tables padded to the group's longest."""

    num_seqs: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    # [num_seqs, 1, 1, max_blocks * block_size], additive: 0 attend, -inf not (a bool mask
    # would be turned into this by every layer's attention call)
    mask: torch.Tensor


@dataclass
class PagedRows:
    """The step's tokens that read the KV pool in place (``paged_attention.py``): each
    decoding sequence's, as rows. Row ``r`` is
    token ``tokens[r]`` of the step; it reads block table ``block_tables[table_rows[r]]``
    at positions ``[starts[r], ends[r])``. ``max_positions``: the run's max-model-len."""

    tokens: torch.Tensor  # [rows] long
    block_tables: torch.Tensor  # [tables, width] int32
    table_rows: torch.Tensor  # [rows] int32
    starts: torch.Tensor  # [rows] int32
    ends: torch.Tensor  # [rows] int32
    max_positions: int


@dataclass
class PagedChunks:
    """The later prompt chunks that read the KV pool in place (``prefill_attention.py``):
    chunk ``c`` is the step's tokens ``[q_starts[c], q_starts[c] + lengths[c])`` at
    positions from ``starts[c]``, each seeing its sequence (``block_tables[c]``) up to
    itself, within ``sliding_window``. ``max_tokens``: the longest chunk."""

    block_tables: torch.Tensor  # [chunks, width] int32
    q_starts: torch.Tensor  # [chunks] int32
    starts: torch.Tensor  # [chunks] int32
    lengths: torch.Tensor  # [chunks] int32
    max_tokens: int
    sliding_window: int | None


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what they attend to (built by the model runner).

    Tokens are ordered: every prefill chunk, then one token per decoding sequence, group
    after group. ``slot_mapping`` is each token's flat cache slot (``block_id *
    block_size + offset``); None in the profile pass, which has no cache.
    """

    slot_mapping: torch.Tensor | None
    prefills: list[PrefillSpan]
    decode_groups: list[DecodeGroup]
    lora: LoraBatch | None = None  # the rows that carry an adapter (engine/model/lora.py)
    paged: PagedRows | None = None  # on TRITON_ATTN: the decodes, in place
    chunks: PagedChunks | None = None  # on TRITON_ATTN: the later chunks, in place
    # The same step seen through a sliding window, by the sliding layers of a model whose
    # layers differ (Gemma 3, ``StepAttention.layer_window``); None for any other model.
    sliding: AttentionMetadata | None = None


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8: CPU torch cannot index_copy_ or gather float8 directly."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _gather(kv_cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype,
            scales: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of each row's blocks: ``[seqs, kv_heads, blocks * block_size, head_dim]``,
    an fp8 cache's times its ``(k_scale, v_scale)``.

    One index_select (about 2x faster than advanced indexing on the CPU) over
    ``[2, kv_heads, num_blocks, block_size, head_dim]``; heads outermost keeps each
    (sequence, head) a contiguous run of positions."""
    num_seqs, width = block_tables.shape
    _, kv_heads, _, block_size, head_dim = kv_cache.shape
    kv = as_bytes(kv_cache).index_select(2, block_tables.flatten()).view(kv_cache.dtype)
    kv = kv.view(2, kv_heads, num_seqs, width * block_size, head_dim).transpose(1, 2).to(dtype)
    if kv_cache.element_size() == 1 and scales != (1.0, 1.0):
        kv = kv * kv.new_tensor(scales).view(2, 1, 1, 1, 1)
    return kv[0], kv[1]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | None,
           meta: AttentionMetadata, scales: tuple[float, float],
           scale: float | None = None) -> torch.Tensor:
    """Each prefill span over its own K/V (or its gathered blocks), then each decode group
    over its gathered blocks, then what reads the pool in place (later chunks, decode
    rows): ``[tokens, heads, head_dim]`` from q ``[tokens, heads, head_dim]`` and the
    step's k, v ``[tokens, kv_heads, head_dim]``, already in ``kv_cache``. ``scale``: the
    softmax scale, None for 1/sqrt(head_dim)."""
    num_heads, head_dim = q.shape[1:]
    softmax_scale = head_dim ** -0.5 if scale is None else scale
    num_kv_heads = k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous: o_proj views it
    start = 0
    for span in meta.prefills:
        end = start + span.length
        if span.in_place:  # meta.chunks reads it below
            start = end
            continue
        qs = q[start:end].transpose(0, 1).unsqueeze(0)
        if span.block_table is None:
            ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (k, v))
        else:
            ks, vs = _gather(kv_cache, span.block_table, q.dtype, scales)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask,
                                           is_causal=span.mask is None, enable_gqa=True,
                                           scale=scale)
        out[start:end] = o[0].transpose(0, 1)
        start = end
    group_size = num_heads // num_kv_heads
    for group in meta.decode_groups:
        end = start + group.num_seqs
        kd, vd = _gather(kv_cache, group.block_tables, q.dtype, scales)
        # The query heads sharing a K/V head become that head's query rows: no
        # grouped-query support needed from the kernel, which would otherwise
        # repeat the gathered K/V per query head (the math fallback on CUDA does).
        shape = (group.num_seqs, num_kv_heads, group_size, head_dim)
        o = F.scaled_dot_product_attention(q[start:end].view(shape), kd, vd,
                                           attn_mask=group.mask, scale=scale)
        # Copied, not viewed: CUDA's memory-efficient kernel returns its output with
        # heads and rows transposed in memory, so (kv head, row) cannot fold by view.
        out[start:end].view(shape).copy_(o)
        start = end
    if meta.chunks is not None:
        chunks = meta.chunks
        chunk_attention(q, kv_cache, chunks.block_tables, chunks.q_starts, chunks.starts,
                        chunks.lengths, out, max_chunk_tokens=chunks.max_tokens,
                        scale=softmax_scale, kv_scales=scales,
                        sliding_window=chunks.sliding_window)
    if meta.paged is not None:
        rows = meta.paged
        out.index_copy_(0, rows.tokens, paged_attention(
            q.index_select(0, rows.tokens), kv_cache, rows.block_tables, rows.table_rows,
            rows.starts, rows.ends, scale=softmax_scale, kv_scales=scales,
            max_positions=rows.max_positions))
    return out
