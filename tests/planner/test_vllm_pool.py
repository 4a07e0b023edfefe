"""vLLM's KV pool for MLA and hybrid layouts, derived from its code, against the plan."""

from __future__ import annotations

import dataclasses

import pytest
from published_models import published_shape

from kvledger.engine.checkpoint.contents import WeightsInfo
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.planner.plan import Measured, make_plan
from kvledger.engine.settings.config import EngineConfig

GiB = 2**30

# vllm/v1/kv_cache_interface.py: a layer's page is block_size tokens of 2 * kv_heads *
# head_size elements (FullAttentionSpec, SlidingWindowSpec) or 1 * head_size for MLA's latent
# (MLAAttentionSpec, num_kv_heads 1). vllm/v1/core/kv_cache_utils.py: layers of one spec form
# one group, or, when specs differ, groups of group_size layers
# (_get_kv_cache_groups_uniform_page_size); num_blocks = available // page // group_size
# (get_kv_cache_config_from_groups, get_num_blocks); a request needs, per group, its spec's
# max_memory_usage_bytes in pages (get_max_concurrency_for_kv_cache_config).

def _vllm_pool(specs: list[tuple], block_size: int, dtype_bytes: int, available: int,
               max_model_len: int, batched_tokens: int) -> tuple[int, int]:
    """(num_blocks, blocks one request needs) as vLLM computes them, for per-layer specs
    ``(kind, kv_heads, head_size, window)``; written from the functions named above."""
    def page(spec):
        kind, heads, size, _ = spec
        return (1 if kind == "mla" else 2) * block_size * heads * size * dtype_bytes

    def max_usage_pages(spec):
        kind, _, _, window = spec
        if kind != "sliding":
            return -(-max_model_len // block_size)
        return -(-min(window - 1 + batched_tokens, max_model_len) // block_size) + 1

    by_spec: dict[tuple, list[int]] = {}
    for layer, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(layer)
    counts = [len(layers) for layers in by_spec.values()]
    if len(by_spec) == 1:
        groups = [(spec, layers) for spec, layers in by_spec.items()]
    else:
        size = max(counts) if max(counts) < min(counts) * 1.5 else min(counts)
        groups = []
        for spec, layers in by_spec.items():
            n = -(-len(layers) // size)
            groups += [(spec, layers[i::n]) for i in range(n)]
    group_size = max(len(layers) for _, layers in groups)
    (page_bytes,) = {page(spec) for spec, _ in groups}
    num_blocks = available // page_bytes // group_size
    usage = group_size * sum(max_usage_pages(spec) * page_bytes for spec, _ in groups)
    return num_blocks, -(-usage // (page_bytes * group_size))


# DeepSeek-V3 (MLA latent 512 + 64), Gemma 3 27B (52 sliding over 1024, 10 full),
# gpt-oss-120b (18 sliding over 128, 18 full): their attention as published.
VLLM_LAYOUTS = ("DeepSeek-V3", "gemma-3-27b", "gpt-oss-120b")


def _what_if(name: str):
    """``name``'s published shape, planned by vLLM's rule: kvledger's engine serves Gemma 3
    (and plans it as it runs it), so its layout, the one whose sliding layers vLLM cuts
    into groups of the full ones' count, is relabelled as Gemma 2, which it does not."""
    shape = published_shape(name)
    if shape.architecture.startswith("Gemma3"):
        shape = dataclasses.replace(shape, architecture="Gemma2ForCausalLM")
    return shape


@pytest.mark.parametrize("name", VLLM_LAYOUTS)
@pytest.mark.parametrize(("util", "max_model_len", "batched", "kv_dtype"), [
    (0.9, 32768, 8192, "auto"), (0.5, 131072, 2048, "auto"), (0.95, 4096, 4096, "fp8"),
    (1.0, 100, 256, "auto")])
def test_pool_matches_vllm_for_mla_and_hybrid_layouts(name, util, max_model_len, batched,
                                                      kv_dtype) -> None:
    """At matched utilization: the same num_blocks as vLLM, and the plan fits exactly when
    vLLM's maximum concurrency holds max_num_seqs requests."""
    shape = _what_if(name)
    weights = WeightsInfo(40 * GiB, 1, "BF16", (), {"BF16": 40 * GiB})
    measured = Measured(activation_peak_bytes=3 * GiB, context_bytes=GiB, cuda_graph_bytes=GiB // 2)
    device = DeviceMemory("what-if", "H200", 141 * GiB, 141 * GiB, False)
    for seqs in (1, 16, 64, 256):
        config = EngineConfig(model="/unused", gpu_memory_utilization=util,
                              max_model_len=max_model_len, max_num_seqs=seqs,
                              max_num_batched_tokens=max(batched, seqs), kv_cache_dtype=kv_dtype)
        p = make_plan(config, device=device, measured=measured, shape=shape, weights=weights)
        c = p.classes
        available = int(141 * GiB * util) - c["weights"] - c["activations"] - (
            c["context"] + c["cuda_graphs"])
        specs = [(la.attention, la.num_kv_heads, la.head_size, la.sliding_window)
                 for la in shape.kv_layout().layers]
        blocks, per_request = _vllm_pool(specs, 16, 1 if kv_dtype == "fp8" else 2, available,
                                         max_model_len, max(batched, seqs))
        assert p.kv.blocks_per_seq == per_request
        assert p.kv.num_blocks == max(blocks, p.kv.required_blocks)
        assert p.fits == (blocks / per_request >= seqs)
