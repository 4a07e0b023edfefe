"""The device memory LoRA adapters take: the slots the engine preallocates.

With ``--enable-lora`` the engine holds, for every projection an adapter may target (q,
k, v, o, gate, up, down) of every layer, an A stack ``[max_loras, max_lora_rank, in]`` and
a B stack ``[max_loras, max_lora_rank, out]`` in the model's dtype (as vLLM preallocates
for every supported module, whatever the adapters target): ``max_loras x max_lora_rank x
(in + out) x dtype bytes`` per module per layer, allocated before the KV pool. Adapters
add no KV. ``module_shapes`` is the one owner of the projections and their sizes; the
engine's ``model/lora.py`` allocates from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvledger.engine.checkpoint.contents import ModelShape

# The projections an adapter may target: PEFT's module name -> the block that holds it.
LORA_TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def module_shapes(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  intermediate_size: int) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each projection of one layer."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return {"q_proj": (hidden_size, q), "k_proj": (hidden_size, kv), "v_proj": (hidden_size, kv),
            "o_proj": (q, hidden_size), "gate_proj": (hidden_size, intermediate_size),
            "up_proj": (hidden_size, intermediate_size),
            "down_proj": (intermediate_size, hidden_size)}


def adapter_elements(shapes: dict[str, tuple[int, int]], num_layers: int,
                     max_lora_rank: int) -> int:
    """THE formula: the numbers one adapter of rank ``max_lora_rank`` holds, A (rank x
    fan_in) and B (fan_out x rank) of every projection of every layer."""
    return num_layers * sum(max_lora_rank * (fan_in + fan_out) for fan_in, fan_out in shapes.values())


def lora_slot_bytes(shapes: dict[str, tuple[int, int]], num_layers: int, max_loras: int,
                    max_lora_rank: int, dtype_bytes: int) -> int:
    """Bytes of the A and B stacks of every projection of every layer."""
    return max_loras * adapter_elements(shapes, num_layers, max_lora_rank) * dtype_bytes


def model_slot_bytes(shape: ModelShape, max_loras: int, max_lora_rank: int,
                     dtype_bytes: int) -> int:
    """What ``--enable-lora`` preallocates for a model of ``shape``."""
    shapes = module_shapes(shape.hidden_size, shape.num_attention_heads, shape.num_kv_heads,
                           shape.head_dim, shape.intermediate_size)
    return lora_slot_bytes(shapes, shape.num_layers, max_loras, max_lora_rank, dtype_bytes)
