"""A checkpoint's ``config.json``, read once: the one reading the planner and the engine
both build from (the planner its ``ModelShape``, the engine its ``ModelConfig``).

Torch-free, as the planner runs in a light init container. ``parse_config`` reads a
config as transformers' config class for the architecture reads it: a field left out or
given as null takes that class's default (``head_dim`` hidden_size / num_attention_heads,
Qwen2's and Qwen3's ``max_window_layers`` 28, Gemma 3's text defaults), and a sliding
window is where transformers' ``layer_types`` puts it. The numbers every checkpoint
states (sizes, heads, layers, vocabulary, context) are required.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvledger.engine import json_text
from kvledger.engine.checkpoint.files import CONFIG_FILE
from kvledger.engine.checkpoint.read_limits import MAX_CONFIG_BYTES
from kvledger.engine.errors import BadInput, shown, some

# The families read, by how their attention is laid out. Grouped-/multi-query attention:
FULL_ATTENTION_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GemmaForCausalLM")
# Multi-head latent attention: DeepSeek-V2/V2-Lite, DeepSeek-V3/R1, Kimi-K2.
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# Sliding-window layers among full ones, per ``layer_types`` or the family's pattern.
HYBRID_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM",
                        "Gemma3ForConditionalGeneration", "GptOssForCausalLM")
READ_ARCHITECTURES = FULL_ATTENTION_ARCHITECTURES + MLA_ARCHITECTURES + HYBRID_ARCHITECTURES
# The architectures kvledger's engine runs (model_config.py checks the rest of their config).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")

# transformers' ``layer_types`` values.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# transformers' defaults for fields a published config.json leaves out (Gemma 3's
# multimodal checkpoints give only what differs from Gemma3TextConfig).
CONFIG_DEFAULTS = {
    "gemma3_text": {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "head_dim": 256, "max_position_embeddings": 131_072, "sliding_window": 4096},
}
# Keys a multimodal config keeps at its top level for the language model it nests.
_SHARED_KEYS = ("architectures", "torch_dtype", "dtype", "tie_word_embeddings",
                "quantization_config")
# The window a family slides over when config.json gives none (transformers' defaults).
_DEFAULT_WINDOW = {"Gemma2ForCausalLM": 4096, "Gemma3ForCausalLM": 4096,
                   "Gemma3ForConditionalGeneration": 4096, "GptOssForCausalLM": 128}
QWEN_MAX_WINDOW_LAYERS = 28  # Qwen2Config's and Qwen3Config's default
QWEN3_HEAD_DIM = 128  # Qwen3Config's default
# No model has a size, count or context near these; past them a number only costs the
# planner time and memory (a tuple per layer, a tensor name per layer and expert).
MAX_CONFIG_NUMBER = 2**53
MAX_LAYERS = 1024  # the deepest published models have ~130


@dataclass(frozen=True)
class HFConfig:
    """What config.json declares, as transformers reads it for ``architecture``."""

    architecture: str  # the one of ``architectures`` it is read as (the caller's choice)
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int  # MLA: a query/key head, qk_nope_head_dim + qk_rope_head_dim
    hidden_size: int
    intermediate_size: int  # the dense MLP's (Mixtral: each expert's)
    vocab_size: int
    max_position_embeddings: int  # the positions it takes (``context_length``)
    torch_dtype: str  # e.g. "bfloat16"; "" when the config has none
    tie_word_embeddings: bool
    quantization: str  # quantization_config.quant_method, e.g. "mxfp4"; "" when none
    layer_types: tuple[str, ...]  # FULL_ATTENTION or SLIDING_ATTENTION, one per layer
    sliding_window: int | None  # tokens a sliding layer sees; None when no layer slides
    kv_lora_rank: int | None = None  # MLA: the latent cached per token, with qk_rope_head_dim
    qk_rope_head_dim: int | None = None
    # The whole (text) config, for the fields only the engine reads (RoPE, norms, experts).
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


def checked_model_dir(model_dir: str | os.PathLike) -> Path:
    """``model_dir`` as a Path; BadInput when it is missing, not a folder or unreadable."""
    path = Path(model_dir)
    named = shown(str(path))
    try:
        found = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise BadInput(f"model directory {named} does not exist") from None
    except OSError as exc:  # a name too long, a loop of links, ...
        raise BadInput(f"model directory {named}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(found.st_mode):
        raise BadInput(f"--model {named} is not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise BadInput(f"model directory {named} is not readable")
    return path


def read_json(path: Path, what: str, max_bytes: int | None = None) -> object:
    """A JSON file's value; BadInput naming ``what`` when missing, unreadable, garbled or
    (with ``max_bytes``) larger than that."""
    try:
        with open(path, "rb") as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        if max_bytes is not None and len(data) > max_bytes:
            raise BadInput(f"{what} {path} is larger than {max_bytes:,} bytes, more than any "
                           "model's")
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise BadInput(f"{path.parent}: no {what} (expected a Hugging Face checkpoint "
                       "directory)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read {what} {path}: {exc}") from None
    try:
        return json_text.loads(text)
    except ValueError as exc:
        raise BadInput(f"{what} {path} is not valid JSON: {exc}") from None


def read_config_json(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in ``model_dir``/config.json, as written."""
    path = checked_model_dir(model_dir)
    config = read_json(path / CONFIG_FILE, CONFIG_FILE, MAX_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise BadInput(f"config.json in {path} must be a JSON object")
    return config


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's fields: a multimodal config's ``text_config`` (with the keys
    kept at the top), and transformers' defaults for what a published one leaves out."""
    nested = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(nested, dict):
        merged = dict(nested)
        for key in _SHARED_KEYS:
            merged.setdefault(key, config.get(key))
        config = merged
    model_type = config.get("model_type")
    defaults = CONFIG_DEFAULTS.get(model_type, {}) if isinstance(model_type, str) else {}
    return {**defaults, **{k: v for k, v in config.items() if v is not None or k not in defaults}}


def parse_config(config: Mapping[str, Any], architecture: str) -> HFConfig:
    """``config`` (a config.json object) read as ``architecture``, one of
    ``READ_ARCHITECTURES``; BadInput naming the field that is missing or wrong."""
    raw = text_config(config)
    hidden = positive(raw, "hidden_size")
    heads = positive(raw, "num_attention_heads")
    kv_heads = positive(raw, "num_key_value_heads", heads)
    head_dim = _head_dim(raw, architecture, hidden, heads)
    if heads % kv_heads:
        raise BadInput(f"config.json num_attention_heads {heads} is not a multiple of "
                       f"num_key_value_heads {kv_heads}")
    # transformers 5 writes ``dtype``, and reads it before the older ``torch_dtype``.
    dtype = raw.get("dtype") or raw.get("torch_dtype") or ""
    if not isinstance(dtype, str):
        raise BadInput(f"config.json dtype must be a string, got {shown(dtype)}")
    num_layers = positive(raw, "num_hidden_layers")
    if num_layers > MAX_LAYERS:
        raise BadInput(f"config.json 'num_hidden_layers' {num_layers} is more than the "
                       f"{MAX_LAYERS} kvledger plans")
    mla = architecture in MLA_ARCHITECTURES
    if mla:  # a query/key head is the no-RoPE part and the RoPE part
        head_dim = positive(raw, "qk_nope_head_dim") + positive(raw, "qk_rope_head_dim")
    layer_types, window = _layer_types(raw, architecture, num_layers)
    quant = raw.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    return HFConfig(
        architecture=architecture,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=positive(raw, "intermediate_size"),
        vocab_size=positive(raw, "vocab_size"),
        max_position_embeddings=context_length(raw),
        torch_dtype=dtype,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        quantization=method if isinstance(method, str) else "",
        layer_types=layer_types,
        sliding_window=window,
        kv_lora_rank=positive(raw, "kv_lora_rank") if mla else None,
        qk_rope_head_dim=positive(raw, "qk_rope_head_dim") if mla else None,
        raw=raw,
    )


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


def _head_dim(raw: Mapping[str, Any], architecture: str, hidden: int, heads: int) -> int:
    if raw.get("head_dim") is not None:
        return positive(raw, "head_dim")
    if architecture == "Qwen3ForCausalLM" and hidden // heads != QWEN3_HEAD_DIM:
        # Qwen3Config takes 128 where hidden / heads is something else: which one the
        # weights have is anyone's guess, so neither is.
        raise BadInput(f"config.json: Qwen3ForCausalLM without head_dim (transformers takes "
                       f"{QWEN3_HEAD_DIM}, hidden_size / num_attention_heads is "
                       f"{hidden // heads}); set head_dim")
    if hidden % heads:
        raise BadInput(f"config.json hidden_size {hidden} is not divisible by "
                       f"num_attention_heads {heads}, and there is no head_dim")
    return hidden // heads


def _layer_types(raw: Mapping[str, Any], architecture: str,
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
    elif architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        kinds = (SLIDING_ATTENTION,) * num_layers if raw.get("sliding_window") else full
    elif architecture in HYBRID_ARCHITECTURES:
        kinds = _declared(raw, num_layers) if raw.get("layer_types") is not None else \
            _hybrid_pattern(raw, architecture, num_layers)
    else:  # Llama, Gemma, MLA: full attention on every layer
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
