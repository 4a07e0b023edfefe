"""Properties of the plan over random shapes, workloads and limits (hypothesis)."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.engine.checkpoint.contents import ModelShape, WeightsInfo
from kvledger.engine.checkpoint.layout import AttentionLayout, LayerKV
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.settings.config import EngineConfig

GiB = 2**30
CAP_FIELDS = {"--gpu-memory-utilization": "gpu_memory_utilization",
              "--memory-limit": "memory_limit_bytes"}


@st.composite
def scenarios(draw):
    heads = draw(st.sampled_from([4, 8, 32, 64]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0]))
    head_dim = draw(st.sampled_from([32, 64, 128]))
    num_layers = draw(st.integers(1, 96))
    # Full attention in kvledger's engine, or a what-if for vLLM: MLA, or sliding layers
    # in any pattern among full ones.
    arch = draw(st.sampled_from(["LlamaForCausalLM", "DeepseekV3ForCausalLM",
                                 "Gemma2ForCausalLM"]))
    layout = None
    if arch == "DeepseekV3ForCausalLM":
        layout = AttentionLayout((LayerKV("mla", 1, draw(st.sampled_from([576, 192]))),)
                                 * num_layers)
    elif arch == "Gemma2ForCausalLM":
        window = draw(st.integers(1, 5000))
        sliding = draw(st.lists(st.booleans(), min_size=num_layers, max_size=num_layers))
        layout = AttentionLayout(tuple(
            LayerKV("sliding", kv_heads, head_dim, window) if slides
            else LayerKV("full", kv_heads, head_dim) for slides in sliding))
    shape = ModelShape(arch, num_layers, heads, kv_heads, head_dim,
                       heads * head_dim, draw(st.integers(1, 30000)), draw(st.integers(100, 200000)),
                       draw(st.sampled_from([2048, 8192, 32768])), "bfloat16", layout=layout)
    weights_bytes = draw(st.integers(1, 200 * GiB)) // 2 * 2
    weights = WeightsInfo(weights_bytes, 10, "BF16", (), {"BF16": weights_bytes})
    total = draw(st.integers(8, 200)) * GiB
    free = draw(st.integers(0, total // GiB)) * GiB  # other processes may hold the rest
    device = DeviceMemory("what-if", "card", total, free, draw(st.booleans()))
    flags = dict(
        model="/unused",
        max_num_batched_tokens=draw(st.one_of(st.none(), st.integers(256, 40000))),
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
    else:  # short of the limit, or held to a cap above free memory
        assert plan.short_by_bytes > 0 or plan.cap_above_free

    for remedy in plan.remedies:
        # A remedy's other changes (a cap lowered to free memory) hold for every check.
        lowered = {CAP_FIELDS[flag]: value for flag, value in remedy.also}

        def replan(lowered=lowered, **changes):
            return make_plan(dataclasses.replace(config, **lowered, **changes), device=device,
                             shape=shape, weights=weights, with_remedies=False)

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
        elif remedy.flag == "--max-num-batched-tokens":
            assert replan(max_num_batched_tokens=remedy.value).fits
            assert not replan(max_num_batched_tokens=remedy.value + 1).fits
        elif remedy.flag == "--gpu-memory-utilization":  # the largest within free memory
            assert replan(gpu_memory_utilization=remedy.value).fits
            assert replan(gpu_memory_utilization=remedy.value + 0.01).cap_above_free
        elif remedy.flag == "--memory-limit":
            assert replan(memory_limit_bytes=remedy.value).fits
            assert replan(memory_limit_bytes=remedy.value + 1).cap_above_free
