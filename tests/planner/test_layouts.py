"""KV layouts against real models' published shapes: each config.json is written as the
model's repository publishes it, with a header-only checkpoint of its real tensor names,
shapes and dtypes (no data on disk). Per model: the layout and rule the plan applies, the
KV bytes per token and per block, the weights as the header sum; then the refusals, the
report and the remedies on a hybrid model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from budget_checkpoints import write_header_only

from kvledger.engine.cli import main
from kvledger.engine.config import EngineConfig
from kvledger.engine.errors import BadInput
from kvledger.engine.model.config import SUPPORTED_ARCHITECTURES
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.planner.plan import Plan, make_plan
from kvledger.engine.planner.pool import ENGINE_RULE, VLLM_RULE
from kvledger.engine.planner.report import render_report

GiB = 2**30
H200 = DeviceMemory("what-if", "H200", 141 * GiB, 141 * GiB, False)
B200x8 = DeviceMemory("what-if", "8 x B200", 1432 * GiB, 1432 * GiB, False)  # a what-if pool

# --- configs as published (huggingface.co/ORG/NAME/blob/main/config.json) --------------------

LLAMA_3_8B = {  # meta-llama/Meta-Llama-3-8B
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256}
MISTRAL_7B = {  # mistralai/Mistral-7B-v0.1
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0",
    "use_cache": True, "vocab_size": 32000}
QWEN3_8B = {  # Qwen/Qwen3-8B
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B: head_dim 128 with hidden_size 2048 / 32 heads = 64
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000}
GEMMA_2B = {  # google/gemma-2b: multi-query attention (one KV head)
    "architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 2, "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 16384,
    "max_position_embeddings": 8192, "model_type": "gemma", "num_attention_heads": 8,
    "num_hidden_layers": 18, "num_key_value_heads": 1, "pad_token_id": 0, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "transformers_version": "4.38.0.dev0", "use_cache": True, "vocab_size": 256000}
_YARN_V2 = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
            "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"}
DEEPSEEK_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite (auto_map left out)
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 100000,
    "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 10944, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": _YARN_V2, "rope_theta": 10000, "routed_scaling_factor": 1.0,
    "scoring_func": "softmax", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "greedy", "torch_dtype": "bfloat16", "transformers_version": "4.33.1",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 102400}
_FP8_BLOCKS = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
               "weight_block_size": [128, 128]}
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 (auto_map left out)
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1,
    "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": _FP8_BLOCKS, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 129280}
KIMI_K2 = {  # moonshotai/Kimi-K2-Instruct: DeepSeek-V3's architecture, 384 experts, 64 heads
    **DEEPSEEK_V3, "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1,
    "max_position_embeddings": 131072, "model_type": "kimi_k2", "n_group": 1,
    "n_routed_experts": 384, "num_attention_heads": 64, "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0, "rope_theta": 50000.0, "routed_scaling_factor": 2.827,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "topk_group": 1, "transformers_version": "4.48.3", "vocab_size": 163840}
KIMI_K2.pop("ep_size")
GEMMA_2_9B = {  # google/gemma-2-9b-it: even layers slide over 4096 tokens
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 16,
    "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "sliding_window": 4096, "sliding_window_size": 4096, "torch_dtype": "bfloat16",
    "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 256000}
GEMMA_3_27B = {  # google/gemma-3-27b-it: text_config gives only what differs from defaults
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                    "model_type": "gemma3_text", "num_attention_heads": 32,
                    "num_hidden_layers": 62, "num_key_value_heads": 16,
                    "query_pre_attn_scalar": 168,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
GEMMA_3_1B = {  # google/gemma-3-1b-it: 5 local : 1 global, multi-query attention
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144}
GPT_OSS_20B = {  # openai/gpt-oss-20b: no torch_dtype; MXFP4 experts
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                                                       "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"],
                            "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0",
    "use_cache": True, "vocab_size": 201088}
GPT_OSS_120B = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18}


# --- the tensors they publish: names, dtypes, shapes -------------------------------------------

def _decoder(c: dict, *, prefix: str = "model.", qk_norm: bool = False,
             sandwich_norms: bool = False, moe: str = "",
             tied: bool = False) -> dict[str, tuple[str, list[int]]]:
    """A Llama-family decoder: attention, a dense or mixture-of-experts MLP, the norms;
    no ``lm_head`` when it is the embedding (Gemma)."""
    h, v, n = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    d = c.get("head_dim") or h // n
    kv = c["num_key_value_heads"] * d
    t = {f"{prefix}embed_tokens.weight": ("BF16", [v, h]), f"{prefix}norm.weight": ("BF16", [h])}
    for k in range(c["num_hidden_layers"]):
        p = f"{prefix}layers.{k}."
        t |= {p + "self_attn.q_proj.weight": ("BF16", [n * d, h]),
              p + "self_attn.k_proj.weight": ("BF16", [kv, h]),
              p + "self_attn.v_proj.weight": ("BF16", [kv, h]),
              p + "self_attn.o_proj.weight": ("BF16", [h, n * d]),
              p + "input_layernorm.weight": ("BF16", [h]),
              p + "post_attention_layernorm.weight": ("BF16", [h])}
        if qk_norm:
            t |= {p + "self_attn.q_norm.weight": ("BF16", [d]),
                  p + "self_attn.k_norm.weight": ("BF16", [d])}
        if sandwich_norms:
            t |= {p + "pre_feedforward_layernorm.weight": ("BF16", [h]),
                  p + "post_feedforward_layernorm.weight": ("BF16", [h])}
        if moe == "mixtral":
            i, experts = c["intermediate_size"], c["num_local_experts"]
            t[p + "block_sparse_moe.gate.weight"] = ("BF16", [experts, h])
            for e in range(experts):
                q = f"{p}block_sparse_moe.experts.{e}."
                t |= {q + "w1.weight": ("BF16", [i, h]), q + "w2.weight": ("BF16", [h, i]),
                      q + "w3.weight": ("BF16", [i, h])}
        elif moe == "qwen3":
            i, experts = c["moe_intermediate_size"], c["num_experts"]
            t[p + "mlp.gate.weight"] = ("BF16", [experts, h])
            for e in range(experts):
                t |= _mlp(f"{p}mlp.experts.{e}.", h, i)
        else:
            t |= _mlp(p + "mlp.", h, c["intermediate_size"])
    if not tied:
        t["lm_head.weight"] = ("BF16", [v, h])
    return t


def _mlp(p: str, h: int, i: int, linear=None) -> dict[str, tuple[str, list[int]]]:
    linear = linear or (lambda name, out, inp: {name + ".weight": ("BF16", [out, inp])})
    return (linear(p + "gate_proj", i, h) | linear(p + "up_proj", i, h)
            | linear(p + "down_proj", h, i))


def _deepseek(c: dict) -> dict[str, tuple[str, list[int]]]:
    """DeepSeek-V2/V3 (and Kimi-K2): MLA, dense first layers, routed + shared experts;
    V3's linear weights are fp8 blocks of 128 x 128 with F32 inverse scales; its
    multi-token-prediction layer is stored too (and so counted)."""
    h, v, heads = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    nope, rope, vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    rank, q_rank, experts = c["kv_lora_rank"], c["q_lora_rank"], c["n_routed_experts"]
    fp8 = (c.get("quantization_config") or {}).get("quant_method") == "fp8"

    def linear(name: str, out: int, inp: int) -> dict[str, tuple[str, list[int]]]:
        if not fp8:
            return {name + ".weight": ("BF16", [out, inp])}
        return {name + ".weight": ("F8_E4M3", [out, inp]),
                name + ".weight_scale_inv": ("F32", [-(-out // 128), -(-inp // 128)])}

    t = {"model.embed_tokens.weight": ("BF16", [v, h]), "model.norm.weight": ("BF16", [h]),
         "lm_head.weight": ("BF16", [v, h])}
    for k in range(c["num_hidden_layers"] + c.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{k}."
        if q_rank:
            t |= linear(p + "self_attn.q_a_proj", q_rank, h)
            t[p + "self_attn.q_a_layernorm.weight"] = ("BF16", [q_rank])
            t |= linear(p + "self_attn.q_b_proj", heads * (nope + rope), q_rank)
        else:
            t |= linear(p + "self_attn.q_proj", heads * (nope + rope), h)
        t |= linear(p + "self_attn.kv_a_proj_with_mqa", rank + rope, h)
        t[p + "self_attn.kv_a_layernorm.weight"] = ("BF16", [rank])
        t |= linear(p + "self_attn.kv_b_proj", heads * (nope + vd), rank)
        t |= linear(p + "self_attn.o_proj", h, heads * vd)
        t |= {p + "input_layernorm.weight": ("BF16", [h]),
              p + "post_attention_layernorm.weight": ("BF16", [h])}
        if k < c["first_k_dense_replace"]:
            t |= _mlp(p + "mlp.", h, c["intermediate_size"], linear)
            continue
        i = c["moe_intermediate_size"]
        t[p + "mlp.gate.weight"] = ("BF16", [experts, h])
        if c.get("topk_method") == "noaux_tc":
            t[p + "mlp.gate.e_score_correction_bias"] = ("F32", [experts])
        for e in range(experts):
            t |= _mlp(f"{p}mlp.experts.{e}.", h, i, linear)
        t |= _mlp(p + "mlp.shared_experts.", h, i * c["n_shared_experts"], linear)
        if k >= c["num_hidden_layers"]:  # the multi-token-prediction module
            t |= {p + "embed_tokens.weight": ("BF16", [v, h]), p + "enorm.weight": ("BF16", [h]),
                  p + "hnorm.weight": ("BF16", [h]), p + "eh_proj.weight": ("BF16", [h, 2 * h]),
                  p + "shared_head.norm.weight": ("BF16", [h]),
                  p + "shared_head.head.weight": ("BF16", [v, h])}
    return t


def _gpt_oss(c: dict) -> dict[str, tuple[str, list[int]]]:
    """gpt-oss: biased attention with a learned sink per head, MXFP4 experts stored as U8
    blocks of 32 values (16 bytes) and one U8 scale per block, BF16 expert biases."""
    h, v, n, d = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["head_dim"]
    kv, i, experts = c["num_key_value_heads"] * d, c["intermediate_size"], c["num_local_experts"]
    t = {"model.embed_tokens.weight": ("BF16", [v, h]), "model.norm.weight": ("BF16", [h]),
         "lm_head.weight": ("BF16", [v, h])}
    for k in range(c["num_hidden_layers"]):
        p = f"model.layers.{k}."
        for name, out, inp in (("q_proj", n * d, h), ("k_proj", kv, h), ("v_proj", kv, h),
                               ("o_proj", h, n * d)):
            t |= {f"{p}self_attn.{name}.weight": ("BF16", [out, inp]),
                  f"{p}self_attn.{name}.bias": ("BF16", [out])}
        e = p + "mlp.experts."
        t |= {p + "self_attn.sinks": ("BF16", [n]),
              p + "mlp.router.weight": ("BF16", [experts, h]),
              p + "mlp.router.bias": ("BF16", [experts]),
              e + "gate_up_proj_blocks": ("U8", [experts, 2 * i, h // 32, 16]),
              e + "gate_up_proj_scales": ("U8", [experts, 2 * i, h // 32]),
              e + "gate_up_proj_bias": ("BF16", [experts, 2 * i]),
              e + "down_proj_blocks": ("U8", [experts, h, i // 32, 16]),
              e + "down_proj_scales": ("U8", [experts, h, i // 32]),
              e + "down_proj_bias": ("BF16", [experts, h]),
              p + "input_layernorm.weight": ("BF16", [h]),
              p + "post_attention_layernorm.weight": ("BF16", [h])}
    return t


def _gemma3_multimodal(c: dict) -> dict[str, tuple[str, list[int]]]:
    """Gemma 3's language model (262,208-token vocabulary by default) and its SigLIP tower."""
    text = {"vocab_size": 262_208, **c["text_config"]}
    t = _decoder(text, prefix="language_model.model.", qk_norm=True, sandwich_norms=True,
                 tied=True)
    vc = c["vision_config"]
    w, i = vc["hidden_size"], vc["intermediate_size"]
    patches = (vc["image_size"] // vc["patch_size"]) ** 2
    vt = "vision_tower.vision_model."
    t |= {vt + "embeddings.patch_embedding.weight": ("BF16", [w, 3, vc["patch_size"],
                                                              vc["patch_size"]]),
          vt + "embeddings.patch_embedding.bias": ("BF16", [w]),
          vt + "embeddings.position_embedding.weight": ("BF16", [patches, w]),
          vt + "post_layernorm.weight": ("BF16", [w]), vt + "post_layernorm.bias": ("BF16", [w]),
          "multi_modal_projector.mm_input_projection_weight": ("BF16", [w, text["hidden_size"]]),
          "multi_modal_projector.mm_soft_emb_norm.weight": ("BF16", [w])}
    for k in range(vc["num_hidden_layers"]):
        p = f"{vt}encoder.layers.{k}."
        for name, out, inp in (("self_attn.q_proj", w, w), ("self_attn.k_proj", w, w),
                               ("self_attn.v_proj", w, w), ("self_attn.out_proj", w, w),
                               ("mlp.fc1", i, w), ("mlp.fc2", w, i)):
            t |= {f"{p}{name}.weight": ("BF16", [out, inp]), f"{p}{name}.bias": ("BF16", [out])}
        for norm in ("layer_norm1", "layer_norm2"):
            t |= {f"{p}{norm}.weight": ("BF16", [w]), f"{p}{norm}.bias": ("BF16", [w])}
    return t


def _count(tensors: dict[str, tuple[str, list[int]]]) -> int:
    """Parameters as model cards count them: elements, an MXFP4 byte holding two, its
    scales not counted."""
    total = 0
    for name, (_, shape) in tensors.items():
        if name.endswith("_scales"):
            continue
        n = 1
        for d in shape:
            n *= d
        total += 2 * n if name.endswith("_blocks") else n
    return total


# name -> (config, tensors, shards, published parameters in billions (rounded), KV bytes per
# token and layer kind (by hand), the layout, the architecture's rule when not the engine's)
MODELS = {
    "Llama-3-8B": (LLAMA_3_8B, lambda c: _decoder(c), 4, 8.03),
    "Mistral-7B-v0.1": (MISTRAL_7B, lambda c: _decoder(c), 2, 7.24),
    "Qwen3-8B": (QWEN3_8B, lambda c: _decoder(c, qk_norm=True), 5, 8.19),
    "Qwen3-30B-A3B": (QWEN3_30B_A3B, lambda c: _decoder(c, qk_norm=True, moe="qwen3"), 16, 30.53),
    "Mixtral-8x7B": (MIXTRAL_8X7B, lambda c: _decoder(c, moe="mixtral"), 19, 46.70),
    "gemma-2b": (GEMMA_2B, lambda c: _decoder(c, tied=True), 2, 2.51),
    "DeepSeek-V2-Lite": (DEEPSEEK_V2_LITE, _deepseek, 4, 15.71),
    "DeepSeek-V3": (DEEPSEEK_V3, _deepseek, 16, 684.53),
    "Kimi-K2": (KIMI_K2, _deepseek, 16, 1026.47),
    "gemma-2-9b": (GEMMA_2_9B, lambda c: _decoder(c, sandwich_norms=True, tied=True), 4, 9.24),
    "gemma-3-27b": (GEMMA_3_27B, _gemma3_multimodal, 12, 27.43),
    "gemma-3-1b": (GEMMA_3_1B,
                   lambda c: _decoder(c, qk_norm=True, sandwich_norms=True, tied=True), 1, 1.00),
    "gpt-oss-20b": (GPT_OSS_20B, _gpt_oss, 3, 20.91),
    "gpt-oss-120b": (GPT_OSS_120B, _gpt_oss, 15, 116.83),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, int, int]]:
    """Each model written once: its folder, tensor bytes and tensor count."""
    root = tmp_path_factory.mktemp("published")
    out = {}
    for name, (config, tensors_of, shards, _) in MODELS.items():
        tensors = tensors_of(config)
        total = write_header_only(root / name, config, tensors, shards=shards)
        out[name] = (root / name, total, len(tensors))
    return out


