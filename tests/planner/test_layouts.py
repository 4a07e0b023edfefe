"""KV layouts against real models' published shapes: each config.json as the model's
repository publishes it (tests/data/published), with a header-only checkpoint of its real
tensor names, shapes and dtypes (no data on disk; ``published_models``). Per model: the
layout and rule the plan applies, the KV bytes per token and per block, the weights as
the header sum; then the refusals, the report and the remedies on a hybrid model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from budget_checkpoints import tensor_bytes, write_header_only
from published_models import parameter_count, published_config, published_tensors

from kvledger.engine.checkpoint.model_config import SUPPORTED_ARCHITECTURES
from kvledger.engine.cli import main
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.planner.plan import Plan, make_plan
from kvledger.engine.planner.pool import ENGINE_RULE, VLLM_RULE
from kvledger.engine.planner.report import render_report
from kvledger.engine.settings.config import EngineConfig

GiB = 2**30
H200 = DeviceMemory("what-if", "H200", 141 * GiB, 141 * GiB, False)
B200x8 = DeviceMemory("what-if", "8 x B200", 1432 * GiB, 1432 * GiB, False)  # a what-if pool

# name -> (shards, published parameters in billions, rounded); the config.json and the
# tensors are published_models' (tests/data/published/NAME.json).
MODELS = {
    "Llama-3-8B": (4, 8.03),
    "Mistral-7B-v0.1": (2, 7.24),
    "Qwen3-8B": (5, 8.19),
    "Qwen3-30B-A3B": (16, 30.53),
    "Mixtral-8x7B": (19, 46.70),
    "gemma-2b": (2, 2.51),
    "DeepSeek-V2-Lite": (4, 15.71),
    "DeepSeek-V3": (16, 684.53),
    "Kimi-K2": (16, 1026.47),
    "gemma-2-9b": (4, 9.24),
    "gemma-3-27b": (12, 27.43),
    "gemma-3-1b": (1, 1.00),
    "gpt-oss-20b": (3, 20.91),
    "gpt-oss-120b": (15, 116.83),
}


# What kvledger's engine does not load, so the plan does not count: Gemma 3's vision tower
# and projector (its language model is served as text).
NOT_LOADED = ("vision_tower.", "multi_modal_projector.")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, int, int]]:
    """Each model written once: its folder, and the bytes and count of the tensors loaded."""
    root = tmp_path_factory.mktemp("published")
    out = {}
    for name, (shards, _) in MODELS.items():
        config = published_config(name)
        tensors = published_tensors(config)
        total = write_header_only(root / name, config, tensors, shards=shards)
        left = {n: t for n, t in tensors.items() if n.startswith(NOT_LOADED)}
        out[name] = (root / name, total - sum(tensor_bytes(*t) for t in left.values()),
                     len(tensors) - len(left))
    return out


def _plan(model_dir: Path, device: DeviceMemory = H200, **flags) -> Plan:
    return make_plan(EngineConfig(model=str(model_dir), **flags), device=device)


@pytest.mark.parametrize("name", list(MODELS))
def test_weights_are_the_header_sum_of_the_published_tensors(checkpoints, name) -> None:
    """Mixture-of-experts, MXFP4 (U8 blocks and scales) and fp8 with F32 scales counted as
    stored; the parameter count is the one each model card publishes."""
    _, billions = MODELS[name]
    model_dir, total, count = checkpoints[name]
    p = _plan(model_dir, device=B200x8, max_model_len=4096, max_num_seqs=1)
    assert p.classes["weights"] == p.weights.total_bytes == total
    assert p.weights.num_tensors == count
    assert round(parameter_count(published_tensors(published_config(name))) / 1e9, 2) == billions


def _expect(name: str):
    """(layout, KV bytes per token in every layer that keeps it, layers by kind) in bf16,
    from the published shapes by hand."""
    kv = 2  # bytes per element (bf16)
    return {
        "Llama-3-8B": ("full", 2 * 8 * 128 * kv * 32, {"full": 32}),  # 131,072
        "Mistral-7B-v0.1": ("full", 2 * 8 * 128 * kv * 32, {"full": 32}),
        "Qwen3-8B": ("full", 2 * 8 * 128 * kv * 36, {"full": 36}),  # 147,456
        "Qwen3-30B-A3B": ("full", 2 * 4 * 128 * kv * 48, {"full": 48}),  # 98,304
        "Mixtral-8x7B": ("full", 2 * 8 * 128 * kv * 32, {"full": 32}),
        "gemma-2b": ("full", 2 * 1 * 256 * kv * 18, {"full": 18}),  # 18,432
        "DeepSeek-V2-Lite": ("mla", (512 + 64) * kv * 27, {"mla": 27}),  # 31,104
        "DeepSeek-V3": ("mla", (512 + 64) * kv * 61, {"mla": 61}),  # 70,272
        "Kimi-K2": ("mla", (512 + 64) * kv * 61, {"mla": 61}),
        "gemma-2-9b": ("sliding+full (hybrid)", 2 * 8 * 256 * kv * 42,
                       {"sliding": 21, "full": 21}),
        # Served: every layer keeps the whole context, as kvledger's engine runs them.
        "gemma-3-27b": ("full", 2 * 16 * 128 * kv * 62, {"full": 62}),
        "gemma-3-1b": ("full", 2 * 1 * 256 * kv * 26, {"full": 26}),
        "gpt-oss-20b": ("sliding+full (hybrid)", 2 * 8 * 64 * kv * 24,
                        {"sliding": 12, "full": 12}),
        "gpt-oss-120b": ("sliding+full (hybrid)", 2 * 8 * 64 * kv * 36,
                         {"sliding": 18, "full": 18}),
    }[name]


@pytest.mark.parametrize("name", list(MODELS))
def test_each_model_is_planned_with_its_layout_and_rule(checkpoints, name) -> None:
    model_dir, _, _ = checkpoints[name]
    layout, per_token, layers = _expect(name)
    p = _plan(model_dir, device=B200x8, max_model_len=4096, max_num_seqs=1)
    arch = p.shape.architecture
    assert p.kv.layout == layout and p.kv.dtype == "bfloat16" and p.model_dtype == "bfloat16"
    assert p.kv.bytes_per_token == per_token
    assert {g.attention: g.num_layers for g in p.kv.groups} == layers
    served = arch in SUPPORTED_ARCHITECTURES
    assert p.kv.rule == (ENGINE_RULE if served else VLLM_RULE)
    if not served:
        assert p.kv.note.startswith("vLLM's hybrid KV cache manager rule; kvledger's engine "
                                    f"does not serve {arch}")
    doc = json.loads(json.dumps(p.to_json()))
    assert doc["kv"]["layout"] == layout and doc["kv"]["rule"] == p.kv.rule
    assert sum(g["num_layers"] for g in doc["kv"]["groups"]) == p.shape.num_layers


def test_deepseek_v2_lite_caches_the_latent_once_per_token_and_layer(checkpoints) -> None:
    """(kv_lora_rank 512 + qk_rope_head_dim 64) elements, K only: 31,104 bytes per token,
    not the 221,184 of 16 K and V heads of 128 (vLLM's MLAAttentionSpec page)."""
    p = _plan(checkpoints["DeepSeek-V2-Lite"][0], max_model_len=32768, max_num_seqs=8)
    assert p.kv.bytes_per_token == 31_104 != 2 * 16 * 128 * 2 * 27
    (group,) = p.kv.groups
    assert (group.attention, group.num_kv_heads, group.head_size) == ("mla", 1, 576)
    assert p.kv.bytes_per_block == 16 * 31_104 and p.kv.layers_per_block == 27
    assert p.kv.blocks_per_seq == 32768 // 16 and p.classes["kv_cache"] == 8 * 32768 * 31_104
    fp8 = _plan(checkpoints["DeepSeek-V2-Lite"][0], max_model_len=32768, kv_cache_dtype="fp8")
    assert fp8.kv.bytes_per_token == 15_552


@pytest.mark.parametrize(("name", "length", "step", "full_blocks", "sliding_blocks", "tables",
                          "layers_per_block"), [
    # Gemma 2: 21 + 21 layers, group size 21: one table each; window 4096 + a step of 2048.
    ("gemma-2-9b", 8192, 2048, 512, -(-(4095 + 2048) // 16) + 1, 2, 21),
    # (Gemma 3 is served, so planned as the engine runs it; test_vllm_pool.py checks its
    # layout, 52 sliding layers cut into 6 tables of <= 10, under vLLM's rule.)
    # gpt-oss: 12 + 12 (18 + 18) layers; window 128.
    ("gpt-oss-20b", 131072, 8192, 8192, -(-(127 + 8192) // 16) + 1, 2, 12),
    ("gpt-oss-120b", 131072, 8192, 8192, -(-(127 + 8192) // 16) + 1, 2, 18),
    # A context within the window: the sliding layers keep it all, and a block more.
    ("gpt-oss-20b", 100, 100, 7, 8, 2, 12),
])
def test_hybrid_blocks_follow_vllms_hybrid_kv_cache_manager(checkpoints, name, length, step,
                                                           full_blocks, sliding_blocks, tables,
                                                           layers_per_block) -> None:
    p = _plan(checkpoints[name][0], max_model_len=length, max_num_batched_tokens=step,
              max_num_seqs=4)
    by_kind = {g.attention: g for g in p.kv.groups}
    assert by_kind["full"].blocks_per_seq == full_blocks
    assert by_kind["sliding"].blocks_per_seq == sliding_blocks
    assert sum(g.num_groups for g in p.kv.groups) == tables
    assert p.kv.layers_per_block == layers_per_block
    per_layer_token = p.kv.bytes_per_token // p.shape.num_layers
    assert p.kv.bytes_per_block == 16 * per_layer_token * layers_per_block
    assert p.kv.blocks_per_seq == full_blocks + sliding_blocks
    assert p.kv.required_blocks == 4 * p.kv.blocks_per_seq
    assert p.classes["kv_cache"] == p.kv.num_blocks * p.kv.bytes_per_block
    assert p.kv.bytes_per_seq == p.kv.blocks_per_seq * p.kv.bytes_per_block


def test_hybrid_saves_what_the_window_drops(checkpoints) -> None:
    """gpt-oss-20b at 131072 tokens: the sliding half holds a window and a step, the full
    half the whole context: a little over half of all-full attention."""
    p = _plan(checkpoints["gpt-oss-20b"][0], max_model_len=131072, max_num_batched_tokens=8192,
              max_num_seqs=1)
    all_full = 131072 * p.kv.bytes_per_token
    assert all_full // 2 < p.kv.bytes_per_seq < all_full * 0.54


def test_mistral_window_saves_nothing_in_kvledgers_engine(checkpoints) -> None:
    p = _plan(checkpoints["Mistral-7B-v0.1"][0], max_model_len=32768, max_num_seqs=2)
    assert (p.kv.rule, p.kv.layout) == (ENGINE_RULE, "full")
    assert p.kv.blocks_per_seq == 2048 and p.kv.bytes_per_token == 131_072
    assert p.kv.note == ("sliding_window 4096 on every layer saves no memory here: kvledger's "
                         "engine allocates every layer the whole context")
    text = render_report(p)
    assert (f"  KV layout: full: 32 full-attention layers x 8 KV heads x 128, 131072 bytes per "
            f"token; {p.kv.note}\n") in text
    llama = render_report(_plan(checkpoints["Llama-3-8B"][0], max_model_len=8192))
    assert "KV layout" not in llama  # plain full attention in the engine: nothing to add


def test_gpt_oss_report_and_json(checkpoints) -> None:
    p = _plan(checkpoints["gpt-oss-20b"][0], max_model_len=131072, max_num_batched_tokens=8192,
              max_num_seqs=4)
    assert p.fits and p.shape.torch_dtype == "" and p.model_dtype == "bfloat16"
    assert p.weights.dtype == "U8" and p.shape.quantization == "mxfp4"
    lines = render_report(p).splitlines()
    assert lines[1].endswith("(mxfp4 (u8), 24 layers)")
    kv_row = next(line for line in lines if line.startswith("  KV cache"))
    assert kv_row.endswith(", bf16, sliding+full (hybrid))")
    pool = next(line for line in lines if line.startswith("  KV pool:"))
    assert pool.endswith("(2 block tables of 12 layers share it; one max_model_len sequence "
                         "takes 8713 blocks)")
    layout = next(line for line in lines if line.startswith("  KV layout:"))
    assert layout == ("  KV layout: sliding+full (hybrid): 12 sliding-window layers x 8 KV heads"
                      " x 64, window 128 + a step of 8192 tokens (521 blocks of 16 per sequence) + 12 "
                      "full-attention "
                      "layers x 8 KV heads x 64, 49152 bytes per token; vLLM's hybrid KV cache "
                      "manager rule; kvledger's engine does not serve GptOssForCausalLM; "
                      "attention sinks: one learned logit per head and layer, stored with the "
                      "weights (counted there), no KV bytes")
    doc = p.to_json()["kv"]
    assert doc["groups"][0] | {} == {
        "attention": "sliding", "num_groups": 1, "num_layers": 12, "num_kv_heads": 8,
        "head_size": 64, "sliding_window": 128, "bytes_per_token_per_layer": 2048,
        "blocks_per_seq": 521}


def test_gemma3_reads_defaults_the_published_config_leaves_out(checkpoints) -> None:
    p = _plan(checkpoints["gemma-3-27b"][0], max_model_len=8192)
    assert p.shape.max_position_embeddings == 131_072 and p.shape.vocab_size == 262_208
    assert p.shape.architecture == "Gemma3ForConditionalGeneration"
    layers = p.shape.kv_layout().layers
    assert [i for i, la in enumerate(layers) if la.attention == "full"] == list(range(5, 62, 6))
    assert {la.sliding_window for la in layers if la.attention == "sliding"} == {1024}
    assert p.kv.rule == ENGINE_RULE and p.kv.blocks_per_seq == 8192 // 16
    assert ("62 full-attention layers x 16 KV heads x 128, 507904 bytes per token; "
            "sliding_window 1024 on 52 of 62 layers saves no memory here: kvledger's engine "
            "allocates every layer the whole context") in render_report(p)


# --- refused, never planned as a Llama ---------------------------------------------------------

@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "Llama4ForConditionalGeneration",
                                  "DeepseekV32ForCausalLM", "Qwen3NextForCausalLM",
                                  "Gemma3nForConditionalGeneration", "MambaForCausalLM"])
def test_an_architecture_the_planner_does_not_model_is_refused_by_name(tmp_path, capsys,
                                                                      arch) -> None:
    write_header_only(tmp_path, {**published_config("Llama-3-8B"), "architectures": [arch]},
                      {"w": ("BF16", [4])})
    assert main(["plan", "--model", str(tmp_path), "--device-memory", "80GiB", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"error: unsupported architecture {arch} for planning; "
                                   "kvledger plans: DeepseekV2ForCausalLM, ")


@pytest.mark.parametrize(("change", "message"), [
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 12},
     "chunked_attention: kvledger plans only full_attention and sliding_attention"),
    ({"layer_types": ["sliding_attention"] * 3}, r"one type per layer \(24\)"),
    ({"sliding_window": 0}, "'sliding_window' must be a positive integer"),
])
def test_a_layout_the_planner_cannot_model_is_bad_input(tmp_path, change, message) -> None:
    write_header_only(tmp_path, {**published_config("gpt-oss-20b"), **change}, {"w": ("BF16", [4])})
    with pytest.raises(BadInput, match=message):
        _plan(tmp_path)


def test_mla_without_its_latent_rank_is_bad_input(tmp_path) -> None:
    config = published_config("DeepSeek-V2-Lite")
    del config["kv_lora_rank"]
    write_header_only(tmp_path, config, {"w": ("BF16", [4])})
    with pytest.raises(BadInput, match=r"config\.json has no 'kv_lora_rank'"):
        _plan(tmp_path)


# --- remedies stay exact when layers differ ------------------------------------------------------

@pytest.mark.parametrize("name", ["gemma-2-9b", "gpt-oss-20b", "DeepSeek-V2-Lite"])
def test_remedies_on_other_layouts_fit_and_one_more_does_not(checkpoints, name) -> None:
    model_dir = checkpoints[name][0]
    # A card as large as the roomiest cap: a cap above free memory never fits.
    base = EngineConfig(model=str(model_dir), device_memory_bytes=1000 * GiB,
                        max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=4096)
    roomy = make_plan(dataclasses.replace(base, memory_limit_bytes=1000 * GiB), with_remedies=False)
    # What the declared run needs: every class but the pool, and the workload's blocks.
    needed = (roomy.required_bytes - roomy.classes["kv_cache"]
              + roomy.kv.required_blocks * roomy.kv.bytes_per_block)
    for fraction in (0.5, 0.8, 0.95):
        limit = roomy.classes["weights"] + int((needed - roomy.classes["weights"]) * fraction)
        p = make_plan(dataclasses.replace(base, memory_limit_bytes=limit))
        assert not p.fits
        offered = {r.flag: r.value for r in p.remedies}
        assert "--max-model-len" in offered and "--max-num-seqs" in offered
        smallest_step = dataclasses.replace(p.config, max_num_batched_tokens=64)
        if (any(g.attention == "sliding" for g in p.kv.groups)
                and make_plan(smallest_step, with_remedies=False).fits):
            assert "--max-num-batched-tokens" in offered  # the step sizes the sliding layers
        for flag, value in offered.items():
            if flag not in ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens"):
                continue
            field = flag[2:].replace("-", "_")
            fits = make_plan(dataclasses.replace(p.config, **{field: value}), with_remedies=False)
            more = make_plan(dataclasses.replace(p.config, **{field: value + 1}),
                             with_remedies=False)
            assert fits.fits and not more.fits, (flag, value)
            assert fits.kv.num_blocks >= fits.kv.required_blocks
