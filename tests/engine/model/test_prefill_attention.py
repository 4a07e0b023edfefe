"""The later prompt chunks' kernel (engine/model/prefill_attention.py) under Triton's
interpreter, against SDPA on the gathered tensors under a causal mask: every cache layout
the engine serves (fp32, bf16, fp16, fp8 e4m3/e5m2 with scales; MHA, GQA, MQA; head dims
64-256, 80 and 96 among them; block sizes 16, 32 and 24), two ragged chunks in one call
whose tables have holes and share prefix blocks, chunks from position 0 and from a
position inside a block, sliding windows, chunks over several query tiles, and positions
no query sees never read (poisoned with NaN). On ``KVLEDGER_TEST_DEVICE`` (``cuda``:
bench/gpu_checks.sh, with ``TRITON_INTERPRET=0``) the kernel runs compiled there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _engine_helpers import DEVICE

pytest.importorskip("triton")

from kvledger.engine.model import prefill_attention as pf

CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
NAN_BITS = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7F}  # each format's NaN


def _pool(kv_heads, num_blocks, block_size, head_dim, cache_dtype, gen) -> torch.Tensor:
    values = torch.randn((2, kv_heads, num_blocks, block_size, head_dim), generator=gen)
    return values.clamp(-4, 4).to(cache_dtype)


def _reference(q, kv_cache, table, start, length, window, scale, kv_scales) -> torch.Tensor:
    """One chunk: its sequence's positions ``[0, start + length)`` gathered from its
    blocks and dequantised, then SDPA, query ``p`` seeing ``(p - window, p]``."""
    _, kv_heads, _, block_size, _ = kv_cache.shape
    heads = q.shape[1]
    positions = torch.arange(start + length)
    blocks = torch.tensor(table)[positions // block_size]
    k, v = (kv_cache[i][:, blocks, positions % block_size].float() * kv_scales[i]
            for i in (0, 1))
    query = torch.arange(start, start + length)[:, None]
    mask = positions[None, :] <= query
    if window is not None:
        mask &= positions[None, :] > query - window
    return F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.repeat_interleave(heads // kv_heads, 0),
        v.repeat_interleave(heads // kv_heads, 0), attn_mask=mask, scale=scale).transpose(0, 1)


def _poison_unseen(kv_cache, chunks, window) -> torch.Tensor:
    """The pool with every position of the chunks' blocks that none of their queries
    sees (before the window, after the last query) made NaN: a kernel that read one, even
    to mask it, would carry the NaN into its output. Blocks both tables share keep what a
    query of either sees."""
    block_size = kv_cache.shape[3]
    seen: dict[tuple[int, int], bool] = {}
    for table, start, length in chunks:
        first = 0 if window is None else max(0, start - window + 1)
        for p in range(len(table) * block_size):
            key = (table[p // block_size], p % block_size)
            seen[key] = seen.get(key, False) or first <= p < start + length
    poisoned = kv_cache.clone()
    raw = poisoned.view(torch.uint8) if kv_cache.element_size() == 1 else poisoned
    nan = NAN_BITS.get(kv_cache.dtype, float("nan"))
    for (block, offset), visible in seen.items():
        if not visible:
            raw[:, :, block, offset] = nan
    return poisoned


def _check(q, kv_cache, chunks, *, window=None, kv_scales=(1.0, 1.0)) -> None:
    """``chunks``: (table, start, length) each; their queries are ``q``'s rows in order,
    after one leading row that is no chunk's (it must be left as it was)."""
    scale = q.shape[-1] ** -0.5
    width = max(len(table) for table, _, _ in chunks)
    tables = torch.tensor([t + [0] * (width - len(t)) for t, _, _ in chunks], dtype=torch.int32)
    q_starts = [1 + sum(n for _, _, n in chunks[:c]) for c in range(len(chunks))]

    def ints(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    out = torch.full(q.shape, 7.0, dtype=q.dtype, device=DEVICE)
    pool = _poison_unseen(kv_cache, chunks, window)
    got = pf.chunk_attention(
        q.to(DEVICE), pool.to(DEVICE), tables.to(DEVICE), ints(q_starts),
        ints([s for _, s, _ in chunks]), ints([n for _, _, n in chunks]), out,
        max_chunk_tokens=max(n for _, _, n in chunks), scale=scale, kv_scales=kv_scales,
        sliding_window=window).cpu()
    assert got.dtype == q.dtype and torch.equal(got[0], torch.full_like(got[0], 7.0))
    tol = TOLERANCE[q.dtype]
    for (table, start, length), first in zip(chunks, q_starts, strict=True):
        want = _reference(q[first:first + length], kv_cache, table, start, length, window,
                          scale, kv_scales)
        torch.testing.assert_close(got[first:first + length].float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (4, 4, 64, 16),     # MHA
    (8, 2, 128, 32),    # GQA, group 4
    (4, 1, 80, 16),     # MQA, a head dim that is not a power of two
    (6, 2, 96, 24),     # group 3, nor is 96, nor a block of 24
    (2, 1, 256, 16),    # the widest head
])
def test_later_chunks_equal_sdpa_on_the_gathered_blocks(cache, heads, kv_heads, head_dim,
                                                        block_size) -> None:
    """Two ragged chunks in one call: one from inside its third block (after a cached
    prefix, across query tiles), one of 5 tokens; their tables have holes (blocks out of
    order, ids far apart) and share their first block (a cached prefix)."""
    gen = torch.Generator().manual_seed(hash((cache, heads, head_dim)) % 2**31)
    cache_dtype = CACHE_DTYPES[cache]
    q_dtype = torch.float32 if cache_dtype == torch.float32 or cache.startswith("fp8") \
        else cache_dtype
    kv_cache = _pool(kv_heads, 14, block_size, head_dim, cache_dtype, gen)
    start = 2 * block_size + 3
    chunks = [([9, 2, 13, 0, 6], start, 2 * block_size), ([9, 4], block_size - 2, 5)]
    q = torch.randn((1 + 2 * block_size + 5, heads, head_dim), generator=gen).to(q_dtype)
    scales = (0.5, 1.75) if cache.startswith("fp8") else (1.0, 1.0)
    _check(q, kv_cache, chunks, kv_scales=scales)


