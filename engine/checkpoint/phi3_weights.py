"""Phi-3's fused projections, as its checkpoints store them: each attention's
``qkv_proj.weight`` ``[(heads + 2 * kv_heads) * head_dim, hidden]`` (q's rows, then k's,
then v's) and each MLP's ``gate_up_proj.weight`` ``[2 * intermediate, hidden]`` (gate's
rows, then up's).

The loader splits them into the engine's ``q_proj``/``k_proj``/``v_proj`` and
``gate_proj``/``up_proj`` (views, no copy), so a Phi-3 is the engine's Llama layers from
there on: tensor parallelism shards each part by its own heads (a fused tensor cut in
equal row ranges would hand a rank the wrong heads), a pipeline stage reads its layers'
tensors by name, and ``fusion.py`` fuses them back for the decode steps. Torch-free: the
pre-flight checks the stored shapes against these (``loadable.check_shapes``).
"""

from __future__ import annotations

from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.checkpoint.phi3_config import PHI3

# The stored name's ending -> the engine's projections it holds, in its row order.
FUSED_PROJECTIONS = {"self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"),
                     "mlp.gate_up_proj.weight": ("gate_proj", "up_proj")}


def _fused(name: str, config: ModelConfig) -> tuple[str, tuple[str, ...]] | None:
    """(the module's prefix, its parts) when ``name`` is one of Phi-3's fused weights."""
    if config.architecture != PHI3:
        return None
    for end, parts in FUSED_PROJECTIONS.items():
        if name.endswith("." + end):
            return name[:-len(end.split(".", 1)[1])], parts
    return None


def split_names(name: str, config: ModelConfig) -> tuple[str, ...] | None:
    """The engine's weights a stored fused weight fills, in its row order; None when
    ``name`` is not one."""
    found = _fused(name, config)
    if found is None:
        return None
    prefix, parts = found
    return tuple(f"{prefix}{part}.weight" for part in parts)


def split_rows(name: str, config: ModelConfig) -> tuple[int, ...] | None:
    """How many rows of the fused weight ``name`` each part takes (None: not fused)."""
    found = _fused(name, config)
    if found is None:
        return None
    if found[1][0] == "q_proj":
        kv = config.num_kv_heads * config.head_dim
        return (config.num_attention_heads * config.head_dim, kv, kv)
    return (config.intermediate_size,) * 2


def fused_shape(name: str, config: ModelConfig) -> tuple[int, int] | None:
    """The shape config.json gives the fused weight ``name`` (None: not fused)."""
    rows = split_rows(name, config)
    return None if rows is None else (sum(rows), config.hidden_size)
