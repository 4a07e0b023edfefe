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
from kvledger.engine.checkpoint.config_numbers import context_length, default_context, positive
from kvledger.engine.checkpoint.files import CONFIG_FILE
from kvledger.engine.checkpoint.layer_kinds import MLA_ARCHITECTURES, layer_types
from kvledger.engine.checkpoint.read_limits import MAX_CONFIG_BYTES
from kvledger.engine.errors import BadInput, shown

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
QWEN3_HEAD_DIM = 128  # Qwen3Config's default
# No model is near this deep; past it a layer count only costs the planner time and
# memory (a tuple per layer, a tensor name per layer and expert).
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
    # The context vLLM runs without --max-model-len where it is less (``default_context``).
    default_context: int | None = None
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
    kinds, window = layer_types(raw, architecture, num_layers)
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
        max_position_embeddings=(positions := context_length(raw)),
        torch_dtype=dtype,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        quantization=method if isinstance(method, str) else "",
        layer_types=kinds,
        sliding_window=window,
        kv_lora_rank=positive(raw, "kv_lora_rank") if mla else None,
        qk_rope_head_dim=positive(raw, "qk_rope_head_dim") if mla else None,
        default_context=default_context(raw, positions),
        raw=raw,
    )


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
