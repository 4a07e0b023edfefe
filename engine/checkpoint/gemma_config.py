"""What Gemma's layers need from config.json beyond the Llama family's (Gemma 1, Gemma 3's
text model, and Gemma 3's multimodal checkpoints served as text only), read as
transformers 5 reads ``GemmaConfig`` and ``Gemma3TextConfig``, and the names a multimodal
checkpoint gives its language model's tensors.

Gemma 3 stores RoPE per layer type (``rope_parameters`` = ``{"full_attention": {...},
"sliding_attention": {...}}``); an older config.json gives ``rope_theta`` and
``rope_scaling`` for the full layers and ``rope_local_base_freq`` for the sliding ones,
whose RoPE is never scaled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvledger.engine.checkpoint.layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION
from kvledger.engine.errors import BadInput, shown

GEMMA_ARCHITECTURES = ("GemmaForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# Served as its language model alone: the vision tower and the projector are not loaded.
TEXT_ONLY_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
# "gelu" is a legacy value of Gemma's releases that transformers runs as the tanh
# approximation (GemmaConfig.__post_init__), as vLLM does.
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
# Gemma3TextConfig's defaults: the full layers' theta, the sliding layers'.
_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0
# Where a multimodal checkpoint keeps its language model: transformers 5's save_pretrained
# (and the published checkpoints) first, transformers 4.5x's own layout second.
_LANGUAGE_MODEL = (("language_model.model.", "model."), ("model.language_model.", "model."),
                   ("language_model.lm_head.", "lm_head."))
_NOT_LOADED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
               "model.multi_modal_projector.")


@dataclass(frozen=True)
class GemmaFields:
    """Gemma's own numbers: what the attention's scores are scaled by the inverse square
    root of (Gemma 3's ``query_pre_attn_scalar``; None: ``head_dim``, Gemma 1's), whether
    each layer has Gemma 3's extra norms (q and k per head, before and after the MLP), and
    the sliding layers' RoPE base (None: one RoPE for every layer). The embedding is
    scaled by ``sqrt(hidden_size)``, every norm by ``1 + w``."""

    query_pre_attn_scalar: float | None
    sandwich_norms: bool
    local_rope_theta: float | None


def read_gemma(raw: Mapping[str, Any], architecture: str) -> tuple[GemmaFields, dict[str, Any]]:
    """(Gemma's fields, the full-attention layers' RoPE parameters as ``model_config`` reads
    a Llama's, ``rope_theta`` included) from a (text) config.json object; BadInput for what
    kvledger's Gemma does not run (softcapping, bidirectional attention, another activation)."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise BadInput(f"unsupported {architecture} hidden_activation {shown(act)} "
                       f"(only {', '.join(_ACTIVATIONS)})")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(name) is not None:
            raise BadInput(f"unsupported: {architecture} with {name} {shown(raw[name])} "
                           "(logit softcapping is not implemented)")
    if raw.get("use_bidirectional_attention"):
        raise BadInput(f"unsupported: {architecture} use_bidirectional_attention")
    if architecture == "GemmaForCausalLM":
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        return GemmaFields(None, False, None), _with_theta(rope, raw, 10_000.0)
    scalar = raw.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, int | float) or not scalar > 0:
        raise BadInput(f"config.json 'query_pre_attn_scalar' must be a positive number, "
                       f"got {shown(scalar)}")
    rope = raw.get("rope_parameters")
    if isinstance(rope, dict) and (FULL_ATTENTION in rope or SLIDING_ATTENTION in rope):
        full = _with_theta(rope.get(FULL_ATTENTION) or {}, {}, _GLOBAL_THETA)
        local = _with_theta(rope.get(SLIDING_ATTENTION) or {}, {}, _LOCAL_THETA)
    else:  # one RoPE given: the full layers', the sliding ones' from rope_local_base_freq
        full = _with_theta(rope or raw.get("rope_scaling") or {}, raw, _GLOBAL_THETA)
        local = {"rope_theta": raw.get("rope_local_base_freq", _LOCAL_THETA)}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise BadInput(f"unsupported: {architecture} sliding layers' rope_type "
                       f"{shown(local.get('rope_type', local.get('type')))} (only default)")
    theta = local["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
        raise BadInput(f"config.json sliding layers' rope_theta must be a positive number, "
                       f"got {shown(theta)}")
    return GemmaFields(float(scalar), True, float(theta)), full


def _with_theta(rope: Any, raw: Mapping[str, Any], default: float) -> dict[str, Any]:
    """``rope`` (an object, else BadInput) with a ``rope_theta``: its own, ``raw``'s, or
    transformers' default."""
    if not isinstance(rope, dict):
        raise BadInput(f"config.json 'rope_parameters' (or 'rope_scaling') must be an "
                       f"object, got {shown(rope)}")
    return {"rope_theta": raw.get("rope_theta", default), **rope}


def pick_text_only(config: Mapping[str, Any]) -> str | None:
    """The architecture of ``config``'s (a config.json object's) ``architectures`` that is
    served as its language model alone, None when there is none."""
    archs = config.get("architectures")
    return next((a for a in archs if a in TEXT_ONLY_ARCHITECTURES), None) \
        if isinstance(archs, list) else None


def language_model_name(name: str, architecture: str) -> str | None:
    """The engine's name for a stored tensor of ``architecture``: a multimodal checkpoint's
    language model's as a ``*ForCausalLM``'s (``model.``, ``lm_head.``), None for its
    vision tower and projector (not loaded); any other checkpoint's as stored."""
    if architecture not in TEXT_ONLY_ARCHITECTURES:
        return name
    for stored, engine in _LANGUAGE_MODEL:
        if name.startswith(stored):
            return engine + name[len(stored):]
    return None if name.startswith(_NOT_LOADED) else name
