"""The shape of every tensor kvledger's engine model holds for a config, named as Hugging
Face's checkpoints name them, told without torch: the state dict of ``CausalLM(config)``
with unquantized layers (a test holds the two equal), known without building it.

The planner sizes activations, the KV cache and the logits from config.json's widths
(``hidden_size``, ``intermediate_size``, heads, ``head_dim``, ``vocab_size``); the loader
checks every tensor against these shapes. ``loadable.check_shapes`` compares the
checkpoint's headers with them before planning, so a config.json that understates a width
is refused where the plan is made, not after a pod was sized from it.
"""

from __future__ import annotations

from kvledger.engine.checkpoint.model_config import ModelConfig

Shape = tuple[int, ...]
BLOCK_SPARSE_MOE = ("MixtralForCausalLM", "GraniteMoeForCausalLM")  # the others': mlp


def float_shapes(config: ModelConfig) -> dict[str, Shape]:
    """Each of the model's tensors and its shape, every linear layer as a float weight
    ``[out, in]`` (an FP8 weight is stored so too; a 4-bit one replaces it by its packed
    tensors, ``int4_format.layer_shapes``)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_kv_heads * head_dim
    shapes: dict[str, Shape] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config.vocab_size, hidden),
    }
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        attention = prefix + "self_attn."
        for name, size in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            shapes[f"{attention}{name}_proj.weight"] = (size, hidden)
            if config.qkv_bias:
                shapes[f"{attention}{name}_proj.bias"] = (size,)
        shapes[attention + "o_proj.weight"] = (hidden, q_size)
        if config.o_bias:
            shapes[attention + "o_proj.bias"] = (hidden,)
        sandwich = config.gemma is not None and config.gemma.sandwich_norms  # Gemma 3's
        if config.qk_norm or sandwich:
            shapes[attention + "q_norm.weight"] = shapes[attention + "k_norm.weight"] = (head_dim,)
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        if sandwich:
            shapes[prefix + "pre_feedforward_layernorm.weight"] = (hidden,)
            shapes[prefix + "post_feedforward_layernorm.weight"] = (hidden,)
        shapes.update(_feed_forward(config, layer, prefix))
    return shapes


def fused_expert_shape(config: ModelConfig, what: str) -> Shape:
    """The shape transformers 5 stores a layer's experts fused in (``what``: ``gate_up_proj``
    ``[experts, 2 * inter, hidden]``, each expert's gate then up; ``down_proj`` ``[experts,
    hidden, inter]``)."""
    assert config.moe is not None
    experts, inter = config.moe.num_experts, config.moe.intermediate_size
    hidden = config.hidden_size
    return (experts, 2 * inter, hidden) if what == "gate_up_proj" else (experts, hidden, inter)


def block(config: ModelConfig, prefix: str) -> str:
    """Where a layer's feed-forward is: Mixtral's and Granite-MoE's checkpoints name it
    block_sparse_moe, everyone else's mlp."""
    return prefix + ("block_sparse_moe." if config.architecture in BLOCK_SPARSE_MOE
                     else "mlp.")


def expert_projections(config: ModelConfig) -> tuple[str, str, str]:
    """An expert's (gate, up, down) names: Mixtral's w1, w3, w2."""
    if config.architecture == "MixtralForCausalLM":
        return ("w1", "w3", "w2")
    return ("gate_proj", "up_proj", "down_proj")


def _feed_forward(config: ModelConfig, layer: int, prefix: str) -> dict[str, Shape]:
    """One layer's MLP, or its router and every expert."""
    at, hidden, moe = block(config, prefix), config.hidden_size, config.moe
    if moe is None or layer not in moe.sparse_layers:
        inter = config.intermediate_size
        return {f"{at}gate_proj.weight": (inter, hidden), f"{at}up_proj.weight": (inter, hidden),
                f"{at}down_proj.weight": (hidden, inter)}
    gate, up, down = expert_projections(config)
    inter = moe.intermediate_size
    shapes: dict[str, Shape] = {at + "gate.weight": (moe.num_experts, hidden)}
    for expert in range(moe.num_experts):
        named = f"{at}experts.{expert}."
        shapes[f"{named}{gate}.weight"] = shapes[f"{named}{up}.weight"] = (inter, hidden)
        shapes[f"{named}{down}.weight"] = (hidden, inter)
    return shapes
