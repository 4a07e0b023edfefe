"""FP8 checkpoints written from a built-in model, as AutoFP8 / llm-compressor write them,
and the float32 checkpoint of the same weights dequantized (the reference's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvledger.engine.checkpoint.fp8_format import quantized_linear

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
# The static input scale every quantized layer gets: 448 * 0.02 = 8.96, above most of a
# tiny model's activations, so few are clamped, but each is rounded to e4m3.
STATIC_INPUT_SCALE = 0.02


def write_fp8(source: Path, out: Path, *, per_channel: bool, static: bool,
              method: str = "fp8") -> tuple[Path, Path]:
    """``(fp8_dir, dequantized_dir)``: ``source``'s linear layers in float8_e4m3fn with a
    weight_scale per tensor (``[]``) or per channel (``[out, 1]``), an ``input_scale`` per
    layer when ``static``; its other tensors as they are. ``method`` "fp8" writes vLLM's
    quantization_config, "compressed-tensors" llm-compressor's float-quantized one."""
    fp8_dir, plain_dir = out / "fp8", out / "dequantized"
    for folder in (fp8_dir, plain_dir):
        shutil.copytree(source, folder)
    tensors = load_file(str(source / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if not quantized_linear(name):
            quantized[name] = dequantized[name] = tensor
            continue
        amax = tensor.abs().amax(dim=1, keepdim=True) if per_channel else tensor.abs().amax()
        scale = (amax / E4M3_MAX).float()
        weight = (tensor / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        prefix = name.removesuffix("weight")
        quantized |= {name: weight, prefix + "weight_scale": scale}
        if static:
            quantized[prefix + "input_scale"] = torch.tensor(STATIC_INPUT_SCALE)
        dequantized[name] = weight.float() * scale
    save_file(quantized, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(plain_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = _quantization_config(method, per_channel, static)
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, plain_dir


def _quantization_config(method: str, per_channel: bool, static: bool) -> dict:
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
                "ignored_layers": ["lm_head"]}
    activations = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                    "symmetric": True} if static else
                   {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                    "symmetric": True})
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "channel" if per_channel else "tensor"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}},
            "ignore": ["lm_head"]}
