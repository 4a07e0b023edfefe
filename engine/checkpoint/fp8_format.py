"""FP8 weights as kvledger's engine serves them, told without torch (the planner reads
this too): which quantization_configs are FP8 it serves, which tensors are a quantized
linear layer's, and the bytes each one takes in the engine.

Served: ``quant_method: fp8`` (vLLM's and AutoFP8's format: float8_e4m3fn weights, a
``weight_scale`` per tensor or per output channel, an ``input_scale`` per tensor when the
activations are static, none when dynamic) and llm-compressor's ``compressed-tensors``
``float-quantized`` FP8, which stores the same tensors under the same names. Which layers
are quantized is read from the tensors (a ``weight_scale`` beside the weight), so a
config's ``ignored_layers`` / ``ignore`` need no reading. ``--quantization fp8`` quantizes
the same layers of an unquantized checkpoint on load (``quantized_on_load``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvledger.engine.errors import BadInput, clip

FP8 = "fp8"
FP8_DTYPE = "F8_E4M3"  # safetensors' name of torch.float8_e4m3fn
SCALE_SUFFIXES = (".weight_scale", ".input_scale")
SCALE_BYTES = 4  # scales are held in float32 whatever dtype they are stored in
# A layer's KV cache scales (kv_cache_scheme; vLLM's names), read as numbers, not tensors.
KV_SCALE_SUFFIXES = (".self_attn.k_scale", ".self_attn.v_scale")
# The linear layers of a decoder layer that FP8 quantizes: attention, the MLP and each
# expert; never the embeddings, the LM head, the norms or a mixture's router (vLLM's too).
QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj", "w1", "w2", "w3")
# transformers 5's fused experts, quantized on load like the experts they are split into.
_FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
# What the engine's weights may be, said wherever a checkpoint is refused for its weights.
SERVED_WEIGHTS = ("kvledger's engine serves unquantized float16/bfloat16/float32 checkpoints, "
                  "FP8 ones (quant_method 'fp8', or 'compressed-tensors' float-quantized: "
                  "e4m3 weights, per-tensor or per-channel scales) and 4-bit ones ('gptq', "
                  "'awq' gemm, 'compressed-tensors' pack-quantized W4A16)")


def fp8_method(quant: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's ``quantization_config`` is FP8 the engine serves. False for
    another method (the caller refuses it by name); BadInput for an FP8 variant it does
    not serve (block-wise scales, e5m2, a quantized KV cache), naming what."""
    method = quant.get("quant_method")
    if method == FP8:
        if quant.get("weight_block_size"):
            _refuse(f"block-wise weight scales (weight_block_size "
                    f"{quant['weight_block_size']})")
        if quant.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            _refuse(f"activation_scheme {quant['activation_scheme']!r}")
        if quant.get("fmt", "e4m3") != "e4m3":
            _refuse(f"fmt {quant['fmt']!r} (only e4m3)")
        return True
    if method != "compressed-tensors" or quant.get("format") != "float-quantized":
        return False
    check_kv_cache_scheme(quant)
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        _refuse("no config_groups")
    for name, group in groups.items():
        _check_group(name, group)
    return True


def check_kv_cache_scheme(quant: Mapping[str, Any]) -> None:
    """A ``kv_cache_scheme``, served as ``--kv-cache-dtype fp8`` with the checkpoint's
    ``k_scale`` / ``v_scale`` (``KV_SCALE_SUFFIXES``): compressed-tensors' FP8 per tensor,
    static, or AutoFP8's "static". BadInput naming any other (int8, per head, dynamic)."""
    scheme = quant.get("kv_cache_scheme")
    if not scheme or scheme == "static":
        return
    if (isinstance(scheme, dict) and scheme.get("num_bits") == 8
            and scheme.get("type") == "float" and scheme.get("strategy", "tensor") == "tensor"
            and not scheme.get("dynamic") and scheme.get("symmetric", True)):
        return
    _refuse(f"kv_cache_scheme {scheme!r} (FP8 per tensor, static scales only)")


def _check_group(name: str, group: Any) -> None:
    """One compressed-tensors scheme: 8-bit float weights per tensor or channel;
    activations none, dynamic (per token or tensor) or static per tensor."""
    weights = group.get("weights") if isinstance(group, dict) else None
    if not _is_fp8(weights) or weights.get("strategy") not in ("tensor", "channel"):
        _refuse(f"config_groups.{name}.weights {weights!r} (FP8 per tensor or channel only)")
    acts = group.get("input_activations")
    if acts is None:
        return
    static_per_tensor = acts.get("strategy") == "tensor" if isinstance(acts, dict) else False
    if not _is_fp8(acts) or not (acts.get("dynamic") or static_per_tensor):
        _refuse(f"config_groups.{name}.input_activations {acts!r} (FP8, dynamic or static "
                "per tensor only)")


def _is_fp8(args: Any) -> bool:
    return (isinstance(args, dict) and args.get("num_bits") == 8 and args.get("type") == "float"
            and args.get("symmetric", True) and not args.get("group_size"))


def _refuse(what: str) -> None:
    raise BadInput(f"checkpoint's FP8 quantization has {clip(what)}; {SERVED_WEIGHTS}")


def quantized_linear(name: str) -> bool:
    """Whether ``name`` is the weight of a linear layer FP8 quantizes (a decoder layer's
    projection or expert, as the engine names it)."""
    if not name.startswith("model.layers.") or not name.endswith(".weight"):
        return False
    return name.removesuffix(".weight").rsplit(".", 1)[-1] in QUANTIZED_PROJECTIONS


def quantized_on_load(name: str) -> bool:
    """Whether ``--quantization fp8`` quantizes the stored tensor ``name``: a linear layer's
    weight, or fused experts (quantized per expert, as they are split)."""
    return quantized_linear(name) or (name.startswith("model.layers.") and name.endswith(_FUSED))


def on_load_bytes(shape: tuple[int, ...]) -> int:
    """What ``--quantization fp8`` holds for a stored weight of ``shape``: one byte a weight,
    and a float32 scale for each output channel (every row of the last dimension)."""
    numel = 1
    for size in shape:
        numel *= size
    return numel + SCALE_BYTES * (numel // shape[-1])
