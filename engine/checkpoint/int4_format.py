"""4-bit weight-only checkpoints as kvledger's engine serves them, told without torch (the
planner reads this too): which quantization_configs they are, which tensors hold a
quantized linear layer, and what the engine keeps of them (all of it, as stored).

Served, each 4-bit integer codes with a scale per group of inputs (``group_size``; -1 or
a channel strategy: one group over every input) and a zero point:

- ``gptq`` (AutoGPTQ / GPTQModel, ``checkpoint_format`` gptq): ``qweight`` int32
  ``[in / 8, out]``, eight inputs a word (nibble ``k`` of row ``r`` is input ``8r + k``);
  ``qzeros`` int32 ``[groups, out / 8]`` along outputs, each stored as zero - 1 (the v1
  convention: read back + 1, so a stored 15 reads 16, as vLLM's kernels read it);
  ``scales`` ``[groups, out]``; ``g_idx`` int32 ``[in]``, each input's group (``desc_act``
  true permutes it; false stores ``i // group_size``, or nothing). ``sym`` true stores
  zeros of 8.
- ``awq`` (AutoAWQ, ``version: gemm``): ``qweight`` int32 ``[in, out / 8]`` along outputs,
  in AWQ's interleaved nibble order (nibble ``k`` holds output ``8c + AWQ_ORDER[k]``);
  ``qzeros`` the same way over ``[groups, out / 8]``; ``scales`` ``[groups, out]``.
- ``compressed-tensors`` ``pack-quantized`` W4A16 (llm-compressor): ``weight_packed``
  int32 ``[out, in / 8]`` along inputs, each code stored + 8 (signed -8..7 as 0..15);
  ``weight_scale`` ``[out, groups]``; ``weight_shape`` ``[2]``; asymmetric schemes add
  ``weight_zero_point`` int32 ``[out / 8, groups]`` packed along outputs the same way.

A layer's weight is ``(code - zero) * scale`` of its group. Which layers are quantized is
read from the tensors (a ``qweight`` / ``weight_packed`` beside no ``weight``), so a config's
``modules_to_not_convert`` / ``ignore`` need no reading.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvledger.engine.checkpoint.fp8_format import check_kv_cache_scheme
from kvledger.engine.errors import BadInput, clip

GPTQ, AWQ, W4A16 = "gptq", "awq", "w4a16"  # ModelConfig.quantization's names
INT4_METHODS = (GPTQ, AWQ, W4A16)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # which output of its eight each nibble holds
# The tensors of one quantized linear layer, by method: (required, optional).
LAYER_TENSORS = {
    GPTQ: (("qweight", "qzeros", "scales"), ("g_idx",)),
    AWQ: (("qweight", "qzeros", "scales"), ()),
    W4A16: (("weight_packed", "weight_scale", "weight_shape"), ("weight_zero_point",)),
}
PACKED_DTYPES = ("I32", "I64")  # safetensors' int32 (codes, zeros, g_idx), int64 (a shape)
SERVED_4BIT = ("kvledger's engine serves 4-bit gptq (sym true or false, desc_act true or "
               "false, checkpoint_format gptq), 4-bit awq (version gemm, zero_point true) and "
               "compressed-tensors pack-quantized W4A16 (group or channel strategy, no actorder)")


def int4_method(quant: Mapping[str, Any]) -> str:
    """The method name (``INT4_METHODS``) of a 4-bit ``quantization_config`` the engine
    serves, "" for another method (the caller refuses it by name or serves it as FP8);
    BadInput, naming what, for a variant of these methods it does not serve."""
    method = quant.get("quant_method")
    if method == GPTQ:
        _need(quant.get("bits") == 4, f"gptq bits {quant.get('bits')!r}")
        _need(quant.get("checkpoint_format", GPTQ) == GPTQ,
              f"gptq checkpoint_format {quant.get('checkpoint_format')!r}")
        _need(not quant.get("lm_head"), "gptq lm_head true (a quantized LM head)")
        _group_size(quant.get("group_size", 128), "gptq")
        return GPTQ
    if method == AWQ:
        _need(quant.get("bits", quant.get("w_bit")) == 4, f"awq bits {quant.get('bits')!r}")
        version = str(quant.get("version", "gemm")).lower()
        _need(version == "gemm", f"awq version {quant.get('version')!r}")
        _need(quant.get("zero_point", True), "awq zero_point false")
        _group_size(quant.get("group_size", quant.get("q_group_size", 128)), "awq")
        return AWQ
    if method == "compressed-tensors" and quant.get("format") == "pack-quantized":
        groups = quant.get("config_groups")
        _need(isinstance(groups, dict) and groups, "compressed-tensors without config_groups")
        for name, group in groups.items():
            _check_w4a16_group(name, group)
        check_kv_cache_scheme(quant)
        return W4A16
    return ""


def _check_w4a16_group(name: str, group: Any) -> None:
    weights = group.get("weights") if isinstance(group, dict) else None
    ok = (isinstance(weights, dict) and weights.get("num_bits") == 4
          and weights.get("type", "int") == "int" and not weights.get("actorder")
          and weights.get("strategy") in ("group", "channel") and not weights.get("dynamic"))
    _need(ok, f"compressed-tensors config_groups.{name}.weights {weights!r}")
    _need(not group.get("input_activations"),
          f"compressed-tensors config_groups.{name}.input_activations (W4A16 only)")


def _group_size(value: Any, method: str) -> None:
    _need(isinstance(value, int) and not isinstance(value, bool) and (value == -1 or value > 0),
          f"{method} group_size {value!r}")


def _need(ok: Any, what: str) -> None:
    if not ok:
        raise BadInput(f"checkpoint's 4-bit quantization has {clip(what)}; {SERVED_4BIT}")


def layer_tensor(name: str, method: str) -> bool:
    """Whether ``name`` is one of a quantized linear layer's tensors under ``method``."""
    required, optional = LAYER_TENSORS.get(method, ((), ()))
    return name.rsplit(".", 1)[-1] in required + optional