def _plan(model_dir: Path, device: DeviceMemory = H200, **flags) -> Plan:
    return make_plan(EngineConfig(model=str(model_dir), **flags), device=device)


@pytest.mark.parametrize("name", list(MODELS))
def test_weights_are_the_header_sum_of_the_published_tensors(checkpoints, name) -> None:
    """Mixture-of-experts, MXFP4 (U8 blocks and scales) and fp8 with F32 scales counted as
    stored; the parameter count is the one each model card publishes."""
    config, tensors_of, _, billions = MODELS[name]
    model_dir, total, count = checkpoints[name]
    p = _plan(model_dir, device=B200x8, max_model_len=4096, max_num_seqs=1)
    assert p.classes["weights"] == p.weights.total_bytes == total
    assert p.weights.num_tensors == count
    assert round(_count(tensors_of(config)) / 1e9, 2) == billions


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
        "gemma-3-27b": ("sliding+full (hybrid)", 2 * 16 * 128 * kv * 62,
                        {"sliding": 52, "full": 10}),
        "gemma-3-1b": ("sliding+full (hybrid)", 2 * 1 * 256 * kv * 26,
                       {"sliding": 22, "full": 4}),
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
    # Gemma 3 27B: 10 full, 52 sliding cut into 6 tables of <= 10 layers; window 1024.
    ("gemma-3-27b", 32768, 8192, 2048, 6 * (-(-(1023 + 8192) // 16) + 1), 7, 10),
    # Gemma 3 1B: 4 full, 22 sliding in 6 tables of <= 4; window 512.
    ("gemma-3-1b", 32768, 2048, 2048, 6 * (-(-(511 + 2048) // 16) + 1), 7, 4),
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
    assert ("52 sliding-window layers x 16 KV heads x 128, window 1024 + a step of 8192 tokens "
            "(513 blocks of 16 per sequence in each of 6 block tables) + 10 full-attention "
            "layers") in render_report(p)


# --- refused, never planned as a Llama ---------------------------------------------------------

@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "Llama4ForConditionalGeneration",
                                  "DeepseekV32ForCausalLM", "Qwen3NextForCausalLM",
                                  "Gemma3nForConditionalGeneration", "MambaForCausalLM"])
def test_an_architecture_the_planner_does_not_model_is_refused_by_name(tmp_path, capsys,
                                                                      arch) -> None:
    write_header_only(tmp_path, {**LLAMA_3_8B, "architectures": [arch]},
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
    write_header_only(tmp_path, {**GPT_OSS_20B, **change}, {"w": ("BF16", [4])})
    with pytest.raises(BadInput, match=message):
        _plan(tmp_path)


def test_mla_without_its_latent_rank_is_bad_input(tmp_path) -> None:
    config = dict(DEEPSEEK_V2_LITE)
    del config["kv_lora_rank"]
    write_header_only(tmp_path, config, {"w": ("BF16", [4])})
    with pytest.raises(BadInput, match="'kv_lora_rank' must be a positive integer, got None"):
        _plan(tmp_path)


# --- remedies stay exact when layers differ ------------------------------------------------------

@pytest.mark.parametrize("name", ["gemma-2-9b", "gpt-oss-20b", "DeepSeek-V2-Lite"])
def test_remedies_on_other_layouts_fit_and_one_more_does_not(checkpoints, name) -> None:
    model_dir = checkpoints[name][0]
    base = EngineConfig(model=str(model_dir), device_memory_bytes=80 * GiB,
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
