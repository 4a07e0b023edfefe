"""What the engine needs from a checkpoint's ``config.json``, validated at start-up.

Supported: the Llama family (Llama 2/3, Mistral, Qwen2/2.5). Anything else is refused by
name instead of being run wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvledger.engine.errors import BadInput

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    sliding_window: int | None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise BadInput(f"{model_dir}: no config.json (expected a Hugging Face checkpoint directory)")
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise BadInput(f"{path}: not valid JSON: {exc}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise BadInput(f"unsupported architecture {', '.join(archs) or '(none given)'}; "
                           f"kvledger runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise BadInput(f"unsupported hidden_act {raw['hidden_act']!r} (only silu)")
        if raw.get("mlp_bias"):
            raise BadInput("unsupported: mlp_bias")
        # transformers 5 writes rope_parameters = {"rope_type", "rope_theta", ...}.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = _positive_float("rope_theta", rope.pop("rope_theta",
                                                            raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise BadInput(f"unsupported rope_scaling type {rope_type!r}; "
                           f"kvledger supports {', '.join(SUPPORTED_ROPE_TYPES)}")
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            sliding = raw.get("sliding_window")
            if arch == "Qwen2ForCausalLM":
                sliding = _qwen2_window(raw)
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=_positive_float("rms_norm_eps", raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope if rope_type != "default" else None,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
                o_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
                sliding_window=_positive_int("sliding_window", sliding) if sliding else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise BadInput(f"config.json: missing or bad field {exc}") from None


def _positive_float(name: str, value: Any) -> float:
    """A positive finite number: a rope_theta or rms_norm_eps of 0, below 0, NaN or a string
    would make every logit NaN (and sampling fail) rather than refuse at start-up."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not (0.0 < number < math.inf):
        raise BadInput(f"config.json {name!r} must be a positive number, got {value!r}")
    return number


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadInput(f"config.json {name!r} must be a positive integer, got {value!r}")
    return value


def _qwen2_window(raw: dict[str, Any]) -> int | None:
    """Qwen2 slides only layers ``>= max_window_layers``, and only with use_sliding_window."""
    if not raw.get("use_sliding_window", False) or not raw.get("sliding_window"):
        return None
    if int(raw.get("max_window_layers", 0)) >= int(raw["num_hidden_layers"]):
        return None
    raise BadInput("unsupported: Qwen2 use_sliding_window with a sliding window on only some "
                   "layers (max_window_layers); kvledger applies one window to every layer")
