"""What a checkpoint directory declares: the model's shape (config.json, read by
``hf_config`` as the engine reads it) and the bytes of its weights (safetensors headers
only, see ``safetensors_header``; no tensor data is read).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvledger.engine.checkpoint.files import INDEX_FILE, shard_name, unindexed_weights
from kvledger.engine.checkpoint.gemma_config import language_model_name, pick_text_only
from kvledger.engine.checkpoint.hf_config import (
    HFConfig,
    checked_model_dir,
    parse_config,
    read_config_json,
    text_config,
)
from kvledger.engine.checkpoint.layout import (
    AttentionLayout,
    full_layout,
    pick_architecture,
    read_layout,
)
from kvledger.engine.checkpoint.moe_config import MoEConfig, read_moe
from kvledger.engine.checkpoint.read_limits import ReadBudget, ReadLimits
from kvledger.engine.checkpoint.safetensors_header import (  # noqa: F401 - re-exported
    DTYPE_BITS,
    TensorInfo,
    read_safetensors_header,
)
from kvledger.engine.checkpoint.shard_index import read_shard_index
from kvledger.engine.errors import BadInput, shown

# Floating dtypes an explicit ``--dtype`` casts at load time; the others (quantized
# payloads, scales, integer tensors) are loaded as stored.
CASTABLE_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
# Names whose tensor is the input embedding an ``lm_head`` is tied to.
EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight",
                      "embeddings.weight")


@dataclass(frozen=True)
class ModelSource:
    """Where the planner reads a checkpoint: ``path``, a local directory (for an hf:// model
    a header-only mirror or the hub cache's snapshot, see ``hub_headers``/``hub_cache``), and
    for a hub model the uri it was asked for and the commit it resolved to."""

    path: str
    uri: str | None = None
    commit: str | None = None
    headers_only: bool = False  # a header mirror: the weights' bytes are holes, not data


@dataclass(frozen=True)
class ModelShape:
    """The numbers of config.json the budget depends on: THE record of a model's shape.
    The engine's ``ModelConfig`` (model_config.py) is this record plus what its layers
    need; both are filled from one reading of config.json (``shape_fields``)."""

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
    moe: MoEConfig | None = None  # routed experts (those the engine runs); None: dense
    # The context a run gets without --max-model-len where vLLM's default is less than
    # max_position_embeddings (a longrope model's original_max_position_embeddings).
    default_context: int | None = None

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
    # The tensors counted (name, dtype, shape), for the check that the engine can load them.
    tensors: tuple[TensorInfo, ...] = ()


def model_shape(config: Mapping[str, Any]) -> ModelShape:
    """The shape of a config.json object, read as the first architecture the planner
    models (``hf_config.parse_config``); BadInput on one it does not (named, never
    planned as a Llama) and on a missing or bad field."""
    return ModelShape(**shape_fields(parse_config(config, pick_architecture(config))))


def shape_fields(read: HFConfig) -> dict[str, Any]:
    """``ModelShape``'s fields from one reading of config.json (``hf_config.parse_config``):
    each as read, the layout worked out from the layer types, the experts from their fields."""
    named = {f.name for f in fields(ModelShape)} - {"layout", "moe"}
    return {**{name: getattr(read, name) for name in named}, "layout": read_layout(read),
            "moe": read_moe(read)}


def read_model_shape(model_dir: str | os.PathLike) -> ModelShape:
    """The shape from ``model_dir``'s config.json; BadInput on a missing, garbled or
    incomplete file (see ``model_shape``)."""
    return model_shape(read_config_json(model_dir))


def _shard_files(model_dir: Path, budget: ReadBudget) -> tuple[list[Path], dict[str, str] | None]:
    """The files to read, and the index's weight_map when the checkpoint has one."""
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        try:
            with open(index_path, "rb") as f:
                index = read_shard_index(f.read, str(index_path), budget, owners=True)
        except OSError as exc:
            raise BadInput(f"cannot read {INDEX_FILE} {index_path}: "
                           f"{exc.strerror or exc}") from None
        shards = [model_dir / shard_name(name, str(index_path)) for name in index.shards]
        return shards, index.owners
    files = [model_dir / name for name in unindexed_weights(
        p.name for p in model_dir.iterdir())]
    if not files:
        others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.pt"))
        hint = f" (found {', '.join(others[:3])}: only safetensors is supported)" if others else ""
        raise BadInput(f"no *.safetensors weights in {model_dir}{hint}")
    return files, None


def read_weights(model_dir: str | os.PathLike, limits: ReadLimits | None = None) -> WeightsInfo:
    """Weight bytes of a single-file or sharded checkpoint, from headers only, within
    ``limits`` (kvledger's own when None: OverLimit past them).

    Each tensor name is counted once: the shard the index maps it to wins over a copy
    in another shard, and an ``lm_head.weight`` stored beside the embedding it is tied
    to (``tie_word_embeddings``) is not counted, as the engine shares one tensor. A
    multimodal checkpoint the engine serves as text (Gemma 3's) counts its language model
    alone, by the engine's names (``gemma_config.language_model_name``): the vision tower
    and projector are not loaded.
    """
    path = checked_model_dir(model_dir)
    budget = ReadBudget(limits or ReadLimits(), str(path))
    files, weight_map = _shard_files(path, budget)
    budget.check_shards(len(files))
    chosen: dict[str, TensorInfo] = {}
    skipped: list[str] = []
    owners = weight_map or {}
    for shard in files:
        stored_in = shard.name
        if weight_map is not None and not os.path.isfile(shard):  # False, never OSError
            raise BadInput(f"{path / INDEX_FILE} names shard {shown(stored_in)}, which is "
                           "missing")
        for tensor in read_safetensors_header(shard, budget):
            owner = owners.get(tensor.name, stored_in)
            if owner != stored_in or tensor.name in chosen:
                skipped.append(f"{stored_in}:{tensor.name}")
                continue
            chosen[tensor.name] = tensor
    if weight_map:
        missing = [n for n in weight_map if n not in chosen]
        if missing:
            raise BadInput(f"{path / INDEX_FILE} maps {missing[0]!r} to "
                           f"{weight_map[missing[0]]!r}, which does not contain it")
    config = _text_config(path)
    served_as = pick_text_only(config)
    if served_as is not None:
        renamed: dict[str, TensorInfo] = {}
        for name, tensor in chosen.items():
            engine_name = language_model_name(name, served_as)
            if engine_name is None:
                skipped.append(f"{name} (not loaded: {served_as} is served as text)")
            else:
                renamed[engine_name] = tensor._replace(name=engine_name)
        chosen = renamed
    if config.get("tie_word_embeddings") and "lm_head.weight" in chosen:
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
        tensors=tuple(chosen.values()),
    )


def _text_config(model_dir: Path) -> dict[str, Any]:
    """The language model's config.json fields, {} when it cannot be read (the shape's
    reading says why)."""
    try:
        return text_config(read_config_json(model_dir))
    except BadInput:
        return {}
