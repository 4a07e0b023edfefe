"""The engine with ``--attention-backend TRITON_ATTN`` (the GPU's path: decodes and later
prompt chunks read the KV pool in place, engine/model/paged_attention.py and
prefill_attention.py; nothing is gathered) gives the greedy tokens of ``TORCH_SDPA`` (the
CPU's gather path) on the same checkpoint: run here on the CPU under Triton's interpreter,
with prompts joining and leaving the batch, prompts split into chunks, a sliding window
(Mistral), GQA, experts (Qwen3-MoE), prompts sharing cached blocks and fp8 KV caches. On ``KVLEDGER_TEST_DEVICE`` (``cuda``: bench/gpu_checks.sh, with
``TRITON_INTERPRET=0``) the kernel runs compiled and the padded decode steps as captured
CUDA graphs."""

from __future__ import annotations

import random

import pytest
from _engine_helpers import DEVICE

from kvledger.engine import LLM, SamplingParams
from kvledger.engine.core.profile_steps import mixed_step
from kvledger.engine.errors import BadInput
from kvledger.engine.model import attention

pytest.importorskip("triton")


def _no_gather(*args, **kwargs):
    raise AssertionError("the paged path gathered blocks out of the pool")


def _tokens(model_dir, backend: str, prompts, max_tokens: int, *, in_turn: int = 0,
            **kwargs) -> list[list[int]]:
    """Greedy tokens of ``prompts``, the first ``in_turn`` of them generated before the
    rest (so the rest find their blocks cached); on TRITON_ATTN any gather fails."""
    llm = LLM(str(model_dir), dtype="float32", device=DEVICE, attention_backend=backend,
              max_model_len=160, **kwargs)
    assert llm.engine.runner.paged == (backend == "TRITON_ATTN")
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    with pytest.MonkeyPatch.context() as patch:
        if backend == "TRITON_ATTN":
            patch.setattr(attention, "_gather", _no_gather)
        outputs = [out for batch in (prompts[:in_turn], prompts[in_turn:]) if batch
                   for out in llm.generate(batch, params)]
    return [out.token_ids for out in outputs]


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 250) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("name", ["tiny-mistral", "tiny-qwen3-moe"])
def test_reading_the_pool_in_place_gives_the_gathered_paths_tokens(make_model_dir, name):
    """Three sequences at a time over five prompts, a 24-token step budget: prompts of 30
    and 70 tokens go in chunks, and Mistral's 64-token window cuts into the longest;
    Qwen3-MoE's per-head norms and experts (tiny-llama: the shared-prefix test)."""
    model_dir = make_model_dir(name)
    prompts = _prompts(len(name), [5, 30, 70, 12, 1])
    kwargs = dict(max_num_seqs=3, max_num_batched_tokens=24)
    assert (_tokens(model_dir, "TRITON_ATTN", prompts, 10, **kwargs)
            == _tokens(model_dir, "TORCH_SDPA", prompts, 10, **kwargs))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_prompts_sharing_cached_blocks_read_them_in_place(tiny_llama_dir, kv_cache_dtype):
    """Prefix caching: later prompts start with an earlier one's 40 tokens (two and a
    half blocks of 16), so their tables point at its blocks; fp8 blocks are decoded in the
    kernel."""
    shared = _prompts(3, [40])[0]
    prompts = [shared] + [shared + tail for tail in _prompts(4, [9, 23])]
    kwargs = dict(max_num_seqs=4, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=True)
    assert (_tokens(tiny_llama_dir, "TRITON_ATTN", prompts, 10, **kwargs)
            == _tokens(tiny_llama_dir, "TORCH_SDPA", prompts, 10, **kwargs))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_later_chunks_over_cached_prefixes_read_the_pool_in_place(tiny_llama_dir, monkeypatch,
                                                                  kv_cache_dtype):
    """Chunked prefill (24-token steps, so chunks start inside blocks) after prefix-cache
    hits (a 45-token prompt first; then two prompts starting with it, whose tables point at
    its blocks, and one of their own): every later chunk goes through the query-tiled
    kernel, nothing is gathered, and the tokens are the gathered path's."""
    shared = _prompts(5, [45])[0]
    prompts = [shared, *(shared + tail for tail in _prompts(6, [30, 7])), *_prompts(7, [60])]
    kwargs = dict(max_num_seqs=3, max_num_batched_tokens=24, enable_prefix_caching=True,
                  kv_cache_dtype=kv_cache_dtype, in_turn=1)
    gathered = _tokens(tiny_llama_dir, "TORCH_SDPA", prompts, 8, **kwargs)
    chunks, kernel = [], attention.chunk_attention

    def counted(q, kv_cache, tables, q_starts, starts, lengths, out, **kw):
        chunks.extend(starts.tolist())
        return kernel(q, kv_cache, tables, q_starts, starts, lengths, out, **kw)

    monkeypatch.setattr(attention, "chunk_attention", counted)
    assert _tokens(tiny_llama_dir, "TRITON_ATTN", prompts, 8, **kwargs) == gathered
    starts = set(chunks)
    assert any(start % 16 for start in starts), starts  # inside blocks of 16
    assert 32 in starts, starts  # after the cached 2 blocks of the shared 45 tokens


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's refusal")
def test_triton_attention_on_a_cpu_without_the_interpreter_is_refused(tiny_llama_dir,
                                                                       monkeypatch):
    """Triton has no CPU backend: asked for there, the engine refuses in one line, before
    it loads anything."""
    from kvledger.engine.model.loader import Weights

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(Weights, "load", loaded)
    with pytest.raises(BadInput, match="TRITON_ATTN needs Triton and a CUDA device"):
        LLM(str(tiny_llama_dir), device=DEVICE, attention_backend="TRITON_ATTN")


