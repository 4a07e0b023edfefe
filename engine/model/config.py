"""What the engine needs from a checkpoint's ``config.json``, validated at start-up.

Supported: the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) and its
mixture-of-experts variants (Mixtral, Qwen3-MoE). Anything else is refused by name
instead of being run wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvledger.engine.errors import BadInput

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
# Near misses, refused with the reason rather than only the list above.
_WHY_NOT = {
    "Qwen2MoeForCausalLM": "Qwen2-MoE's shared expert is not implemented",
    "DeepseekV2ForCausalLM": "DeepSeek's latent attention, grouped router and shared experts are not implemented",
    "DeepseekV3ForCausalLM": "DeepSeek's latent attention, grouped router and shared experts are not implemented",
}
# Whose attention takes config.json's attention_bias (q, k, v and o); Mistral's and
# Mixtral's never have a bias, Qwen2's has one on q, k and v only.
_ATTENTION_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts, as Mixtral and Qwen3-MoE route: a softmax over all ``num_experts``
    router logits, the top ``num_experts_per_tok`` kept (renormalised to sum to 1 when
    ``normalize_topk``), each token's output the weighted sum of its experts' MLPs."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # each expert's
    normalize_topk: bool
    sparse_layers: tuple[int, ...]  # the layers with experts; the others have a dense MLP


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's (Mixtral: each expert's)
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
    qk_norm: bool = False  # RMSNorm over head_dim of each q and k head, before RoPE (Qwen3)
    moe: MoEConfig | None = None

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
            why = next((f" ({_WHY_NOT[a]})" for a in archs if a in _WHY_NOT), "")
            raise BadInput(f"unsupported architecture {', '.join(archs) or '(none given)'}{why}; "
                           f"kvledger runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise BadInput(f"unsupported hidden_act {raw['hidden_act']!r} (only silu)")
        if raw.get("mlp_bias"):
            raise BadInput("unsupported: mlp_bias")
        _refuse_unknown_routing(raw)
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
            if arch.startswith("Qwen"):
                sliding = _qwen_window(raw, arch)
            bias = arch in _ATTENTION_BIAS and bool(raw.get("attention_bias", False))
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=_head_dim(raw, arch, hidden, heads),
                rms_norm_eps=_positive_float("rms_norm_eps", raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope if rope_type != "default" else None,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bias,
                o_bias=bias,
                sliding_window=_positive_int("sliding_window", sliding) if sliding else None,
                qk_norm=arch in _QK_NORM,
                moe=_moe(raw, arch),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise BadInput(f"config.json: missing or bad field {exc}") from None


def _head_dim(raw: dict[str, Any], arch: str, hidden: int, heads: int) -> int:
    if raw.get("head_dim"):
        return _positive_int("head_dim", raw["head_dim"])
    if arch == "Qwen3ForCausalLM" and hidden // heads != 128:
        # transformers' Qwen3Config defaults to 128; the planner takes hidden / heads.
        raise BadInput("config.json: Qwen3ForCausalLM without head_dim (transformers takes 128, "
                       f"hidden_size / num_attention_heads is {hidden // heads}); set head_dim")
    return hidden // heads


def _moe(raw: dict[str, Any], arch: str) -> MoEConfig | None:
    """Mixtral: experts in every layer, top-k always renormalised. Qwen3-MoE: experts in
    the layers ``(i + 1) % decoder_sparse_step == 0`` not in ``mlp_only_layers``."""
    layers = int(raw["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        num_experts, sparse = int(raw.get("num_local_experts", 8)), tuple(range(layers))
        expert_size, normalize = int(raw["intermediate_size"]), True
    elif arch == "Qwen3MoeForCausalLM":
        num_experts = int(raw.get("num_experts", 128))
        step = _positive_int("decoder_sparse_step", raw.get("decoder_sparse_step", 1))
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise BadInput(f"config.json 'mlp_only_layers' must be a list of layer indices, got {dense!r}")
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        expert_size = _positive_int("moe_intermediate_size", raw.get("moe_intermediate_size", 768))
        normalize = bool(raw.get("norm_topk_prob", False))
        if num_experts == 0 or not sparse:
            return None  # every layer dense
    else:
        return None
    num_experts = _positive_int("num_experts", num_experts)
    top_k = _positive_int("num_experts_per_tok", raw.get("num_experts_per_tok", 2))
    if top_k > num_experts:
        raise BadInput(f"config.json 'num_experts_per_tok' {top_k} is more than the {num_experts} experts")
    return MoEConfig(num_experts, top_k, expert_size, normalize, sparse)


def _refuse_unknown_routing(raw: dict[str, Any]) -> None:
    """Experts routed any other way than a softmax over all of them then top-k (and
    shared experts) would load and run wrong: refuse them by name."""
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if raw.get(key):
            raise BadInput(f"unsupported: a shared expert ({key} {raw[key]}); kvledger runs "
                           "routed experts only")
    router = {"scoring_func": (None, "softmax"), "topk_method": (None, "greedy"),
              "n_group": (None, 0, 1), "topk_group": (None, 0, 1),
              "routed_scaling_factor": (None, 1, 1.0)}
    for key, allowed in router.items():
        if raw.get(key) not in allowed:
            raise BadInput(f"unsupported MoE router: {key} {raw[key]!r} (kvledger routes by a "
                           "softmax over all experts, then top-k)")


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


def _qwen_window(raw: dict[str, Any], arch: str) -> int | None:
    """Qwen slides only with ``use_sliding_window``: Qwen3-MoE every layer, Qwen2 and Qwen3
    the layers ``layer_types`` marks (without it, those ``>= max_window_layers``)."""
    if not raw.get("use_sliding_window", False) or not raw.get("sliding_window"):
        return None
    if arch == "Qwen3MoeForCausalLM":
        return raw["sliding_window"]
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or [
        "sliding_attention" if i >= int(raw.get("max_window_layers", 28)) else "full_attention"
        for i in range(layers)]
    if set(types) == {"full_attention"}:
        return None
    if set(types) == {"sliding_attention"}:
        return raw["sliding_window"]
    raise BadInput(f"unsupported: {arch} use_sliding_window with a sliding window on only some "
                   "layers (max_window_layers, layer_types); kvledger applies one window to "
                   "every layer")
