"""The paged attention kernel (engine/model/paged_attention.py) under Triton's interpreter,
against SDPA on the gathered tensors: every cache layout the engine serves (fp32, bf16,
fp16, fp8 e4m3/e5m2 with scales; MHA, GQA, MQA; head dims 64-256; block sizes that are
and are not powers of two), ragged rows, block tables with holes, blocks shared by two
sequences, sliding windows, a prompt's later chunk (causal rows), contexts split over
several partitions, and rows that see nothing. On ``KVLEDGER_TEST_DEVICE`` (``cuda``:
bench/gpu_checks.sh, with ``TRITON_INTERPRET=0``) the kernel runs compiled there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _engine_helpers import DEVICE

pytest.importorskip("triton")

from kvledger.engine.model import paged_attention as pa

CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _pool(kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
          cache_dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    values = torch.randn((2, kv_heads, num_blocks, block_size, head_dim), generator=gen)
    return values.clamp(-4, 4).to(cache_dtype)


def _reference(q, kv_cache, tables, table_rows, starts, ends, scale, kv_scales, dtype):
    """Each row alone: its positions gathered from its blocks, dequantised, then SDPA."""
    _, kv_heads, _, block_size, _ = kv_cache.shape
    heads = q.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for r in range(q.shape[0]):
        start, end = int(starts[r]), int(ends[r])
        if start >= end:
            continue
        positions = torch.arange(start, end)
        blocks = tables[int(table_rows[r])][positions // block_size].long()
        k = kv_cache[0][:, blocks, positions % block_size].float() * kv_scales[0]
        v = kv_cache[1][:, blocks, positions % block_size].float() * kv_scales[1]
        o = F.scaled_dot_product_attention(
            q[r].float().view(heads, 1, -1), k.repeat_interleave(heads // kv_heads, 0),
            v.repeat_interleave(heads // kv_heads, 0), scale=scale)
        out[r] = o[:, 0]
    return out


def _check(q, kv_cache, tables, table_rows, starts, ends, *, max_positions,
           kv_scales=(1.0, 1.0)):
    scale = q.shape[-1] ** -0.5
    args = [torch.tensor(x, dtype=torch.int32) for x in (tables, table_rows, starts, ends)]
    got = pa.paged_attention(q.to(DEVICE), kv_cache.to(DEVICE), *(a.to(DEVICE) for a in args),
                             scale=scale, kv_scales=kv_scales,
                             max_positions=max_positions).cpu()
    want = _reference(q, kv_cache, *args, scale, kv_scales, q.dtype)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (4, 4, 64, 16),     # MHA
    (8, 2, 128, 32),    # GQA, group 4
    (4, 1, 80, 16),     # MQA, a head dim that is not a power of two
    (2, 1, 256, 24),    # a block size that is not one either
])
def test_decode_rows_equal_sdpa_on_the_gathered_blocks(cache, heads, kv_heads, head_dim,
                                                       block_size) -> None:
    """Ragged decodes over tables with holes (blocks out of order, ids far apart), two
    sequences sharing a prefix block, one row of a single position."""
    gen = torch.Generator().manual_seed(hash((cache, heads, head_dim)) % 2**31)
    cache_dtype = CACHE_DTYPES[cache]
    q_dtype = torch.float32 if cache_dtype in (torch.float32,) or cache.startswith("fp8") \
        else cache_dtype
    kv_cache = _pool(kv_heads, 12, block_size, head_dim, cache_dtype, gen)
    tables = [[7, 2, 11, 0], [7, 5, 0, 0], [3, 0, 0, 0]]  # 7 shared; padding never read
    lengths = [3 * block_size + 5, block_size + 1, 1]
    q = torch.randn((3, heads, head_dim), generator=gen).to(q_dtype)
    scales = (0.5, 1.75) if cache.startswith("fp8") else (1.0, 1.0)
    _check(q, kv_cache, tables, [0, 1, 2], [0, 0, 0], lengths, max_positions=4 * block_size,
           kv_scales=scales)


def test_a_later_chunk_is_causal_and_a_window_cuts_the_past() -> None:
    """A prompt's later chunk: its rows share one table, each sees up to itself; with a
    window of 7 each sees its last 7 positions only; a row with nothing to see is 0."""
    gen = torch.Generator().manual_seed(3)
    kv_cache = _pool(2, 8, 16, 64, torch.float32, gen)
    table = [[4, 1, 6, 2]]
    chunk_start, chunk = 40, 9
    ends = [chunk_start + i + 1 for i in range(chunk)]
    q = torch.randn((chunk, 4, 64), generator=gen)
    _check(q, kv_cache, table, [0] * chunk, [0] * chunk, ends, max_positions=64)
    _check(q, kv_cache, table, [0] * chunk, [max(0, e - 7) for e in ends], ends,
           max_positions=64)
    _check(q[:2], kv_cache, table, [0, 0], [5, 9], [5, 3], max_positions=64)


@pytest.mark.parametrize("cache", ["fp32", "bf16", "fp8_e4m3"])
def test_a_long_context_split_over_partitions_merges_to_the_whole(cache) -> None:
    """1,300 positions: three partitions of 512 merged by their log-sum-exp, beside a short
    row whose later partitions see nothing."""
    gen = torch.Generator().manual_seed(5)
    cache_dtype = CACHE_DTYPES[cache]
    kv_cache = _pool(1, 90, 16, 64, cache_dtype, gen)
    blocks = torch.randperm(90, generator=gen).tolist()
    tables = [blocks[:82], blocks[82:84] + [0] * 80]
    q_dtype = torch.bfloat16 if cache == "bf16" else torch.float32
    q = torch.randn((2, 2, 64), generator=gen).to(q_dtype)
    _check(q, kv_cache, tables, [0, 1], [0, 0], [1300, 20], max_positions=82 * 16,
           kv_scales=(1.25, 0.75) if cache.startswith("fp8") else (1.0, 1.0))


def test_merging_partitions_weighs_each_by_its_share() -> None:
    """Two halves of one softmax, each normalised, merge to the whole; an empty partition
    (lse -inf) weighs nothing; a row of empty partitions stays 0."""
    gen = torch.Generator().manual_seed(7)
    scores, values = torch.randn(10, generator=gen), torch.randn((10, 3), generator=gen)
    whole = torch.softmax(scores, 0) @ values
    halves = [(torch.softmax(s, 0) @ v, torch.logsumexp(s, 0))
              for s, v in ((scores[:4], values[:4]), (scores[4:], values[4:]))]
    partial = torch.stack([h[0] for h in halves] + [torch.zeros(3)])[None, None]
    lse = torch.tensor([halves[0][1], halves[1][1], float("-inf")])[None, None]
    torch.testing.assert_close(pa.merge_partitions(partial, lse)[0, 0], whole)
    empty = pa.merge_partitions(torch.zeros((1, 1, 2, 3)), torch.full((1, 1, 2), -torch.inf))
    assert torch.equal(empty, torch.zeros((1, 1, 3)))


def test_the_start_up_self_check_passes_and_names_a_kernel_that_fails(monkeypatch) -> None:
    """The engine runs it before it trusts the kernel on a GPU: None when the kernel agrees
    with SDPA; one line naming the failure otherwise."""
    assert pa.self_check(torch.device(DEVICE), torch.float32) is None

    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed\nmore lines")

    monkeypatch.setattr(pa, "paged_attention", broken)
    assert pa.self_check(torch.device(DEVICE), torch.float32) == (
        "RuntimeError: PassManager::run failed")
    monkeypatch.setattr(pa, "paged_attention", lambda q, *args, **kwargs: q * 0 + 1)
    assert pa.self_check(torch.device(DEVICE), torch.float32).startswith(
        "its output differs from SDPA's")
