"""A later prompt chunk's attention, read from the KV block pool in place: a Triton
kernel tiled over the chunk's queries, for CUDA devices.

A later chunk (a long prompt cut in chunks, or the tail of a prompt after a prefix-cache
hit) attends to the cached blocks of everything before it and to its own tokens, whose K
and V the layer has written into the pool first (``Attention.forward``). Read one query
at a time, as the decode kernel (``paged_attention.py``) reads, each of its many queries
would read the whole context again; gathered into a dense copy for SDPA, the copy is
activation memory the planner must set aside. Here one program takes a *tile* of
``BLOCK_M`` query rows of one chunk and one KV head, ``BLOCK_Q`` tokens times the
``GROUP`` query heads sharing that KV head (flattened into the rows, as vLLM's Triton
unified attention does), and walks the chunk's block table ``TILE_N`` positions at a
time: ``tl.dot`` for QK^T and PV, an online softmax, each K/V tile read once per tile of
queries.

Causality by bounds, not by masking after the fact: query at position ``p`` sees
``[first_seen(p), p]`` (``first_seen`` 0, or ``p - window + 1`` under a sliding window);
a tile walks only ``[first_seen(its first query), its last query]``, so blocks no query of
it can see are never read, and scores are cut by ``tl.where`` only where the tile
straddles a boundary.

No partitions (the decode kernel's split of long contexts, merged by log-sum-exp): a
chunk's tiles already fill the GPU (a 2,048-token chunk of Llama-3-8B is 64 tiles x 8 KV
heads = 512 programs), and the partial outputs of ``tokens x heads x parts x head_dim``
float32 (512 MiB for that chunk over 8k positions in parts of 512) would be the activation memory this
kernel exists to save.

Every layout the decode kernel reads (fp32/bf16/fp16, fp8 e4m3fn/e5m2 decoded in the kernel
and times ``(k_scale, v_scale)``; MHA/GQA/MQA; head dims and block sizes that are not
powers of two, padded inside) is read here. Tested on the CPU under Triton's interpreter
against SDPA on the gathered tensors (tests/engine/model/test_prefill_attention.py).
"""

from __future__ import annotations

import torch

from kvledger.engine.model.paged_attention import (
    FP8_FORMATS,
    first_line,
    next_pow2,
    tl,
    triton,
)

