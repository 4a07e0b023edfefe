"""Properties of the plan over random shapes, workloads and limits (hypothesis)."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.engine.budget.checkpoint import ModelShape, WeightsInfo
from kvledger.engine.budget.device import DeviceMemory
from kvledger.engine.budget.plan import make_plan
from kvledger.engine.config import EngineConfig

GiB = 2**30


@st.composite
def scenarios(draw):
    heads = draw(st.sampled_from([4, 8, 32, 64]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0]))
    head_dim = draw(st.sampled_from([32, 64, 128]))
    shape = ModelShape("LlamaForCausalLM", draw(st.integers(1, 96)), heads, kv_heads, head_dim,
                       heads * head_dim, draw(st.integers(1, 30000)), draw(st.integers(100, 200000)),
                       draw(st.sampled_from([2048, 8192, 32768])), "bfloat16")
    weights_bytes = draw(st.integers(1, 200 * GiB)) // 2 * 2
    weights = WeightsInfo(weights_bytes, 10, "BF16", (), {"BF16": weights_bytes})
    total = draw(st.integers(8, 200)) * GiB
    device = DeviceMemory("what-if", "card", total, total, draw(st.booleans()))
    flags = dict(
        model="/unused",
        max_model_len=draw(st.integers(1, shape.max_position_embeddings)),
        max_num_seqs=draw(st.integers(1, 256)),
        block_size=draw(st.sampled_from([8, 16, 32])),
        kv_cache_dtype=draw(st.sampled_from(["auto", "fp8"])),
        enforce_eager=draw(st.booleans()),
    )
    cap = draw(st.sampled_from(["none", "limit", "util", "both"]))
    if cap in ("limit", "both"):
        flags["memory_limit_bytes"] = draw(st.integers(1, 200)) * GiB
    if cap in ("util", "both"):
        flags["gpu_memory_utilization"] = draw(st.floats(0.05, 1.0))
    return EngineConfig(**flags), device, shape, weights


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_plan_invariants(scenario) -> None:
    config, device, shape, weights = scenario
    plan = make_plan(config, device=device, shape=shape, weights=weights)
    assert plan.required_bytes == sum(plan.classes.values())
    assert plan.short_by_bytes == max(0, plan.required_bytes - plan.limit_bytes)
    assert plan.classes["kv_cache"] == plan.kv.num_blocks * plan.kv.bytes_per_block
    if plan.fits:
        assert plan.required_bytes <= plan.limit_bytes and not plan.remedies
        assert plan.kv.num_blocks >= plan.max_num_seqs * plan.kv.blocks_per_seq
    else:
        assert plan.short_by_bytes > 0

    def replan(**changes):
        return make_plan(dataclasses.replace(config, **changes), device=device, shape=shape,
                         weights=weights, with_remedies=False)

    for remedy in plan.remedies:
        if remedy.flag == "--max-model-len":
            assert replan(max_model_len=remedy.value).fits
            assert not replan(max_model_len=remedy.value + 1).fits
        elif remedy.flag == "--max-num-seqs":
            assert replan(max_num_seqs=remedy.value).fits
            assert not replan(max_num_seqs=remedy.value + 1).fits
        elif remedy.flag == "--kv-cache-dtype":
            assert replan(kv_cache_dtype="fp8").fits
        elif remedy.flag == "--enforce-eager":
            assert replan(enforce_eager=True).fits
