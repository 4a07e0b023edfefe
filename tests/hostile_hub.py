"""Hub repos built to cost whoever reads them, for tests/hub_server.py to serve: the
webhook's and the pre-flight's tests and bench/hostile_cluster.py use them.

Each is a sparse checkpoint (a shard is its safetensors header, the tensor data a hole),
so a repo that claims hundreds of MB of headers costs the disk only those headers once:
the shards of ``write_heavy_repo`` are hard links to one file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

# A small Llama: config.json is read whole, so it must be a real one.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
          "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def shard_name(k: int, shards: int) -> str:
    return f"model-{k + 1:05d}-of-{shards:05d}.safetensors"


def tiny_tensors(names: list[str]) -> bytes:
    """A safetensors header of one-byte U8 tensors named ``names``, padded to 8 bytes."""
    parts = [f'"{name}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}'
             for i, name in enumerate(names)]
    raw = ("{" + ",".join(parts) + "}").encode()
    return raw + b" " * (-len(raw) % 8)


def write_shard(path: Path, header: bytes, data_bytes: int) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + data_bytes)  # sparse: the data is a hole


def write_heavy_repo(folder: Path, *, shards: int = 6, header_bytes: int = 95_000_000) -> Path:
    """An index naming ``shards`` shards, each a header of about ``header_bytes`` of
    one-byte tensors (the same names in each: one file, hard-linked)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    typical = 500_000  # most entries have six or seven digits
    per_entry = len(f'"t{typical}":{{"dtype":"U8","shape":[1],"data_offsets":[{typical},{typical}]}},')
    count = header_bytes // per_entry
    names = [f"t{i}" for i in range(count)]
    first = folder / shard_name(0, shards)
    write_shard(first, tiny_tensors(names), count)
    for k in range(1, shards):
        os.link(first, folder / shard_name(k, shards))
    weight_map = {f"t{k}": shard_name(k, shards) for k in range(shards)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


# A Qwen3 mixture of experts as the engine loads it, as small as it goes but for its
# number of experts and layers, which set how many tensors it has.
MOE_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 256, "max_position_embeddings": 512, "num_experts_per_tok": 2,
              "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


def write_moe_repo(folder: Path, *, layers: int, experts: int, shards: int = 8) -> Path:
    """A Qwen3-MoE checkpoint the engine could load (every tensor one it loads, in its
    shape, BF16, the data a hole) with ``layers`` x ``experts``: 84 x 512 is 129,699 tensors in
    ~25 MiB of index and headers, more than any published model's (Kimi K2, ~140,000
    tensors in 30 MiB, is DeepSeek's architecture, which the engine does not run)."""
    from kvledger.engine.checkpoint.model_config import ModelConfig
    from kvledger.engine.checkpoint.tensor_shapes import float_shapes

    config = dict(MOE_CONFIG, num_hidden_layers=layers, num_experts=experts)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    shapes = float_shapes(ModelConfig.from_dict(config))
    names = sorted(shapes)
    weight_map = {}
    per_shard = -(-len(names) // shards)
    for k in range(shards):
        part, entries, offset = names[k * per_shard:(k + 1) * per_shard], [], 0
        for name in part:
            size = 2 * math.prod(shapes[name])
            entries.append(f'"{name}":{{"dtype":"BF16","shape":{list(shapes[name])},'
                           f'"data_offsets":[{offset},{offset + size}]}}')
            offset += size
        header = ("{" + ",".join(entries) + "}").encode()
        write_shard(folder / shard_name(k, shards), header + b" " * (-len(header) % 8), offset)
        weight_map |= dict.fromkeys(part, shard_name(k, shards))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def repo_bytes(folder: Path) -> tuple[int, int]:
    """What a header-only read of the repo takes: (config, index and headers bytes, shards)."""
    total, shards = 0, 0
    for path in folder.iterdir():
        if path.suffix == ".safetensors":
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
            total += 8 + length
            shards += 1
        else:
            total += path.stat().st_size
    return total, shards
