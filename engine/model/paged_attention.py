"""Decode attention that reads the KV block pool in place: a Triton kernel, for CUDA
devices.

The CPU path (``attention._gather``) copies each sequence's blocks into a dense tensor
and hands it to SDPA; on a GPU that copy doubles the bytes attention moves and the planner
must set it aside. Here each query token reads its own blocks through its block table.

One call covers a step's decoding sequences, one query token each. A token is a *row*:
the block table it reads (``table_rows``) and the positions it sees, ``[starts, ends)``
(causal, and within a sliding window). Rows may share a table with causal ends, as a
prompt chunk's tokens would, but a later chunk's many queries, one row each, would each
read the whole context again: the engine reads those a tile of queries at a time with the
kernel of ``prefill_attention.py``, which shares this module's helpers (``decode_fp8``,
``next_pow2``, ``first_line``). Positions outside are never read (a loop bound and a load
mask), not masked with -inf after the fact; a row that sees nothing gets zeros.

Work is split as in vLLM's paged attention v2 / flash-decoding: a program per (row, KV
head, partition of ``PARTITION_TOKENS`` positions), so one long sequence fills the GPU;
each program does an online softmax over its blocks and the partitions are merged by
their log-sum-exp. The query heads that share a KV head are computed together (GQA/MQA).

Cache layout (the engine's, ``core/runner.py``): ``[2 (K, V), kv_heads, num_blocks,
block_size, head_dim]``. An fp8 cache (e4m3fn or e5m2, read as bytes) is decoded in the
kernel and times its ``(k_scale, v_scale)``. Block sizes and head dims need not be powers
of two (they are padded inside the kernel and the padding is not read).

The kernel is tested on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``) against
SDPA on the gathered tensors (tests/engine/model/test_paged_attention.py).
"""

from __future__ import annotations

import os

import torch

from kvledger.engine.errors import BadInput

PARTITION_TOKENS = 512  # positions per program: long contexts spread over the GPU

FP8_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # the kernels' code for each format