if triton is not None:  # a plain install has no Triton: the module still imports
    from kvledger.engine.model.paged_attention import decode_fp8

    @triton.jit
    def attend_positions(q, acc, m_i, l_i, n0, hi, pos_q, seen_from, table, k_base, v_base,
                         scale_log2, k_scale, v_scale,
                         HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK: tl.constexpr,
                         TILE_N: tl.constexpr, FP8: tl.constexpr, EXACT: tl.constexpr,
                         MASKED: tl.constexpr):
        """Positions ``[n0, min(n0 + TILE_N, hi))`` of the chunk's sequence into the tile's
        online softmax (``acc``, running max ``m_i`` and sum ``l_i``, in exp2's base).
        ``MASKED``: the rows do not all see every one of them (a window's edge, the
        diagonal), so each row's scores outside ``[seen_from, pos_q]`` are cut."""
        d = tl.arange(0, HEAD_PAD)
        pos = n0 + tl.arange(0, TILE_N)
        d_ok = d < HEAD_DIM
        inside = pos < hi
        block = tl.load(table + pos // BLOCK, mask=inside, other=0).to(tl.int64)
        slot = (block * BLOCK + pos % BLOCK) * HEAD_DIM
        k_ok = d_ok[:, None] & inside[None, :]
        v_ok = inside[:, None] & d_ok[None, :]
        if FP8 == 0:
            k = tl.load(k_base + slot[None, :] + d[:, None], mask=k_ok, other=0.0)
            v = tl.load(v_base + slot[:, None] + d[None, :], mask=v_ok, other=0.0)
        else:
            k = decode_fp8(tl.load(k_base + slot[None, :] + d[:, None], mask=k_ok, other=0),
                           FP8) * k_scale
            v = decode_fp8(tl.load(v_base + slot[:, None] + d[None, :], mask=v_ok, other=0),
                           FP8) * v_scale
        k = k.to(q.dtype)  # [HEAD_PAD, TILE_N]: K^T
        v = v.to(q.dtype)
        # fp32 stays fp32 (no TF32), as SDPA computes it; 16 bits multiply as 16 bits.
        scores = (tl.dot(q, k, input_precision="ieee") if EXACT else tl.dot(q, k)) * scale_log2
        if MASKED:
            seen = (inside[None, :] & (pos[None, :] <= pos_q[:, None])
                    & (pos[None, :] >= seen_from[:, None]))
            scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row that has seen nothing yet keeps m -inf: exp2 of (-inf - 0) is 0, no NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = tl.dot(p, v, input_precision="ieee") if EXACT else tl.dot(p.to(v.dtype), v)
        return acc * alpha[:, None] + pv, m_new, l_i

    @triton.jit
    def chunk_attention_tile(
            q_ptr, out_ptr, cache_ptr, tables_ptr, q_starts_ptr, starts_ptr, lengths_ptr,
            scale_log2, k_scale, v_scale, window,
            q_stride_t, q_stride_h, out_stride_t, out_stride_h,
            num_blocks, table_width, kv_heads, num_tiles,
            GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
            HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK: tl.constexpr,
            TILE_N: tl.constexpr, FP8: tl.constexpr, EXACT: tl.constexpr):
        # The last tiles see the most positions: started first, they do not trail.
        tile = num_tiles - 1 - tl.program_id(0)
        head = tl.program_id(1)
        chunk = tl.program_id(2)
        length = tl.load(lengths_ptr + chunk)
        if tile * BLOCK_Q >= length:  # the grid is as tall as the longest chunk
            return
        q_start = tl.load(q_starts_ptr + chunk)
        first_pos = tl.load(starts_ptr + chunk)
        m = tl.arange(0, BLOCK_M)
        d = tl.arange(0, HEAD_PAD)
        d_ok = d < HEAD_DIM
        token = tile * BLOCK_Q + m // GROUP  # within the chunk
        row_ok = (m < BLOCK_Q * GROUP) & (token < length)
        heads = head * GROUP + m % GROUP
        q_rows = (q_start + token).to(tl.int64) * q_stride_t + heads * q_stride_h
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                    other=0.0)
        if EXACT:
            q = q.to(tl.float32)
        pos_q = first_pos + token
        seen_from = tl.where(window > 0, tl.maximum(pos_q - window + 1, 0), 0)
        # The tile's queries sit at [first, last]; together they see [lo, last], and every
        # one of them sees [full_lo, first]: that part runs unmasked, whole tiles of it.
        first = first_pos + tile * BLOCK_Q
        last = first_pos + tl.minimum((tile + 1) * BLOCK_Q, length) - 1
        lo = tl.where(window > 0, tl.maximum(first - window + 1, 0), 0)
        full_lo = tl.minimum(tl.where(window > 0, tl.maximum(last - window + 1, 0), 0), first + 1)
        full_hi = full_lo + (first + 1 - full_lo) // TILE_N * TILE_N
        hi = last + 1
        table = tables_ptr + chunk.to(tl.int64) * table_width
        plane = num_blocks * BLOCK * HEAD_DIM  # one (K or V, kv head) plane of the pool
        k_base = cache_ptr + head.to(tl.int64) * plane
        v_base = cache_ptr + (kv_heads + head).to(tl.int64) * plane
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        for n0 in range(lo, full_lo, TILE_N):  # the window's edge: seen by the later rows only
            acc, m_i, l_i = attend_positions(
                q, acc, m_i, l_i, n0, full_lo, pos_q, seen_from, table, k_base, v_base,
                scale_log2, k_scale, v_scale, HEAD_DIM, HEAD_PAD, BLOCK, TILE_N, FP8, EXACT,
                True)
        for n0 in range(full_lo, full_hi, TILE_N):  # seen by every row
            acc, m_i, l_i = attend_positions(
                q, acc, m_i, l_i, n0, full_hi, pos_q, seen_from, table, k_base, v_base,
                scale_log2, k_scale, v_scale, HEAD_DIM, HEAD_PAD, BLOCK, TILE_N, FP8, EXACT,
                False)
        for n0 in range(full_hi, hi, TILE_N):  # the diagonal: each row up to itself
            acc, m_i, l_i = attend_positions(
                q, acc, m_i, l_i, n0, hi, pos_q, seen_from, table, k_base, v_base,
                scale_log2, k_scale, v_scale, HEAD_DIM, HEAD_PAD, BLOCK, TILE_N, FP8, EXACT,
                True)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_rows = (q_start + token).to(tl.int64) * out_stride_t + heads * out_stride_h
        tl.store(out_ptr + out_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


def tile_shape(group: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """``(BLOCK_M, TILE_N, num_warps)``: query rows and positions a program takes at once.

    128 rows (FlashAttention-2's tile) where a row of q fits in 16 bits x 128; else 64, so
    q, the accumulator and two K/V tiles in flight stay within a consumer card's registers
    and shared memory. 64 positions a step, 32 for wider rows. A group wider than the tile
    (never seen in a released model) widens it. Sizes are at least 16: ``tl.dot``'s least."""
    head_pad = max(16, next_pow2(head_dim))
    narrow = head_pad <= 128 and dtype.itemsize <= 2
    block_m = max(128 if narrow else 64, next_pow2(group))
    return block_m, 64 if narrow else 32, 8 if block_m >= 128 else 4


def chunk_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    q_starts: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                    out: torch.Tensor, *, max_chunk_tokens: int, scale: float,
                    kv_scales: tuple[float, float] = (1.0, 1.0),
                    sliding_window: int | None = None) -> torch.Tensor:
    """Chunk ``c``'s queries, ``q[q_starts[c]:q_starts[c] + lengths[c]]`` of ``q`` ``[tokens,
    heads, head_dim]`` at positions ``starts[c]`` on, each attending causally (within
    ``sliding_window``) to the sequence whose block table is ``block_tables[c]`` (int32
    tensors), over ``kv_cache`` in place, its own K/V already written there. Writes those
    rows of ``out`` (``q``'s shape; the step's output, other rows untouched) and returns it.
    ``max_chunk_tokens`` bounds every ``lengths`` (the grid's height)."""
    _, heads, head_dim = q.shape
    _, kv_heads, num_blocks, block_size, cache_dim = kv_cache.shape
    if cache_dim != head_dim or heads % kv_heads or out.shape != q.shape:
        raise ValueError(f"q {tuple(q.shape)} does not match the cache {tuple(kv_cache.shape)}"
                         f" or out {tuple(out.shape)}")
    chunks = lengths.shape[0]
    if chunks == 0 or max_chunk_tokens == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = heads // kv_heads
    block_m, tile_n, warps = tile_shape(group, head_dim, q.dtype)
    block_q = block_m // group
    num_tiles = -(-max_chunk_tokens // block_q)
    fp8 = FP8_FORMATS.get(kv_cache.dtype, 0)
    chunk_attention_tile[(num_tiles, kv_heads, chunks)](
        q, out, kv_cache.view(torch.uint8) if fp8 else kv_cache, block_tables, q_starts,
        starts, lengths,
        scale * 1.4426950408889634, float(kv_scales[0]), float(kv_scales[1]),
        sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        num_blocks, block_tables.shape[1], kv_heads, num_tiles,
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        HEAD_DIM=head_dim, HEAD_PAD=max(16, next_pow2(head_dim)), BLOCK=block_size,
        TILE_N=tile_n, FP8=fp8, num_warps=warps,
        # On the CPU (Triton's interpreter, the tests) 16-bit products in fp32: the
        # interpreter's tl.dot multiplies bf16 as its raw bits (Triton 3.x, create_dot).
        EXACT=q.dtype == torch.float32 or q.device.type == "cpu")
    return out


def self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run the kernel once on this device (compiling it) against SDPA on the same blocks:
    a 20-token chunk from position 13 over three blocks out of order. None when it agrees,
    else what went wrong, in one line (``paged_attention.self_check``'s contract)."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn((2, 2, 4, 16, 64), generator=gen).to(device=device, dtype=dtype)
    q = torch.randn((20, 4, 64), generator=gen).to(device=device, dtype=dtype)

    def ints(*values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    try:
        got = chunk_attention(q, cache, ints([3, 1, 0]), ints(0), ints(13), ints(20),
                              torch.zeros_like(q), max_chunk_tokens=20, scale=64 ** -0.5)
    except Exception as exc:  # Triton's compile and launch errors have no common base
        return first_line(exc)
    positions = torch.arange(33, device=device)
    blocks = torch.tensor([3, 1, 0], device=device)[positions // 16]
    k, v = (cache[i][:, blocks, positions % 16].float().repeat_interleave(2, 0) for i in (0, 1))
    mask = positions[None, :] <= positions[13:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)
    if not torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2):
        return f"its output differs from SDPA's by {(got.float() - want).abs().max():.3g}"
    return None