def test_the_mixed_profile_step_reads_the_scratch_block_in_place(tiny_llama_dir, monkeypatch):
    """The start-up profile's heaviest step on the paged path: the decodes are rows seeing
    their whole context in place, so is the later chunk (no gathered copy is made or
    measured), and the step runs over the one-block scratch cache."""
    import torch

    from kvledger.engine.checkpoint.model_config import ModelConfig
    from kvledger.engine.core.runner import ModelRunner
    from kvledger.engine.model.loader import load_model

    device = torch.device(DEVICE)
    model = load_model(tiny_llama_dir, ModelConfig.from_dir(tiny_llama_dir), torch.float32,
                       device)
    runner = ModelRunner(model, device, 64, block_size=16, paged=True)
    ids, positions, meta, _ = mixed_step(runner.attention, 20, 64, 4)
    assert meta.decode_groups == [] and meta.paged is not None
    chunk = meta.prefills[0]
    assert chunk.in_place and chunk.block_table is None and chunk.start + chunk.length == 63
    assert meta.chunks.starts.tolist() == [46] and meta.chunks.lengths.tolist() == [17]
    rows = meta.paged.tokens.tolist()
    assert rows == [17, 18, 19]  # the 3 decodes after the chunk's 17 tokens
    assert meta.paged.ends.tolist() == [positions[r] + 1 for r in rows]
    scratch = runner._new_kv_cache(1, "auto")
    monkeypatch.setattr(attention, "_gather", _no_gather)
    hidden = runner._hidden(ids, positions, meta, scratch)
    assert hidden.shape[0] == 20 and bool(torch.isfinite(hidden).all())


def test_decode_steps_padded_in_static_buffers_give_the_unpadded_tokens(tiny_llama_dir):
    """Without --enforce-eager the paged path runs pure decode steps from static buffers,
    padded to vLLM's capture sizes (5 sequences run as 8, 3 as 4; on CUDA those are the
    captured graphs): the greedy tokens are eager's."""
    prompts = _prompts(9, [3, 17, 9, 30, 6])
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (4, 12, 8, 6, 10)]

    llm = LLM(str(tiny_llama_dir), dtype="float32", device=DEVICE, max_model_len=160,
              attention_backend="TRITON_ATTN", max_num_seqs=8, enforce_eager=True)
    assert llm.engine.runner.decode_graphs is None
    eager = [o.token_ids for o in llm.generate(prompts, params)]
    llm = LLM(str(tiny_llama_dir), dtype="float32", device=DEVICE, max_model_len=160,
              attention_backend="TRITON_ATTN", max_num_seqs=8)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    sizes = []
    run = graphs.run
    graphs.run = lambda *args: sizes.append(len(args[0])) or run(*args)
    padded = [o.token_ids for o in llm.generate(prompts, params)]
    assert {3, 5} & set(sizes), sizes  # steps padded to 4 and 8
    assert padded == eager


def test_a_mixture_of_experts_decodes_eagerly(make_model_dir):
    """Routing reads each expert's token count back to the host, which a graph cannot."""
    llm = LLM(str(make_model_dir("tiny-qwen3-moe")), dtype="float32", device=DEVICE,
              max_model_len=64, attention_backend="TRITON_ATTN")
    assert llm.engine.runner.paged and llm.engine.runner.decode_graphs is None


def test_the_capture_size_flags_choose_the_padded_sizes(tiny_llama_dir):
    """--cudagraph-capture-sizes as vLLM spells it (a size above --max-num-seqs is never
    reached); --max-cudagraph-capture-size cuts vLLM's default list."""
    def sizes(**flags):
        llm = LLM(str(tiny_llama_dir), dtype="float32", device=DEVICE, max_model_len=64,
                  attention_backend="TRITON_ATTN", max_num_seqs=24, **flags)
        return llm.engine.runner.decode_graphs.sizes

    assert sizes() == [1, 2, 4, 8, 16, 24]
    assert sizes(cudagraph_capture_sizes=[3, 12, 48]) == [3, 12]
    assert sizes(max_cudagraph_capture_size=8) == [1, 2, 4, 8]


def test_a_graph_whose_replay_differs_from_the_eager_step_is_not_trusted(tiny_llama_dir):
    """The start-up check after capture: the smallest size replayed against the same step
    run eagerly, one row reading the token it writes into the padding block. A replay that
    agrees passes; one that does not is named; the buffers are as they were after."""
    import torch

    llm = LLM(str(tiny_llama_dir), dtype="float32", device=DEVICE, max_model_len=64,
              attention_backend="TRITON_ATTN", max_num_seqs=4)
    graphs = llm.engine.runner.decode_graphs
    hidden = torch.zeros((1, llm.engine.runner.config.hidden_size))

    class Replays:  # stands in for a captured CUDA graph: what it writes is the test's
        def __init__(self, right: bool) -> None:
            self.right = right

        def replay(self) -> None:
            hidden.copy_(graphs.forward(1) if self.right else torch.zeros_like(hidden))

    graphs.graphs[1] = (Replays(True), hidden)
    assert graphs.replay_check() is None
    graphs.graphs[1] = (Replays(False), hidden)
    assert graphs.replay_check().startswith("max difference")
    assert int(graphs.ends[0]) == 0 and int(graphs.tables[0, 0]) == 0
