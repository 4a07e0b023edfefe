"""Checkpoints the planner's tests write themselves (tiny Llama-shaped models)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def llama_tensors(config: dict, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", h // heads)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    tensors = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": rand(h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(heads * head_dim, h),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, h),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, h),
            p + "self_attn.o_proj.weight": rand(h, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(i, h),
            p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": rand(h),
            p + "post_attention_layernorm.weight": rand(h),
        }
    if not config.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = rand(v, h)
    return tensors


def write_config(model_dir: Path, **overrides) -> dict:
    config = {**TINY, **overrides}
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    return config


def write_checkpoint(model_dir: Path, *, shards: int = 1, dtype: torch.dtype = torch.bfloat16,
                     **overrides) -> dict[str, torch.Tensor]:
    """config.json + model.safetensors (or N shards and model.safetensors.index.json)."""
    config = write_config(model_dir, **overrides)
    tensors = llama_tensors(config, dtype)
    if shards == 1:
        save_file(tensors, str(model_dir / "model.safetensors"))
        return tensors
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        save_file(part, str(model_dir / shard))
        weight_map |= dict.fromkeys(part, shard)
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def write_raw_safetensors(path: Path, header: dict, data: bytes | int) -> None:
    """A safetensors file from a header dict; ``data`` as bytes, or a length left sparse."""
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        if isinstance(data, bytes):
            f.write(data)
        else:
            f.truncate(8 + len(raw) + data)