@pytest.mark.parametrize("window", [None, 7, 40, 100])
def test_a_window_cuts_the_past_and_a_chunk_from_position_0_sees_itself(window) -> None:
    """GQA over blocks of 16, bf16 (tiles of 32 queries, 64 positions): a chunk from
    position 0 (no cached prefix) beside one from position 150 that spans two query tiles,
    each query seeing its last ``window`` positions: a tile walks the window's edge
    masked, what all its rows see unmasked, the diagonal masked; what no query sees is
    poisoned."""
    gen = torch.Generator().manual_seed(11)
    kv_cache = _pool(2, 16, 16, 64, torch.bfloat16, gen)
    later = [5, 10, 2, 7, 11, 0, 13, 4, 15, 9, 6, 12]
    chunks = [([3, 8, 1], 0, 40), (later, 150, 36)]
    q = torch.randn((1 + 40 + 36, 8, 64), generator=gen).to(torch.bfloat16)
    _check(q, kv_cache, chunks, window=window)


def test_the_queries_of_a_fused_projection_are_read_through_their_strides() -> None:
    """The engine's q is a view of the fused q/k projection ``[tokens, heads + kv_heads,
    head_dim][:, :heads]``: read where it lies, not copied."""
    gen = torch.Generator().manual_seed(13)
    kv_cache = _pool(2, 6, 16, 64, torch.float32, gen)
    qk = torch.randn((1 + 20, 4 + 2, 64), generator=gen)
    _check(qk[:, :4], kv_cache, [([4, 0, 5], 19, 20)])


def test_the_tiles_take_the_query_heads_sharing_a_kv_head_as_rows() -> None:
    """128 rows (FlashAttention-2's tile) for 16-bit rows up to 128 wide, else 64; a group
    wider than that widens the tile; nothing under 16 (``tl.dot``'s least)."""
    assert pf.tile_shape(4, 128, torch.bfloat16) == (128, 64, 8)
    assert pf.tile_shape(4, 80, torch.float16) == (128, 64, 8)
    assert pf.tile_shape(4, 256, torch.bfloat16) == (64, 32, 4)
    assert pf.tile_shape(1, 64, torch.float32) == (64, 32, 4)
    assert pf.tile_shape(256, 64, torch.bfloat16) == (256, 64, 8)


def test_the_start_up_self_check_passes_and_names_a_kernel_that_fails(monkeypatch) -> None:
    """The engine runs it beside the decode kernel's before it trusts the kernels on a GPU:
    None when the kernel agrees with SDPA; one line naming the failure otherwise."""
    assert pf.self_check(torch.device(DEVICE), torch.float32) is None

    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed\nmore lines")

    monkeypatch.setattr(pf, "chunk_attention", broken)
    assert pf.self_check(torch.device(DEVICE), torch.float32) == (
        "RuntimeError: PassManager::run failed")
    monkeypatch.setattr(pf, "chunk_attention", lambda q, *args, **kwargs: q * 0 + 1)
    assert pf.self_check(torch.device(DEVICE), torch.float32).startswith(
        "its output differs from SDPA's")


def test_both_kernels_modules_import_without_triton():
    """A plain install has no Triton (it is a test extra; CUDA builds of torch bring it):
    the modules still import, and the path is refused by name (``paged_attention.require``)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = sys.modules['triton.language'] = None\n"
            "import torch\n"
            "from kvledger.engine.model import paged_attention, prefill_attention\n"
            "assert prefill_attention.triton is None\n"
            "assert not paged_attention.available(torch.device('cpu'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
