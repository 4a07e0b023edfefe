"""What each attention layer keeps per token, from config.json as ``hf_config`` reads it.

A layout is one entry per layer, as the model declares it: full attention (K and V of
every token), a sliding window (K and V of the last ``window`` tokens), or multi-head
latent attention (one compressed latent per token, K only). How many blocks that costs
depends on who allocates the cache: see ``kv_pool``. An architecture whose attention the
planner does not model is refused by name, never planned as if it were a Llama.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.engine.checkpoint.hf_config import HFConfig
from kvledger.engine.checkpoint.layer_kinds import (
    MLA_ARCHITECTURES,
    READ_ARCHITECTURES,
    SLIDING_ATTENTION,
    SUPPORTED_ARCHITECTURES,
)
from kvledger.engine.errors import BadInput, some

FULL = "full"
SLIDING = "sliding"
MLA = "mla"


def planned_architectures() -> tuple[str, ...]:
    """Every architecture ``kvledger plan`` models; the engine's own are always among them."""
    return tuple(sorted(set(READ_ARCHITECTURES) | set(SUPPORTED_ARCHITECTURES)))


@dataclass(frozen=True)
class LayerKV:
    """What one attention layer keeps per token."""

    attention: str  # FULL | SLIDING | MLA
    num_kv_heads: int  # 1 for MLA's shared latent
    head_size: int  # elements per head: head_dim, or kv_lora_rank + qk_rope_head_dim
    sliding_window: int | None = None  # tokens, for SLIDING

    @property
    def tensors(self) -> int:
        """2 (K and V), or 1: MLA caches the latent once and derives K and V from it."""
        return 1 if self.attention == MLA else 2

    def bytes_per_token(self, dtype_bytes: int) -> int:
        return self.tensors * self.num_kv_heads * self.head_size * dtype_bytes


@dataclass(frozen=True)
class AttentionLayout:
    """One ``LayerKV`` per layer, and what else about attention the report should say."""

    layers: tuple[LayerKV, ...]
    notes: tuple[str, ...] = ()  # e.g. attention sinks: weights only, no KV bytes

    @property
    def name(self) -> str:
        """``full``, ``mla``, ``sliding``, or ``sliding+full (hybrid)``."""
        kinds = {layer.attention for layer in self.layers}
        if kinds == {SLIDING, FULL}:
            return "sliding+full (hybrid)"
        return "+".join(sorted(kinds))

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        return tuple(sorted({la.sliding_window for la in self.layers if la.attention == SLIDING}))


def full_layout(num_layers: int, num_kv_heads: int, head_dim: int) -> AttentionLayout:
    """Full attention on every layer: the layout of a shape given without one."""
    return AttentionLayout((LayerKV(FULL, num_kv_heads, head_dim),) * num_layers)


def pick_architecture(config: dict) -> str:
    """The first of ``architectures`` the planner models; BadInput naming them otherwise."""
    archs = config.get("architectures")
    names = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    planned = planned_architectures()
    for name in names:
        if name in planned:
            return name
    given = some(names, quote=False) or "(none given)"
    raise BadInput(f"unsupported architecture {given} for planning; kvledger plans: "
                   f"{', '.join(planned)}")


def read_layout(config: HFConfig) -> AttentionLayout:
    """What each layer of ``config`` keeps per token: MLA's latent, or K and V of every
    token or of the last ``sliding_window`` (``config.layer_types``)."""
    if config.architecture in MLA_ARCHITECTURES:
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        return AttentionLayout((LayerKV(MLA, 1, latent),) * config.num_layers)
    kv_heads, head_dim = config.num_kv_heads, config.head_dim
    layers = tuple(LayerKV(SLIDING, kv_heads, head_dim, config.sliding_window)
                   if kind == SLIDING_ATTENTION else LayerKV(FULL, kv_heads, head_dim)
                   for kind in config.layer_types)
    notes = ()
    if config.architecture == "GptOssForCausalLM":
        notes = ("attention sinks: one learned logit per head and layer, stored with the "
                 "weights (counted there), no KV bytes",)
    return AttentionLayout(layers, notes)


def declared_only(layout: AttentionLayout) -> str:
    """What a layout declares beyond full attention, for a note when it is not applied."""
    sliding = [i for i, la in enumerate(layout.layers) if la.attention == SLIDING]
    if not sliding:
        return ""
    windows = ", ".join(str(w) for w in layout.sliding_windows)
    where = ("every layer" if len(sliding) == len(layout.layers)
             else f"{len(sliding)} of {len(layout.layers)} layers")
    return f"sliding_window {windows} on {where}"
