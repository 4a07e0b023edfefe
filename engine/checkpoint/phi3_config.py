"""Phi-3 and Phi-4 (``Phi3ForCausalLM``): what their config.json says about RoPE, read as
transformers' ``Phi3Config`` and ``_compute_longrope_parameters`` read it.

- ``partial_rotary_factor`` (Phi-4-mini: 0.75): RoPE turns only the first
  ``int(head_dim * factor)`` dimensions of each query and key head; the rest pass as they
  are.
- ``longrope`` scaling (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini; older configs say
  ``su`` or ``yarn``, which transformers reads as longrope): the frequencies divided by
  ``short_factor`` or ``long_factor`` (one number per rotated pair), cos and sin times the
  attention factor (``attention_factor``, else sqrt(1 + ln(factor) / ln(original)), where
  ``factor`` is config's or max_position_embeddings / original_max_position_embeddings).
  Which set applies is the engine's choice (``model/longrope.py``).

Quantized Phi-3 checkpoints are refused (``model_config.py``): their fused layers' scales
would have to be cut with the weights (``phi3_weights.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvledger.engine.checkpoint.config_numbers import positive
from kvledger.engine.errors import BadInput, shown

PHI3 = "Phi3ForCausalLM"
LONGROPE = "longrope"


def rotary_dim(raw: Mapping[str, Any], rope: Mapping[str, Any], head_dim: int) -> int | None:
    """How many dimensions of a head RoPE turns, None for all of them;
    ``partial_rotary_factor`` is read from the RoPE parameters (transformers 5) or the
    config's top level."""
    factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if factor is None or factor == 1:
        return None
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
        raise BadInput(f"config.json 'partial_rotary_factor' must be a number in (0, 1], "
                       f"got {shown(factor)}")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise BadInput(f"config.json 'partial_rotary_factor' {factor} turns {dim} of "
                       f"head_dim {head_dim}; RoPE needs an even number of dimensions")
    return dim


def phi3_rope_type(rope_type: Any) -> Any:
    """transformers' Phi3Config reads ``su`` and ``yarn`` as ``longrope``."""
    return LONGROPE if rope_type in ("su", "yarn") else rope_type


def longrope_parameters(raw: Mapping[str, Any], rope: Mapping[str, Any],
                        dim: int) -> dict[str, Any]:
    """The longrope parameters the engine's RoPE reads: ``short_factor`` and
    ``long_factor`` (``dim / 2`` positive numbers each), ``original_max_position_embeddings``
    and ``attention_factor``; BadInput naming what is missing or wrong."""
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = rope.get(key)
        if (not isinstance(values, list) or len(values) != dim // 2 or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < math.inf
                for v in values)):
            raise BadInput(f"config.json rope_parameters.{key} must list {dim // 2} positive "
                           f"numbers (one per rotated pair), got {shown(values)}")
        factors[key] = [float(v) for v in values]
    # Phi-3 keeps the pretraining length at the top level; transformers prefers it there.
    original = positive(raw if raw.get("original_max_position_embeddings") is not None
                        else rope, "original_max_position_embeddings",
                        raw.get("max_position_embeddings"))
    attention = rope.get("attention_factor")
    if attention is None and original < 2:  # ln(1) = 0 would divide the factor by zero
        raise BadInput(f"config.json original_max_position_embeddings {original} is not a "
                       "pretraining length; longrope needs one of at least 2")
    if attention is None:
        factor = rope.get("factor")
        if factor is None:
            factor = positive(raw, "max_position_embeddings") / original
        factor = _positive(factor, "factor")
        attention = 1.0 if factor <= 1.0 else math.sqrt(
            1 + math.log(factor) / math.log(original))
    return {"rope_type": LONGROPE, **factors, "original_max_position_embeddings": original,
            "attention_factor": _positive(attention, "attention_factor")}


def _positive(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            0 < value < math.inf):
        raise BadInput(f"config.json rope_parameters.{key} must be a positive number, "
                       f"got {shown(value)}")
    return float(value)
