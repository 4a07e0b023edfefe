"""Checkpoints the planner's tests write themselves: tiny Llama-shaped models with data,
and header-only checkpoints of any shape (``write_header_only``)."""

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


def llama_shapes(config: dict) -> dict[str, list[int]]:
    """The shape of every tensor of a Llama checkpoint with this config, in file order."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", h // heads)
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": [heads * head_dim, h],
            p + "self_attn.k_proj.weight": [kv_heads * head_dim, h],
            p + "self_attn.v_proj.weight": [kv_heads * head_dim, h],
            p + "self_attn.o_proj.weight": [h, heads * head_dim],
            p + "mlp.gate_proj.weight": [i, h],
            p + "mlp.up_proj.weight": [i, h],
            p + "mlp.down_proj.weight": [h, i],
            p + "input_layernorm.weight": [h],
            p + "post_attention_layernorm.weight": [h],
        }
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = [v, h]
    return shapes


def llama_tensors(config: dict, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(*shape, generator=gen).to(dtype)
            for name, shape in llama_shapes(config).items()}


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


# Bytes per element of the dtypes published checkpoints use (MXFP4 is stored as U8 blocks
# and U8 scales, DeepSeek's fp8 as F8_E4M3 with F32 scales).
ELEMENT_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1, "F8_E4M3": 1, "I32": 4,
                 "I64": 8}


def tensor_bytes(dtype: str, shape: list[int]) -> int:
    n = ELEMENT_BYTES[dtype]
    for d in shape:
        n *= d
    return n


def write_header_only(model_dir: Path, config: dict,
                      tensors: dict[str, tuple[str, list[int]]], *, shards: int = 1) -> int:
    """config.json as given and the tensors' safetensors headers, the data left sparse (a
    hole), in ``shards`` files with an index when more than one; returns the tensor bytes."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    names = list(tensors)
    per_shard = -(-len(names) // shards)
    weight_map, total = {}, 0
    for k in range(shards):
        shard = "model.safetensors" if shards == 1 else f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {}, 0
        for name in names[k * per_shard:(k + 1) * per_shard]:
            dtype, shape = tensors[name]
            nbytes = tensor_bytes(dtype, shape)
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = shard
        write_raw_safetensors(model_dir / shard, header, offset)
        total += offset
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


# How each method stores one linear layer's weight [out, inp] (group size 32 where it has one):
# the tensors that replace LAYER.weight, as the method's published checkpoints name them.
_GROUP = 32
QUANTIZED_LINEAR = {
    # llm-compressor's / vLLM's fp8: fp8 values with per-tensor weight and input scales.
    "fp8": lambda out, inp: {"weight": ("F8_E4M3", [out, inp]), "weight_scale": ("F32", []),
                             "input_scale": ("F32", [])},
    # AutoGPTQ: int4 packed eight to an int32 along the input, per-group zeros and scales.
    "gptq": lambda out, inp: {"qweight": ("I32", [inp // 8, out]),
                              "qzeros": ("I32", [inp // _GROUP, out // 8]),
                              "scales": ("F16", [inp // _GROUP, out]), "g_idx": ("I32", [inp])},
    # AutoAWQ: int4 packed along the output.
    "awq": lambda out, inp: {"qweight": ("I32", [inp, out // 8]),
                             "qzeros": ("I32", [inp // _GROUP, out // 8]),
                             "scales": ("F16", [inp // _GROUP, out])},
    # bitsandbytes nf4: two values a byte, the quantization state beside the weight.
    "bitsandbytes": lambda out, inp: {
        "weight": ("U8", [out * inp // 2, 1]), "weight.absmax": ("F32", [out * inp // 64]),
        "weight.quant_map": ("F32", [16]), "weight.quant_state.bitsandbytes__nf4": ("U8", [84])},
    # MXFP4: blocks of 32 four-bit values (16 bytes) and one U8 scale a block.
    "mxfp4": lambda out, inp: {"weight_blocks": ("U8", [out, inp // 32, 16]),
                               "weight_scales": ("U8", [out, inp // 32])},
    # compressed-tensors' pack-quantized int4.
    "compressed-tensors": lambda out, inp: {"weight_packed": ("I32", [out, inp // 8]),
                                            "weight_scale": ("BF16", [out, inp // _GROUP]),
                                            "weight_shape": ("I64", [2])},
}


# The quantization_configs published 4-bit checkpoints carry (group size 32 here).
PUBLISHED_4BIT = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": _GROUP, "desc_act": True,
             "sym": True, "checkpoint_format": "gptq", "lm_head": False},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": _GROUP, "zero_point": True,
            "version": "gemm"},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                               "num_bits": 4, "type": "int", "symmetric": True,
                               "strategy": "group", "group_size": _GROUP, "actorder": None},
                               "input_activations": None}}, "ignore": ["lm_head"]},
}


def write_quantized(model_dir: Path, method: str, *, quantization_config: bool | dict = True,
                    **overrides) -> dict:
    """A tiny Llama checkpoint (header only) whose linear layers are stored as ``method``
    stores them (``QUANTIZED_LINEAR``), with ``quantization_config.quant_method`` =
    ``method`` (a dict: that quantization_config) unless ``quantization_config`` is False
    (scales with nothing to say so)."""
    config = {**TINY, **overrides}
    if isinstance(quantization_config, dict):
        config["quantization_config"] = quantization_config
    elif quantization_config:
        config["quantization_config"] = {"quant_method": method}
    tensors: dict[str, tuple[str, list[int]]] = {}
    for name, shape in llama_shapes(config).items():
        layer = name.removesuffix(".weight")
        if layer.endswith("_proj") and method in QUANTIZED_LINEAR:
            parts = QUANTIZED_LINEAR[method](*shape)
            tensors |= {f"{layer}.{part}": spec for part, spec in parts.items()}
        else:
            tensors[name] = ("BF16", shape)
    write_header_only(model_dir, config, tensors)
    return config
