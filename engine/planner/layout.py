"""What each attention layer keeps per token, read from config.json by architecture.

A layout is one entry per layer, as the model declares it: full attention (K and V of
every token), a sliding window (K and V of the last ``window`` tokens), or multi-head
latent attention (one compressed latent per token, K only). How many blocks that costs
depends on who allocates the cache: see ``kv_pool``. An architecture whose attention the
planner does not model is refused by name, never planned as if it were a Llama.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.engine.errors import BadInput
from kvledger.engine.model.config import SUPPORTED_ARCHITECTURES

FULL = "full"
SLIDING = "sliding"
MLA = "mla"

# Grouped-/multi-query attention on every layer (a declared window noted, see _declared_window).
FULL_ATTENTION_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GemmaForCausalLM")
# Multi-head latent attention: DeepSeek-V2/V2-Lite, DeepSeek-V3/R1, Kimi-K2.
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# Sliding-window layers among full ones, per ``layer_types`` or the family's pattern.
HYBRID_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM",
                        "Gemma3ForConditionalGeneration", "GptOssForCausalLM")


def planned_architectures() -> tuple[str, ...]:
    """Every architecture ``kvledger plan`` models; the engine's own are always among them."""
    known = FULL_ATTENTION_ARCHITECTURES + MLA_ARCHITECTURES + HYBRID_ARCHITECTURES
    return tuple(sorted(set(known) | set(SUPPORTED_ARCHITECTURES)))


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
    given = ", ".join(names) or "(none given)"
    raise BadInput(f"unsupported architecture {given} for planning; kvledger plans: "
                   f"{', '.join(planned)}")


def read_layout(config: dict, architecture: str, num_layers: int, num_kv_heads: int,
                head_dim: int) -> AttentionLayout:
    """The layout ``config`` declares for ``architecture`` (one of ``planned_architectures``)."""
    if architecture in MLA_ARCHITECTURES:
        latent = _positive(config, "kv_lora_rank") + _positive(config, "qk_rope_head_dim")
        return AttentionLayout((LayerKV(MLA, 1, latent),) * num_layers)
    types = _layer_types(config, architecture, num_layers)
    window = _window(config, architecture) if SLIDING in types else None
    layers = tuple(LayerKV(SLIDING, num_kv_heads, head_dim, window) if kind == SLIDING
                   else LayerKV(FULL, num_kv_heads, head_dim) for kind in types)
    notes = ()
    if architecture == "GptOssForCausalLM":
        notes = ("attention sinks: one learned logit per head and layer, stored with the "
                 "weights (counted there), no KV bytes",)
    return AttentionLayout(layers, notes)


def _layer_types(config: dict, architecture: str, num_layers: int) -> list[str]:
    """FULL or SLIDING per layer: ``layer_types`` when given, else the family's rule."""
    declared = config.get("layer_types")
    if declared is not None:
        if not isinstance(declared, list) or len(declared) != num_layers:
            raise BadInput(f"config.json 'layer_types' must list one type per layer "
                           f"({num_layers}), got {declared!r}")
        kinds = {"full_attention": FULL, "sliding_attention": SLIDING}
        unknown = sorted({str(t) for t in declared if t not in kinds})
        if unknown:
            raise BadInput(f"config.json 'layer_types' has {', '.join(unknown)}: kvledger plans "
                           "only full_attention and sliding_attention layers")
        return [kinds[t] for t in declared]
    if architecture in ("Gemma2ForCausalLM", "GptOssForCausalLM"):
        return [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]  # even layers slide
    if architecture.startswith("Gemma3"):
        pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6))
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise BadInput(f"config.json 'sliding_window_pattern' must be a positive integer, "
                           f"got {pattern!r}")
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        return [SLIDING if config.get("sliding_window") else FULL] * num_layers
    if architecture.startswith("Qwen") and config.get("use_sliding_window") \
            and config.get("sliding_window"):
        first = config.get("max_window_layers", 0)
        return [SLIDING if i >= first else FULL for i in range(num_layers)]
    return [FULL] * num_layers


def _window(config: dict, architecture: str) -> int:
    default = {"Gemma2ForCausalLM": 4096, "GptOssForCausalLM": 128}.get(
        architecture, 4096 if architecture.startswith("Gemma3") else None)
    return _positive(config, "sliding_window", default)


def _positive(config: dict, key: str, default: object = None) -> int:
    value = config.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadInput(f"config.json {key!r} must be a positive integer, got {value!r}")
    return value


def declared_only(layout: AttentionLayout) -> str:
    """What a layout declares beyond full attention, for a note when it is not applied."""
    sliding = [i for i, la in enumerate(layout.layers) if la.attention == SLIDING]
    if not sliding:
        return ""
    windows = ", ".join(str(w) for w in layout.sliding_windows)
    where = ("every layer" if len(sliding) == len(layout.layers)
             else f"{len(sliding)} of {len(layout.layers)} layers")
    return f"sliding_window {windows} on {where}"