def layer_prefixes(names: Any, method: str) -> set[str]:
    """The layers (``model.layers.0.mlp.up_proj``) ``names`` quantizes: those holding the
    method's first tensor (``qweight`` / ``weight_packed``)."""
    first = "." + LAYER_TENSORS[method][0][0]
    return {n.removesuffix(first) for n in names if n.endswith(first)}


def scale_name(method: str) -> str:
    """A 4-bit layer's scales, whose shape gives its group count (``groups``)."""
    return "weight_scale" if method == W4A16 else "scales"


def group_count(method: str, prefix: str, scale_shape: tuple[int, ...]) -> int:
    """How many groups of inputs the stored scales (``scale_name``) of the layer ``prefix``
    count: W4A16's ``[out, groups]``, the others' ``[groups, out]``. BadInput unless 2-D."""
    if len(scale_shape) != 2:
        raise BadInput(f"4-bit layer {prefix} has scales of shape {list(scale_shape)}; "
                       "kvledger reads 2-D scales")
    return scale_shape[1] if method == W4A16 else scale_shape[0]


def layer_shapes(method: str, prefix: str, in_features: int, out_features: int,
                 groups: int) -> dict[str, tuple[int, ...]]:
    """Each tensor of the 4-bit layer ``prefix`` (``[out_features, in_features]`` in
    ``groups`` groups of inputs) as ``method`` stores it, the optional ones included (see
    the module's docstring). BadInput, one line, for a layer the engine cannot unpack:
    dimensions not divisible by 8, or inputs not split into equal groups."""
    if in_features % 8 or out_features % 8 or groups < 1 or in_features % groups:
        raise BadInput(f"4-bit layer {prefix} [{out_features}, {in_features}] with {groups} "
                       "groups: kvledger needs dimensions divisible by 8 and equal groups")
    words_in, words_out = in_features // 8, out_features // 8
    if method == GPTQ:
        return {"qweight": (words_in, out_features), "qzeros": (groups, words_out),
                "scales": (groups, out_features), "g_idx": (in_features,)}
    if method == AWQ:
        return {"qweight": (in_features, words_out), "qzeros": (groups, words_out),
                "scales": (groups, out_features)}
    return {"weight_packed": (out_features, words_in), "weight_scale": (out_features, groups),
            "weight_shape": (2,), "weight_zero_point": (words_out, groups)}

