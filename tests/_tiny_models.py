"""Tiny random models of the architectures kvledger plans, written as transformers writes
them (``save_pretrained``): the configs and checkpoints the hostile-config fuzz mutates and
the widths' differential test checks against the loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 256}
# name -> (config class, model class, fields besides TINY); ENGINE_MODELS are kvledger's
# engine's own (planned as it runs them), the rest vLLM what-ifs (MLA, Gemma 2, gpt-oss).
# Granite's multipliers are none of them 1, so each is exercised.
GRANITE_MULTIPLIERS = {"embedding_multiplier": 3.0, "attention_multiplier": 0.25,
                       "residual_multiplier": 0.5, "logits_scaling": 4.0}
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                 {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 16}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", GRANITE_MULTIPLIERS),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   {**GRANITE_MULTIPLIERS, "intermediate_size": 16, "num_local_experts": 4,
                    "num_experts_per_tok": 2}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "eos_token_id": 2}),
    "deepseekv3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                   {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_nope_head_dim": 8,
                    "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8}),
    "gptoss": ("GptOssConfig", "GptOssForCausalLM",
               {"intermediate_size": 32, "head_dim": 8, "num_local_experts": 4,
                "num_experts_per_tok": 2}),
}
ENGINE_MODELS = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3moe", "gemma", "gemma3",
                 "granite", "granitemoe", "phi3")


def save_tiny(name: str, folder: Path, **fields: Any) -> Path:
    """Model ``name`` (``MODELS``) with random weights from seed 0, ``fields`` over its
    config's, saved by transformers into ``folder``."""
    import torch
    import transformers

    config_class, model_class, own = MODELS[name]
    config = getattr(transformers, config_class)(**{**TINY, **own, **fields})
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(folder)
    return folder
