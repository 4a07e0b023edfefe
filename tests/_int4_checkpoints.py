"""4-bit checkpoints written from a built-in model as AutoGPTQ, AutoAWQ and llm-compressor
(compressed-tensors ``pack-quantized``) store them, and the float32 checkpoint of the same
weights dequantized (the reference's).

Independent of the engine's code: each weight is quantized here to integer codes, zeros
and scales; the packed checkpoint is written from them by straightforward loops that
follow each format's definition, and the reference's weights are ``(code - zero) *
scale`` from the same integers (never unpacked). So the engine, reading the packed
tensors, must undo exactly this packing to match.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvledger.engine.checkpoint.fp8_format import quantized_linear

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's: nibble k holds output 8c + order[k]


def quantize_groups(weight: torch.Tensor, group_of_input: torch.Tensor, groups: int, *,
                    sym: bool, scale_dtype: torch.dtype, min_zero: int = 0):
    """``weight`` [out, in] -> (codes [out, in] 0..15, zeros [groups, out] 0..15, scales
    [groups, out] in ``scale_dtype``), per group of inputs. Symmetric: zero 8. ``min_zero``
    1 keeps zeros GPTQ's v1 format can store (it stores zero - 1)."""
    out_features = weight.shape[0]
    zeros = torch.zeros(groups, out_features, dtype=torch.int64)
    scales = torch.zeros(groups, out_features, dtype=scale_dtype)
    for g in range(groups):
        block = weight[:, group_of_input == g]
        if sym:
            scale, zero = block.abs().amax(dim=1) / 7, torch.full((out_features,), 8)
        else:
            low, high = block.amin(dim=1).clamp(max=0), block.amax(dim=1).clamp(min=0)
            scale = (high - low) / 15
            zero = torch.round(-low / scale.clamp(min=1e-8)).long().clamp(min_zero, 15)
        scales[g] = scale.clamp(min=1e-6).to(scale_dtype)
        zeros[g] = zero
    s, z = scales.float()[group_of_input].t(), zeros[group_of_input].t()
    codes = (torch.round(weight / s) + z).clamp(0, 15).long()
    return codes, zeros, scales


def pack(codes: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit codes a little-endian int32 word along ``dim``: nibble ``k`` of word
    ``w`` holds the code at ``8w + order[k]``."""
    codes = codes if dim == 0 else codes.t()
    words = torch.zeros(codes.shape[0] // 8, codes.shape[1], dtype=torch.int64)
    for w in range(words.shape[0]):
        for k in range(8):
            words[w] |= codes[8 * w + order[k]] << (4 * k)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words if dim == 0 else words.t().contiguous()


def quantize_layer(weight: torch.Tensor, method: str, *, sym: bool, group_size: int,
                   desc_act: bool, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One linear layer's stored tensors in ``method``, and its dequantized weight."""
    out_features, in_features = weight.shape
    size = in_features if group_size == -1 else group_size
    groups = in_features // size
    group_of_input = torch.arange(in_features) // size
    if desc_act:  # act-order: the inputs grouped in another order, told by g_idx
        order = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
        group_of_input = torch.empty(in_features, dtype=torch.long)
        group_of_input[order] = torch.arange(in_features) // size
    scale_dtype = torch.bfloat16 if method == "compressed-tensors" else torch.float16
    codes, zeros, scales = quantize_groups(weight, group_of_input, groups, sym=sym,
                                           scale_dtype=scale_dtype,
                                           min_zero=1 if method == "gptq" else 0)
    dequantized = (codes - zeros[group_of_input].t()).float() * scales.float()[group_of_input].t()
    if method == "gptq":  # [in / 8, out]; zeros stored minus one (v1)
        stored = {"qweight": pack(codes.t(), 0), "qzeros": pack(zeros - 1, 1), "scales": scales,
                  "g_idx": group_of_input.to(torch.int32)}
    elif method == "awq":  # [in, out / 8] in AWQ's order
        stored = {"qweight": pack(codes.t(), 1, AWQ_PACK_ORDER),
                  "qzeros": pack(zeros, 1, AWQ_PACK_ORDER), "scales": scales}
    else:  # compressed-tensors: [out, in / 8]; signed codes and zeros stored + 8
        stored = {"weight_packed": pack(codes, 1), "weight_scale": scales.t().contiguous(),
                  "weight_shape": torch.tensor([out_features, in_features])}
        if not sym:
            stored["weight_zero_point"] = pack(zeros.t(), 0)
    return stored, dequantized


def write_int4(source: Path, out: Path, method: str, *, sym: bool = False, group_size: int = 32,
               desc_act: bool = False) -> tuple[Path, Path]:
    """``(quantized_dir, dequantized_dir)``: ``source``'s linear layers in ``method``
    ("gptq", "awq", "compressed-tensors"), the rest as they are."""
    q_dir, plain_dir = out / method, out / f"{method}-dequantized"
    for folder in (q_dir, plain_dir):
        shutil.copytree(source, folder)
    tensors = load_file(str(source / "model.safetensors"))
    quantized, dequantized = {}, {}
    for index, (name, tensor) in enumerate(sorted(tensors.items())):
        if not quantized_linear(name):
            quantized[name] = dequantized[name] = tensor
            continue
        stored, dequantized[name] = quantize_layer(tensor.float(), method, sym=sym,
                                                   group_size=group_size, desc_act=desc_act,
                                                   seed=index)
        prefix = name.removesuffix("weight")
        quantized |= {prefix + part: t for part, t in stored.items()}
    save_file(quantized, str(q_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(plain_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, sym, group_size, desc_act)
    (q_dir / "config.json").write_text(json.dumps(config))
    return q_dir, plain_dir


def quantization_config(method: str, sym: bool, group_size: int, desc_act: bool) -> dict:
    """config.json's ``quantization_config`` as each library writes it."""
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": sym,
                "desc_act": desc_act, "damp_percent": 0.01, "true_sequential": True,
                "checkpoint_format": "gptq", "lm_head": False}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "dynamic": False,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size, "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "quantization_status": "compressed"}
