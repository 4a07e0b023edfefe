"""What a checkpoint directory declares: the model's shape (config.json) and the bytes of
its weights (safetensors headers only, see ``safetensors_header``; no tensor data is read).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvledger.engine.errors import BadInput
from kvledger.engine.planner.layout import (
    MLA_ARCHITECTURES,
    AttentionLayout,
    full_layout,
    pick_architecture,
    read_layout,
)
from kvledger.engine.planner.safetensors_header import (  # noqa: F401 - re-exported
    DTYPE_BITS,
    TensorInfo,
    read_safetensors_header,
)

# Floating dtypes an explicit ``--dtype`` casts at load time; the others (quantized
# payloads, scales, integer tensors) are loaded as stored.
CASTABLE_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
INDEX_FILE = "model.safetensors.index.json"
# Names whose tensor is the input embedding an ``lm_head`` is tied to.
EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight",
                      "embeddings.weight")
# transformers' defaults for fields a published config.json leaves out (Gemma 3's
# multimodal checkpoints give only what differs from Gemma3TextConfig).
CONFIG_DEFAULTS = {
    "gemma3_text": {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "head_dim": 256, "max_position_embeddings": 131_072, "sliding_window": 4096},
}


@dataclass(frozen=True)
class ModelSource:
    """Where the planner reads a checkpoint: ``path``, a local directory (for an hf:// model
    a header-only mirror or the hub cache's snapshot, see ``hub_headers``/``hub_cache``), and
    for a hub model the uri it was asked for and the commit it resolved to."""

    path: str
    uri: str | None = None
    commit: str | None = None


@dataclass(frozen=True)
class ModelShape:
    """The numbers of config.json the budget depends on."""

    architecture: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    torch_dtype: str  # config's dtype name, e.g. "bfloat16"; "" when the config has none
    tie_word_embeddings: bool = False
    layout: AttentionLayout | None = None  # None: full attention on every layer
    quantization: str = ""  # config's quantization_config.quant_method, e.g. "mxfp4"

    def kv_layout(self) -> AttentionLayout:
        """What each layer keeps per token (``kv_layout``)."""
        if self.layout is not None:
            return self.layout
        return full_layout(self.num_layers, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class WeightsInfo:
    """The bytes the checkpoint's tensors occupy once loaded, counted once per name."""

    total_bytes: int
    num_tensors: int
    dtype: str  # the dtype holding the most bytes, e.g. "BF16"
    files: tuple[str, ...]
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    # Names stored but not counted: duplicates across shards, an lm_head tied to the embedding.
    skipped: tuple[str, ...] = ()


def _model_dir(model_dir: str | os.PathLike) -> Path:
    path = Path(model_dir)
    if not path.exists():
        raise BadInput(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise BadInput(f"--model {str(path)!r} is not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise BadInput(f"model directory {str(path)!r} is not readable")
    return path


def _read_json(path: Path, what: str) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read {what} {path}: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{what} {path} is not valid JSON: {exc}") from None


def _read_config(model_dir: Path) -> dict:
    config = _read_json(model_dir / "config.json", "config.json")
    if not isinstance(config, dict):
        raise BadInput(f"config.json in {model_dir} must be a JSON object")
    # Multimodal configs nest the language model's numbers under text_config.
    text = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(text, dict):
        merged = dict(text)
        for key in ("architectures", "torch_dtype", "dtype", "tie_word_embeddings",
                    "quantization_config"):
            merged.setdefault(key, config.get(key))
        config = merged
    defaults = CONFIG_DEFAULTS.get(config.get("model_type"), {})
    return {**defaults, **{k: v for k, v in config.items() if v is not None or k not in defaults}}


def _positive(config: dict, key: str, default: object = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise BadInput(f"config.json has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadInput(f"config.json {key!r} must be a positive integer, got {value!r}")
    return value


def read_model_shape(model_dir: str | os.PathLike) -> ModelShape:
    """The shape from ``config.json``; BadInput on a missing, garbled or incomplete file,
    and on an architecture the planner does not model (named, never planned as a Llama)."""
    config = _read_config(_model_dir(model_dir))
    hidden = _positive(config, "hidden_size")
    heads = _positive(config, "num_attention_heads")
    kv_heads = _positive(config, "num_key_value_heads", heads)
    if config.get("head_dim") is None and hidden % heads:
        raise BadInput(f"config.json hidden_size {hidden} is not divisible by "
                       f"num_attention_heads {heads}, and there is no head_dim")
    head_dim = _positive(config, "head_dim", hidden // heads)
    if heads % kv_heads:
        raise BadInput(f"config.json num_attention_heads {heads} is not a multiple of "
                       f"num_key_value_heads {kv_heads}")
    dtype = config.get("torch_dtype") or config.get("dtype") or ""
    if not isinstance(dtype, str):
        raise BadInput(f"config.json torch_dtype must be a string, got {dtype!r}")
    num_layers = _positive(config, "num_hidden_layers")
    arch = pick_architecture(config)
    if arch in MLA_ARCHITECTURES:  # a query/key head is the no-RoPE part and the RoPE part
        head_dim = _positive(config, "qk_nope_head_dim") + _positive(config, "qk_rope_head_dim")
    quant = config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    return ModelShape(
        architecture=arch,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=_positive(config, "intermediate_size", 4 * hidden),
        vocab_size=_positive(config, "vocab_size"),
        max_position_embeddings=_positive(config, "max_position_embeddings"),
        torch_dtype=dtype,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        layout=read_layout(config, arch, num_layers, kv_heads, head_dim),
        quantization=method if isinstance(method, str) else "",
    )


def _shard_files(model_dir: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The files to read, and the index's weight_map when the checkpoint has one."""
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        index = _read_json(index_path, INDEX_FILE)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if (not isinstance(weight_map, dict) or not weight_map
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())):
            raise BadInput(f"{index_path}: needs a non-empty \"weight_map\" of tensor name -> "
                           "shard file")
        shards = []
        for name in dict.fromkeys(weight_map.values()):
            shard = model_dir / name
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise BadInput(f"{index_path}: shard {name!r} is outside the model directory")
            shards.append(shard)
        return shards, weight_map
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.pt"))
        hint = f" (found {', '.join(others[:3])}: only safetensors is supported)" if others else ""
        raise BadInput(f"no *.safetensors weights in {model_dir}{hint}")
    return files, None


def read_weights(model_dir: str | os.PathLike) -> WeightsInfo:
    """Weight bytes of a single-file or sharded checkpoint, from headers only.

    Each tensor name is counted once: the shard the index maps it to wins over a copy
    in another shard, and an ``lm_head.weight`` stored beside the embedding it is tied
    to (``tie_word_embeddings``) is not counted, as the engine shares one tensor.
    """
    path = _model_dir(model_dir)
    files, weight_map = _shard_files(path)
    chosen: dict[str, TensorInfo] = {}
    skipped: list[str] = []
    owners = weight_map or {}
    for shard in files:
        shard_name = shard.name
        if weight_map is not None and not shard.is_file():
            raise BadInput(f"{path / INDEX_FILE} names shard {shard_name!r}, which is missing")
        for tensor in read_safetensors_header(shard):
            owner = owners.get(tensor.name, shard_name)
            if owner != shard_name or tensor.name in chosen:
                skipped.append(f"{shard_name}:{tensor.name}")
                continue
            chosen[tensor.name] = tensor
    if weight_map:
        missing = [n for n in weight_map if n not in chosen]
        if missing:
            raise BadInput(f"{path / INDEX_FILE} maps {missing[0]!r} to "
                           f"{weight_map[missing[0]]!r}, which does not contain it")
    if _tied(path) and "lm_head.weight" in chosen:
        lm_head = chosen["lm_head.weight"]
        if any(n.endswith(EMBEDDING_SUFFIXES) and t.shape == lm_head.shape
               for n, t in chosen.items() if n != "lm_head.weight"):
            skipped.append("lm_head.weight (tied to the embedding)")
            del chosen["lm_head.weight"]
    by_dtype: Counter[str] = Counter()
    for tensor in chosen.values():
        by_dtype[tensor.dtype] += tensor.nbytes
    dominant = max(by_dtype, key=lambda d: by_dtype[d]) if by_dtype else "F32"
    return WeightsInfo(
        total_bytes=sum(by_dtype.values()),
        num_tensors=len(chosen),
        dtype=dominant,
        files=tuple(str(f) for f in files),
        bytes_by_dtype=dict(by_dtype),
        skipped=tuple(skipped),
    )


def _tied(model_dir: Path) -> bool:
    try:
        config = _read_config(model_dir)
    except BadInput:
        return False
    return bool(config.get("tie_word_embeddings", False))
