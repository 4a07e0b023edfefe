"""Which attention each layer of a checkpoint has, as transformers' model for its
architecture lays it out: the families kvledger reads, grouped by layout, and per layer
full attention or a sliding window (``layer_types``, or the family's own pattern where
config.json gives none), with the window the sliding layers see."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvledger.engine.checkpoint.config_numbers import positive
from kvledger.engine.errors import BadInput, shown, some

# The families read, by how their attention is laid out. Grouped-/multi-query attention:
FULL_ATTENTION_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GemmaForCausalLM", "GraniteForCausalLM",
    "GraniteMoeForCausalLM", "Phi3ForCausalLM")
# Multi-head latent attention: DeepSeek-V2/V2-Lite, DeepSeek-V3/R1, Kimi-K2.
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# Sliding-window layers among full ones, per ``layer_types`` or the family's pattern.
HYBRID_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM",
                        "Gemma3ForConditionalGeneration", "GptOssForCausalLM")
READ_ARCHITECTURES = FULL_ATTENTION_ARCHITECTURES + MLA_ARCHITECTURES + HYBRID_ARCHITECTURES
# The architectures kvledger's engine runs (model_config.py checks the rest of their config).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM",
                           "GemmaForCausalLM", "Gemma3ForCausalLM",
                           "Gemma3ForConditionalGeneration", "GraniteForCausalLM",
                           "GraniteMoeForCausalLM", "Phi3ForCausalLM")

# transformers' ``layer_types`` values.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# The window a family slides over when config.json gives none (transformers' defaults).
_DEFAULT_WINDOW = {"Gemma2ForCausalLM": 4096, "Gemma3ForCausalLM": 4096,
                   "Gemma3ForConditionalGeneration": 4096, "GptOssForCausalLM": 128}
QWEN_MAX_WINDOW_LAYERS = 28  # Qwen2Config's and Qwen3Config's default


def layer_types(raw: Mapping[str, Any], architecture: str,
                num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """(FULL_ATTENTION or SLIDING_ATTENTION per layer, the sliding layers' window), where
    transformers' model for ``architecture`` slides."""
    full = (FULL_ATTENTION,) * num_layers
    if architecture.startswith("Qwen"):
        # Qwen slides only with use_sliding_window (and a window): Qwen3-MoE every layer,
        # Qwen2 and Qwen3 those layer_types marks, else those >= max_window_layers.
        if not raw.get("use_sliding_window") or not raw.get("sliding_window"):
            return full, None
        if architecture == "Qwen3MoeForCausalLM":
            kinds = (SLIDING_ATTENTION,) * num_layers
        elif raw.get("layer_types") is not None:
            kinds = _declared(raw, num_layers)
        else:
            first = raw.get("max_window_layers")
            first = QWEN_MAX_WINDOW_LAYERS if first is None else first
            if isinstance(first, bool) or not isinstance(first, int) or first < 0:
                raise BadInput(f"config.json 'max_window_layers' must be a layer count, "
                               f"got {shown(first)}")
            kinds = tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION
                          for i in range(num_layers))
    elif architecture in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        kinds = (SLIDING_ATTENTION,) * num_layers if raw.get("sliding_window") else full
    elif architecture in HYBRID_ARCHITECTURES:
        kinds = _declared(raw, num_layers) if raw.get("layer_types") is not None else \
            _hybrid_pattern(raw, architecture, num_layers)
    else:  # Llama, Granite, Gemma, MLA: full attention on every layer
        return full, None
    if SLIDING_ATTENTION not in kinds:
        return kinds, None
    return kinds, positive(raw, "sliding_window", _DEFAULT_WINDOW.get(architecture))


def _declared(raw: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    declared = raw.get("layer_types")
    if not isinstance(declared, list) or len(declared) != num_layers:
        raise BadInput(f"config.json 'layer_types' must list one type per layer "
                       f"({num_layers}), got {shown(declared)}")
    unknown = sorted({str(t) for t in declared if t not in (FULL_ATTENTION, SLIDING_ATTENTION)})
    if unknown:
        raise BadInput(f"config.json 'layer_types' has {some(unknown, quote=False)}: kvledger plans "
                       "only full_attention and sliding_attention layers")
    return tuple(declared)


def _hybrid_pattern(raw: Mapping[str, Any], architecture: str,
                    num_layers: int) -> tuple[str, ...]:
    """Gemma 2 and gpt-oss slide on even layers; Gemma 3 on all but every
    ``sliding_window_pattern``-th (default 6: 5 local : 1 global)."""
    if not architecture.startswith("Gemma3"):
        return tuple(SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION
                     for i in range(num_layers))
    pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6))
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise BadInput(f"config.json 'sliding_window_pattern' must be a positive integer, "
                       f"got {shown(pattern)}")
    return tuple(FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION
                 for i in range(num_layers))