try:  # a test extra on the CPU; CUDA builds of torch bring it
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def available(device: torch.device) -> bool:
    """Whether this device reads the cache in place: a CUDA device with Triton, or the
    CPU under Triton's interpreter (the tests)."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def require(device: torch.device) -> None:
    """BadInput, one line, when ``--attention-backend TRITON_ATTN`` cannot run here."""
    if not available(device):
        raise BadInput(f"--attention-backend TRITON_ATTN needs Triton and a CUDA device "
                       f"(torch's CUDA builds bring Triton); this is {device.type}: use "
                       "TORCH_SDPA")


if triton is not None:
    @triton.jit
    def decode_fp8(raw, fmt: tl.constexpr):
        """Bytes of float8 (``fmt`` 1: e4m3fn, 2: e5m2) as float32; saturating writes
        never store a NaN, so its code is not special-cased."""
        bits = raw.to(tl.int32)
        sign = tl.where((bits >> 7) != 0, -1.0, 1.0)
        if fmt == 1:
            exp = (bits >> 3) & 0xF
            man = (bits & 0x7).to(tl.float32)
            normal = (1.0 + man / 8.0) * tl.exp2((exp - 7).to(tl.float32))
            value = tl.where(exp == 0, man * (1.0 / 512.0), normal)
        else:
            exp = (bits >> 2) & 0x1F
            man = (bits & 0x3).to(tl.float32)
            normal = (1.0 + man / 4.0) * tl.exp2((exp - 15).to(tl.float32))
            value = tl.where(exp == 0, man * (1.0 / 65536.0), normal)
        return sign * value

    @triton.jit
    def paged_attention_part(
            q_ptr, cache_ptr, tables_ptr, table_rows_ptr, starts_ptr, ends_ptr,
            out_ptr, lse_ptr,
            scale, k_scale, v_scale,
            num_blocks, table_width, kv_heads,
            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
            HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
            BLOCK: tl.constexpr, BLOCK_PAD: tl.constexpr,
            PART_BLOCKS: tl.constexpr, NUM_PARTS: tl.constexpr, FP8: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        part = tl.program_id(2)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_PAD)
        t = tl.arange(0, BLOCK_PAD)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        # q: [rows, kv_heads * GROUP, HEAD_DIM]; this program's query heads.
        q_rows = (row * kv_heads * GROUP + head * GROUP + g) * HEAD_DIM
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        start = tl.load(starts_ptr + row)
        end = tl.load(ends_ptr + row)
        table_row = tl.load(table_rows_ptr + row)
        first = tl.maximum(start // BLOCK, part * PART_BLOCKS)
        last = tl.minimum((end + BLOCK - 1) // BLOCK, (part + 1) * PART_BLOCKS)
        # Every block in [first, last) holds a position seen, so the running max is finite
        # after the first; a row that sees nothing reads no block.
        last = tl.where(end > start, last, first)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
        plane = num_blocks * BLOCK * HEAD_DIM  # one (K or V, kv head) plane of the pool
        k_base = cache_ptr + head.to(tl.int64) * plane
        v_base = cache_ptr + (kv_heads + head).to(tl.int64) * plane
        for b in range(first, last):
            block = tl.load(tables_ptr + table_row.to(tl.int64) * table_width + b).to(tl.int64)
            pos = b * BLOCK + t
            seen = (t < BLOCK) & (pos >= start) & (pos < end)
            where = block * BLOCK * HEAD_DIM + t[:, None] * HEAD_DIM + d[None, :]
            ok = seen[:, None] & d_ok[None, :]
            if FP8 == 0:
                k = tl.load(k_base + where, mask=ok, other=0.0).to(tl.float32)
                v = tl.load(v_base + where, mask=ok, other=0.0).to(tl.float32)
            else:
                k = decode_fp8(tl.load(k_base + where, mask=ok, other=0), FP8) * k_scale
                v = decode_fp8(tl.load(v_base + where, mask=ok, other=0), FP8) * v_scale
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP, BLOCK]
            scores = tl.where(seen[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        # Normalised within the partition, with its log-sum-exp for the merge; a partition
        # that saw nothing has lse -inf and zeros.
        some = l_i > 0
        out = acc / tl.where(some, l_i, 1.0)[:, None]
        lse = tl.where(some, m_i + tl.log(tl.where(some, l_i, 1.0)), float("-inf"))
        slot = (row * kv_heads * GROUP + head * GROUP + g) * NUM_PARTS + part
        tl.store(out_ptr + slot[:, None] * HEAD_DIM + d[None, :], out,
                 mask=g_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + slot, lse, mask=g_ok)



def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    table_rows: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, *,
                    scale: float, kv_scales: tuple[float, float] = (1.0, 1.0),
                    max_positions: int) -> torch.Tensor:
    """Each row of ``q`` ``[rows, heads, head_dim]`` attending to positions ``[starts,
    ends)`` of the sequence whose block table is ``block_tables[table_rows]`` (int32
    tensors, ``block_tables`` ``[tables, width]``), over ``kv_cache`` in place; returns
    ``[rows, heads, head_dim]`` in ``q``'s dtype. ``max_positions`` bounds every ``ends``
    (the run's max-model-len): the grid depends on it only, not on this step's lengths, so
    a captured graph replays it."""
    rows, heads, head_dim = q.shape
    _, kv_heads, num_blocks, block_size, cache_dim = kv_cache.shape
    if cache_dim != head_dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not match the cache {tuple(kv_cache.shape)}")
    group = heads // kv_heads
    part_blocks = max(1, PARTITION_TOKENS // block_size)
    num_parts = max(1, -(-max_positions // (part_blocks * block_size)))
    fp8 = FP8_FORMATS.get(kv_cache.dtype, 0)
    cache = kv_cache.view(torch.uint8) if fp8 else kv_cache
    partial = torch.empty((rows, heads, num_parts, head_dim), dtype=torch.float32,
                          device=q.device)
    lse = torch.empty((rows, heads, num_parts), dtype=torch.float32, device=q.device)
    if rows:
        paged_attention_part[(rows, kv_heads, num_parts)](
            q.contiguous(), cache, block_tables, table_rows, starts, ends, partial, lse,
            scale, float(kv_scales[0]), float(kv_scales[1]),
            num_blocks, block_tables.shape[1], kv_heads,
            GROUP=group, GROUP_PAD=next_pow2(group),
            HEAD_DIM=head_dim, HEAD_PAD=next_pow2(head_dim),
            BLOCK=block_size, BLOCK_PAD=next_pow2(block_size),
            PART_BLOCKS=part_blocks, NUM_PARTS=num_parts, FP8=fp8)
    if num_parts == 1:
        return partial[:, :, 0].to(q.dtype)
    return merge_partitions(partial, lse).to(q.dtype)


def self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run the kernel once on this device (compiling it) against SDPA on the same blocks:
    None when it agrees, else what went wrong, in one line. The engine checks at start-up,
    so a kernel that cannot run on a card is refused by name, not met mid-request."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn((2, 2, 4, 16, 64), generator=gen).to(device=device, dtype=dtype)
    q = torch.randn((2, 4, 64), generator=gen).to(device=device, dtype=dtype)
    tables = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32, device=device)
    ends = torch.tensor([20, 9], dtype=torch.int32, device=device)
    try:
        got = paged_attention(q, cache, tables, torch.arange(2, dtype=torch.int32, device=device),
                              torch.zeros(2, dtype=torch.int32, device=device), ends,
                              scale=64 ** -0.5, max_positions=32)
    except Exception as exc:  # Triton's compile and launch errors have no common base
        return first_line(exc)
    for row in range(2):
        n = int(ends[row])
        blocks = tables[row].long()[torch.arange(n, device=device) // 16]
        k, v = (cache[i][:, blocks, torch.arange(n, device=device) % 16] for i in (0, 1))
        want = torch.nn.functional.scaled_dot_product_attention(
            q[row].view(4, 1, 64).float(), k.float().repeat_interleave(2, 0),
            v.float().repeat_interleave(2, 0))[:, 0]
        if not torch.allclose(got[row].float(), want, atol=2e-2, rtol=2e-2):
            return f"its output differs from SDPA's by {(got[row].float() - want).abs().max():.3g}"
    return None


def first_line(exc: Exception) -> str:
    """A kernel's compile or launch error as one line, for a start-up refusal."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"


def merge_partitions(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``[rows, heads, parts, head_dim]`` normalised partial outputs and their log-sum-exp
    ``[rows, heads, parts]`` -> ``[rows, heads, head_dim]``: each weighted by its share of
    the whole softmax. Partitions that saw nothing (lse -inf) weigh 0; a row that saw
    nothing at all stays 0."""
    top = lse.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weight = torch.exp(lse - top)  # exp(-inf) = 0
    total = weight.sum(dim=-1, keepdim=True)
    weight = weight / torch.where(total > 0, total, torch.ones_like(total))
    return (partial * weight.unsqueeze(-1)).sum(dim=2)


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for 0): a kernel's padded tile size."""
    return 1 << max(0, (n - 1).bit_length())
