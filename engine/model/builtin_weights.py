"""The random weights of the built-in models (``kvledger make-model``), from a fixed seed.

Random weights generate gibberish; what they must not be is fragile or degenerate. The
built-in models are what demos, benchmarks and checks of an install run, so their greedy
output has to be the same tokens on every device and batch shape (no near-tie between
the top two logits that float rounding could flip), has to vary with the prompt (not
one token repeated whatever comes in), and has to depend on every part of the model
(attention, the MLPs, the experts a token is routed to). Hugging Face's initialisation
(a spread of 0.02) gives none of these at this size; the scales below do.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.checkpoint.moe_config import MoEConfig

# Linear layers: wider than HF's 0.02, so each step's top two logits stand apart.
STD = 0.06
BIAS_STD = 0.2
NORM_STD = 0.1  # norm weights: 1 + noise
# A tied lm_head reads the logits off the embedding: at the scale of the other weights,
# or the residual stream (mostly the input embedding) predicts the input token back.
TIED_EMBEDDING_STD = 0.02
# A router as spread as the logits keeps a token's k-th and (k+1)-th experts apart, and
# experts (narrower than a dense MLP) this wide add up to a dense MLP's output: which
# experts a token goes to decides its next token.
ROUTER_STD = 0.2
EXPERT_STD = 0.12


def write_weights(config: dict[str, Any], path: Path, *, seed: int) -> None:
    """Write ``model.safetensors`` for ``config`` (a built-in config.json) to ``path``;
    the same bytes for the same ``seed``."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = STD) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    engine = ModelConfig.from_dict(config)  # the shape and experts as the engine reads them
    hidden, heads, kv_heads = engine.hidden_size, engine.num_attention_heads, engine.num_kv_heads
    head_dim, tied = engine.head_dim, engine.tie_word_embeddings
    embed_scale = TIED_EMBEDDING_STD if tied else 1.0
    tensors = {"model.embed_tokens.weight": rand(engine.vocab_size, hidden, scale=embed_scale)}
    for i in range(engine.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        if engine.qkv_bias:
            for proj, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                tensors[p + f"self_attn.{proj}_proj.bias"] = rand(rows * head_dim, scale=BIAS_STD)
        if engine.o_bias:
            tensors[p + "self_attn.o_proj.bias"] = rand(hidden, scale=BIAS_STD)
        if engine.qk_norm:
            tensors[p + "self_attn.q_norm.weight"] = 1.0 + rand(head_dim, scale=NORM_STD)
            tensors[p + "self_attn.k_norm.weight"] = 1.0 + rand(head_dim, scale=NORM_STD)
        tensors.update(_feed_forward(engine, engine.moe, i, p, rand))
        tensors[p + "input_layernorm.weight"] = 1.0 + rand(hidden, scale=NORM_STD)
        tensors[p + "post_attention_layernorm.weight"] = 1.0 + rand(hidden, scale=NORM_STD)
    tensors["model.norm.weight"] = 1.0 + rand(hidden, scale=NORM_STD)
    if not tied:
        tensors["lm_head.weight"] = rand(engine.vocab_size, hidden)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(path),
              metadata={"format": "pt"})


def _feed_forward(engine: ModelConfig, moe: MoEConfig | None, layer: int, prefix: str,
                  rand: Callable[..., Any]) -> dict[str, Any]:
    """One layer's MLP, or its router and experts named one expert at a time as published
    checkpoints are (transformers 5 fuses them into 3D tensors when it loads them)."""
    hidden = engine.hidden_size
    if moe is None or layer not in moe.sparse_layers:
        inter = engine.intermediate_size
        return {prefix + "mlp.gate_proj.weight": rand(inter, hidden),
                prefix + "mlp.up_proj.weight": rand(inter, hidden),
                prefix + "mlp.down_proj.weight": rand(hidden, inter)}
    if engine.architecture == "MixtralForCausalLM":
        block, (gate, up, down) = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        block, (gate, up, down) = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
    inter = moe.intermediate_size
    tensors = {block + "gate.weight": rand(moe.num_experts, hidden, scale=ROUTER_STD)}
    for e in range(moe.num_experts):
        tensors[block + f"experts.{e}.{gate}.weight"] = rand(inter, hidden, scale=EXPERT_STD)
        tensors[block + f"experts.{e}.{up}.weight"] = rand(inter, hidden, scale=EXPERT_STD)
        tensors[block + f"experts.{e}.{down}.weight"] = rand(hidden, inter, scale=EXPERT_STD)
    return tensors
