"""What the engine needs from a checkpoint's ``config.json``, validated at start-up.

Supported: the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3), its
mixture-of-experts variants (Mixtral, Qwen3-MoE), Gemma 1 and Gemma 3 (its text
model, and its multimodal checkpoints served as text only: ``gemma_config``), IBM Granite
3.x (a Llama with four multipliers, ``granite_config``; its MoE with Mixtral's routing,
``granite_moe_weights``) and Phi-3/Phi-4 (fused projections split at load,
``phi3_weights``; partial rotary and longrope, ``phi3_config``). Anything else is refused
by name instead of being run wrong. The shape is ``hf_config``'s reading, the planner's
too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvledger.engine.checkpoint.config_numbers import positive
from kvledger.engine.checkpoint.contents import ModelShape, shape_fields
from kvledger.engine.checkpoint.fp8_format import SERVED_WEIGHTS
from kvledger.engine.checkpoint.gemma_config import GEMMA_ARCHITECTURES, GemmaFields, read_gemma
from kvledger.engine.checkpoint.granite_config import granite_fields
from kvledger.engine.checkpoint.hf_config import (
    HFConfig,
    parse_config,
    read_config_json,
    text_config,
)
from kvledger.engine.checkpoint.layer_kinds import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    SUPPORTED_ARCHITECTURES,
)
from kvledger.engine.checkpoint.moe_config import refuse_unknown_routing
from kvledger.engine.checkpoint.phi3_config import (
    LONGROPE,
    PHI3,
    longrope_parameters,
    phi3_rope_type,
    rotary_dim,
)
from kvledger.engine.checkpoint.weight_formats import declared_format
from kvledger.engine.errors import BadInput, shown, some

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", LONGROPE)  # longrope: Phi-3's only
# Near misses, refused with the reason rather than only the list above.
_WHY_NOT = {
    "Qwen2MoeForCausalLM": "Qwen2-MoE's shared expert is not implemented",
    "DeepseekV2ForCausalLM": "DeepSeek's latent attention, grouped router and shared experts are not implemented",
    "DeepseekV3ForCausalLM": "DeepSeek's latent attention, grouped router and shared experts are not implemented",
    "Gemma2ForCausalLM": "Gemma 2's attention logit softcapping is not implemented",
}
# Whose attention takes config.json's attention_bias (q, k, v and o); Mistral's and
# Mixtral's never have a bias, Qwen2's has one on q, k and v only.
_ATTENTION_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                   "GraniteForCausalLM", "GraniteMoeForCausalLM")
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Whose checkpoints fuse what the loader splits: a quantized layer's scales would have to
# be cut with it, so those are refused.
_FUSED_AS_STORED = {PHI3: "fused qkv_proj and gate_up_proj",
                    "GraniteMoeForCausalLM": "experts' input_linear and output_linear"}


@dataclass(frozen=True, kw_only=True)
class ModelConfig(ModelShape):
    """The model's shape (``ModelShape``, the planner's record: ``intermediate_size`` is
    the dense MLP's, Mixtral's each expert's) and what the engine's layers need besides,
    read from the same config.json in one pass (``shape_fields``)."""

    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool
    o_bias: bool
    sliding_window: int | None
    qk_norm: bool = False  # RMSNorm over head_dim of each q and k head, before RoPE (Qwen3)
    # How the linear layers are stored, as the engine loads them: "fp8" (fp8_format.py);
    # "gptq", "awq", "w4a16": 4-bit (int4_format.py); "": not quantized. (``quantization``,
    # the shape's, is config.json's quant_method as written, e.g. "compressed-tensors".)
    weight_format: str = ""
    gemma: GemmaFields | None = None  # Gemma's own numbers (gemma_config.py); None: not Gemma
    rotary_dim: int | None = None  # RoPE over a head's first rotary_dim only (Phi-4-mini)
    # Granite's (granite_config.py); neutral for the others. attention_scale None: 1/sqrt(head_dim).
    embedding_multiplier: float = 1.0
    attention_scale: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        return cls.from_dict(read_config_json(model_dir))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """The engine's config from a config.json object; BadInput for what it cannot run."""
        raw = text_config(raw)
        archs = raw.get("architectures")
        archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            why = next((f" ({_WHY_NOT[a]})" for a in archs if a in _WHY_NOT), "")
            raise BadInput(f"unsupported architecture {some(archs, quote=False) or '(none given)'}{why}; "
                           f"kvledger runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        weight_format = _weight_format(raw)
        gemma = None
        if arch in GEMMA_ARCHITECTURES:  # its activation, and RoPE per layer type
            gemma, rope = read_gemma(raw, arch)
        elif raw.get("hidden_act", "silu") != "silu":
            raise BadInput(f"unsupported hidden_act {shown(raw['hidden_act'])} (only silu)")
        else:  # transformers 5 writes rope_parameters = {"rope_type", "rope_theta", ...}.
            rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if raw.get("mlp_bias"):
            raise BadInput("unsupported: mlp_bias")
        refuse_unknown_routing(raw)
        if not isinstance(rope, dict):
            raise BadInput(f"config.json 'rope_parameters' (or 'rope_scaling') must be an "
                           f"object, got {shown(rope)}")
        rope = dict(rope)
        rope_theta = _positive_float("rope_theta", rope.pop("rope_theta",
                                                            raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if arch == PHI3:
            rope_type = phi3_rope_type(rope_type)
        elif rope_type == LONGROPE:
            raise BadInput(f"unsupported: longrope RoPE scaling on {arch} (kvledger reads it "
                           "for Phi3ForCausalLM)")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise BadInput(f"unsupported rope_scaling type {shown(rope_type)}; "
                           f"kvledger supports {', '.join(SUPPORTED_ROPE_TYPES)}")
        if rope_type != LONGROPE:
            _check_rope_scaling(rope, rope_type)
        read = parse_config(raw, arch)
        rotary = rotary_dim(raw, rope, read.head_dim) if arch == PHI3 else None
        if rope_type == LONGROPE:  # its factors' count is the rotated pairs'
            rope = longrope_parameters(raw, rope, rotary or read.head_dim)
        if arch in _FUSED_AS_STORED and weight_format:
            raise BadInput(f"unsupported: a quantized {arch} checkpoint ({weight_format}); "
                           f"kvledger splits its {_FUSED_AS_STORED[arch]} only unquantized")
        bias = arch in _ATTENTION_BIAS and bool(raw.get("attention_bias", False))
        return cls(
            **shape_fields(read),
            rms_norm_eps=_positive_float("rms_norm_eps", raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type != "default" else None,
            qkv_bias=arch == "Qwen2ForCausalLM" or bias,
            o_bias=bias,
            # Gemma 3 slides on some layers only: its layout says which (gemma.py).
            sliding_window=None if gemma is not None else _one_window(read),
            qk_norm=arch in _QK_NORM,
            weight_format=weight_format,
            gemma=gemma,
            rotary_dim=rotary,
            **granite_fields(raw, arch),
        )


def _one_window(read: HFConfig) -> int | None:
    """The window every layer slides over, None when none slides; one on only some layers
    is refused (the engine applies one window to every layer)."""
    kinds = set(read.layer_types)
    if kinds == {FULL_ATTENTION}:
        return None
    if kinds == {SLIDING_ATTENTION}:
        return read.sliding_window
    raise BadInput(f"unsupported: {read.architecture} use_sliding_window with a sliding window "
                   "on only some layers (max_window_layers, layer_types); kvledger applies one "
                   "window to every layer")


def _weight_format(raw: Mapping[str, Any]) -> str:
    """The name of the served format config.json declares (``weight_formats``: "fp8",
    "gptq", "awq", "w4a16"), "" for none. Other quantized weights
    (bitsandbytes, GGUF, HQQ, packed MXFP4, other bit widths, ...) would be cast to the
    model dtype as if they were values, or fail to load halfway: refuse them by their
    method, before anything is loaded or allocated."""
    quant = raw.get("quantization_config")
    if quant is None:
        return ""
    served = declared_format(quant) if isinstance(quant, dict) else None
    if served is not None:
        return served.name
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if isinstance(method, str) and method:
        raise BadInput(f"checkpoint is quantized with {shown(method)} "
                       f"(quantization_config.quant_method); {SERVED_WEIGHTS}")
    raise BadInput(f"checkpoint is quantized (config.json has a quantization_config, with no "
                   f"quant_method); {SERVED_WEIGHTS}")


def _positive_float(name: str, value: Any) -> float:
    """A positive finite number: a rope_theta or rms_norm_eps of 0, below 0, NaN or a string
    would make every logit NaN (and sampling fail) rather than refuse at start-up."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if isinstance(value, bool) or not (0.0 < number < math.inf):
        raise BadInput(f"config.json {name!r} must be a positive number, got {shown(value)}")
    return number


def _check_rope_scaling(rope: Mapping[str, Any], rope_type: str) -> None:
    """What a scaled RoPE reads (``transformer._scale_inv_freq``), there and sound: a
    missing one would be a KeyError at load, ``high_freq_factor <= low_freq_factor`` a
    division by zero that turns the positions' frequencies NaN."""
    if rope_type == "default":
        return
    _positive_float("rope_parameters.factor", rope.get("factor"))
    if rope_type == "llama3":
        low = _positive_float("rope_parameters.low_freq_factor", rope.get("low_freq_factor"))
        high = _positive_float("rope_parameters.high_freq_factor", rope.get("high_freq_factor"))
        if high <= low:
            raise BadInput(f"config.json rope_parameters.high_freq_factor ({high}) must be more "
                           f"than its low_freq_factor ({low})")
        positive(rope, "original_max_position_embeddings")
