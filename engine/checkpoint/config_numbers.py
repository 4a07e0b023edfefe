"""The numbers config.json states, read as the numbers they must be: a size, count or
context is a positive integer no model comes near ``MAX_CONFIG_NUMBER`` of, and the
context a model takes is derived as vLLM derives it (``context_length``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvledger.engine.errors import BadInput, shown

# No model has a size, count or context near this; past it a number only costs the
# planner time and memory (a tuple per layer, a tensor name per layer and expert).
MAX_CONFIG_NUMBER = 2**53


def positive(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """``config[key]`` as a positive integer; absent or null is ``default``."""
    value = config.get(key)
    if value is None:
        value = default
    if value is None:
        raise BadInput(f"config.json has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadInput(f"config.json {key!r} must be a positive integer, got {shown(value)}")
    if value > MAX_CONFIG_NUMBER:
        raise BadInput(f"config.json {key!r} is larger than any model's (over "
                       f"{MAX_CONFIG_NUMBER:,})")
    return value


def context_length(raw: Mapping[str, Any]) -> int:
    """The positions the model takes, as vLLM derives ``max_model_len``
    (``_get_and_verify_max_len``): ``max_position_embeddings``, times a RoPE scaling's
    ``factor`` (yarn's from its ``original_max_position_embeddings``) unless its type
    already counts it in (llama3, longrope, su) or the model is a Gemma 3 (its 128K is
    scaled already). A transformers 5 config may give one RoPE per layer type: the last
    factor counts, as in vLLM."""
    positions = positive(raw, "max_position_embeddings")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling")
    if not isinstance(rope, Mapping) or "gemma3" in str(raw.get("model_type", "")):
        return positions
    nested = all(isinstance(value, Mapping) for value in rope.values()) and bool(rope)
    factor = None
    for part in rope.values() if nested else (rope,):
        kind = part.get("rope_type", part.get("type", "default"))
        if kind in ("su", "longrope", "llama3") or part.get("factor") is None:
            continue
        factor = part["factor"]
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not (
                0 < factor <= MAX_CONFIG_NUMBER):
            raise BadInput(f"config.json rope_parameters.factor must be a positive number, "
                           f"got {shown(factor)}")
        if kind == "yarn":
            positions = positive(part, "original_max_position_embeddings", positions)
    if factor is None:
        return positions
    return min(int(positions * factor), MAX_CONFIG_NUMBER)


def default_context(raw: Mapping[str, Any], positions: int) -> int | None:
    """The context vLLM runs when ``--max-model-len`` is not given, where it is not the
    ``positions`` the model takes: a longrope (su) model's ``original_max_position_embeddings``
    (vLLM 0.32's ``_get_and_verify_max_len``: "to avoid performance degradation for
    shorter sequences", the short factors serving it), never more than ``positions``;
    None for any other model."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling")
    if not isinstance(rope, Mapping):
        return None
    nested = all(isinstance(value, Mapping) for value in rope.values()) and bool(rope)
    parts = list(rope.values()) if nested else [rope]
    if not any(part.get("rope_type", part.get("type")) in ("su", "longrope") for part in parts):
        return None
    original = raw.get("original_max_position_embeddings")
    if original is None:
        original = next((part["original_max_position_embeddings"] for part in parts
                         if part.get("original_max_position_embeddings") is not None), None)
    if original is None:
        return None
    return min(positive({"original_max_position_embeddings": original},
                        "original_max_position_embeddings"), positions)
