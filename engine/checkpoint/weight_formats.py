"""The quantized weight formats kvledger's engine serves, as a registry (``WEIGHT_FORMATS``):
each format is one object that answers every question the planner, the pre-flight and the
loader ask of quantized weights, so none of them branches on a format's name:

- ``declared``: does config.json's ``quantization_config`` declare it (BadInput, naming
  what, for a variant of it the engine does not serve);
- ``stored``: do a checkpoint's config and safetensors headers hold it (the planner);
- ``quantized_tensors`` / ``layer_tensors``: which stored tensors are its quantized
  layers (the pre-flight's check, BadInput for a layer the loader cannot take) and which
  names a quantized linear layer adds;
- ``kept_as_stored``: which tensors the loader keeps byte for byte (the planner counts
  them so);
- ``shape_errors``: which of its stored tensors have shapes other than the ones the
  loader expects for the config's widths (the pre-flight's check);
- ``workspace_bytes``: what a step's dequantization adds to the activations;
- ``can_shard``, ``packed`` (4-bit layers replace their weight; the loader installs
  ``int4_linear``, else ``fp8_linear``) and ``label`` (the plan's report).

The details of each family live beside it (``fp8_format``, ``int4_format``); a new format
is one class here and its layer in model/.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvledger.engine.checkpoint.contents import CASTABLE_DTYPES, ModelShape, TensorInfo, WeightsInfo
from kvledger.engine.checkpoint.fp8_format import (
    FP8,
    FP8_DTYPE,
    SCALE_SUFFIXES,
    SERVED_WEIGHTS,
    fp8_method,
)
from kvledger.engine.checkpoint.int4_format import (
    AWQ,
    GPTQ,
    LAYER_TENSORS,
    PACKED_DTYPES,
    W4A16,
    group_count,
    int4_method,
    layer_prefixes,
    layer_shapes,
    layer_tensor,
    scale_name,
)
from kvledger.engine.checkpoint.layer_kinds import SUPPORTED_ARCHITECTURES
from kvledger.engine.errors import BadInput, some


@dataclass(frozen=True)
class Fp8Weights:
    """FP8 (e4m3) linear layers with float32 scales per tensor or channel (``fp8_format``);
    also what ``--quantization fp8`` makes of an unquantized checkpoint on load."""

    name: str = FP8
    label: str = "linear layers f8_e4m3"
    can_shard: bool = False
    packed: bool = False

    def declared(self, quant: Mapping[str, Any]) -> bool:
        return fp8_method(quant)

    def stored(self, shape: ModelShape, weights: WeightsInfo) -> bool:
        """quant_method ``fp8``, or ``compressed-tensors`` holding F8_E4M3 tensors."""
        return shape.quantization == FP8 or (shape.quantization == "compressed-tensors"
                                             and FP8_DTYPE in weights.bytes_by_dtype)

    def quantized_tensors(self, stored: list[TensorInfo]) -> set[str]:
        """The FP8 weights: F8_E4M3, each with its scale. BadInput for a scale whose weight
        is not F8_E4M3 (the loader would multiply a value by it)."""
        dtypes = {t.name: t.dtype for t in stored}
        scaled = {t.name.removesuffix(".weight_scale") + ".weight" for t in stored
                  if t.name.endswith(".weight_scale")}
        wrong = sorted(f"{n!r} as {dtypes.get(n, 'missing')}" for n in scaled
                       if dtypes.get(n) != FP8_DTYPE)
        if wrong:
            raise BadInput(f"FP8 checkpoint has a weight_scale for weights not stored as "
                           f"{FP8_DTYPE}: {some(wrong, quote=False)}; {SERVED_WEIGHTS}")
        return scaled

    def layer_tensors(self, weight: str) -> set[str]:
        """A quantized linear layer's scales, beside its weight."""
        return {weight.removesuffix(".weight") + suffix for suffix in SCALE_SUFFIXES}

    def shape_errors(self, stored: Mapping[str, tuple[int, ...]],
                     expected: Mapping[str, tuple[int, ...]]) -> list[str]:
        """Each layer's scales of a shape the engine cannot hold (``fp8_linear.scale_shape``):
        a ``weight_scale`` one number or one per output, an ``input_scale`` one number.
        The FP8 weights themselves are stored in the float weights' shapes (``expected``)."""
        wrong = []
        for name, shape in stored.items():
            if not name.endswith(SCALE_SUFFIXES):
                continue
            weight = expected.get(name.rsplit(".", 1)[0] + ".weight")
            counts = {1} if name.endswith(".input_scale") or weight is None else {1, weight[0]}
            if math.prod(shape) not in counts:
                counted = " or ".join(map(str, sorted(counts)))
                wrong.append(f"{name!r} is {list(shape)}, expected {counted} numbers")
        return wrong

    def kept_as_stored(self, name: str) -> bool:
        return False  # FP8 weights are not floats, kept by the general rule; scales float32

    def workspace_bytes(self, shape: ModelShape, weights: WeightsInfo, model_dtype: str,
                        dtype_bytes: int, tokens: int) -> int:
        """The largest linear layer's weight dequantized (``fp8_linear.dequantize``: its
        float16 bits, then the model dtype's copy unless that is float16; one layer at a
        time), and with static input scales the widest input rounded through float32 and
        FP8 (``tokens`` rows)."""
        q_size = shape.num_attention_heads * shape.head_dim
        widest_in = max(shape.hidden_size, q_size, shape.intermediate_size)
        largest = max(shape.intermediate_size, q_size) * shape.hidden_size
        static = any(t.name.endswith(".input_scale") for t in weights.tensors)
        rounding = tokens * widest_in * (4 + 1 + dtype_bytes) if static else 0
        dequantized = 2 if model_dtype == "float16" else 2 + dtype_bytes
        return largest * dequantized + rounding


@dataclass(frozen=True)
class Int4Weights:
    """4-bit weight-only layers, kept as stored and dequantized per call (``int4_format``):
    ``gptq``, ``awq`` or compressed-tensors ``w4a16``."""

    name: str
    label: str = "linear layers 4-bit as stored"
    can_shard: bool = False
    packed: bool = True

    def declared(self, quant: Mapping[str, Any]) -> bool:
        return int4_method(quant) == self.name

    def stored(self, shape: ModelShape, weights: WeightsInfo) -> bool:
        """quant_method ``gptq`` or ``awq``; ``w4a16``: ``compressed-tensors`` holding
        ``weight_packed`` tensors."""
        if self.name != W4A16:
            return shape.quantization == self.name
        return shape.quantization == "compressed-tensors" and any(
            t.name.endswith(".weight_packed") for t in weights.tensors)

    def quantized_tensors(self, stored: list[TensorInfo]) -> set[str]:
        """The packed tensors of the quantized layers. BadInput for a layer that misses
        one the loader needs, or holds one in the wrong dtype (codes, zeros and g_idx
        int32; scales a float)."""
        dtypes = {t.name: t.dtype for t in stored}
        required, optional = LAYER_TENSORS[self.name]
        wrong, names = [], set()
        for layer in sorted(layer_prefixes(dtypes, self.name)):
            for part in required + optional:
                name = f"{layer}.{part}"
                dtype = dtypes.get(name)
                if dtype is None and part in optional:
                    continue
                names.add(name)
                scale = part in ("scales", "weight_scale")
                if dtype is None or (dtype not in CASTABLE_DTYPES if scale else
                                     dtype not in PACKED_DTYPES):
                    wrong.append(f"{name!r} as {dtype or 'missing'}")
        if wrong:
            raise BadInput(f"{self.name} checkpoint has 4-bit layers the engine cannot load: "
                           f"{some(wrong, quote=False)} (codes, zeros and g_idx int32, scales a float); "
                           f"{SERVED_WEIGHTS}")
        return names

    def layer_tensors(self, weight: str) -> set[str]:
        """A quantized linear layer's tensors, in its weight's stead."""
        return {f"{weight.removesuffix('.weight')}.{part}"
                for part in sum(LAYER_TENSORS[self.name], ())}

    def shape_errors(self, stored: Mapping[str, tuple[int, ...]],
                     expected: Mapping[str, tuple[int, ...]]) -> list[str]:
        """Each 4-bit layer's tensors whose shapes are not the ones its float weight
        ``[out, in]`` (``expected``) and its scales' group count give (``layer_shapes``);
        BadInput for a layer the engine cannot unpack."""
        wrong = []
        for layer in sorted(layer_prefixes(stored, self.name)):
            weight = expected.get(layer + ".weight")
            scales = stored.get(f"{layer}.{scale_name(self.name)}")
            if weight is None or scales is None:
                continue  # refused by name: not the engine's layer, or its scales missing
            out_features, in_features = weight
            wants = layer_shapes(self.name, layer, in_features, out_features,
                                 group_count(self.name, layer, scales))
            wrong += [f"'{layer}.{part}' is {list(stored[f'{layer}.{part}'])}, "
                      f"expected {list(want)}" for part, want in wants.items()
                      if stored.get(f"{layer}.{part}", want) != want]
        return wrong

    def kept_as_stored(self, name: str) -> bool:
        return layer_tensor(name, self.name)

    def workspace_bytes(self, shape: ModelShape, weights: WeightsInfo, model_dtype: str,
                        dtype_bytes: int, tokens: int) -> int:
        """The largest linear layer's weight at 8 bytes a weight: the most its
        dequantization holds at once in any model dtype up to float32 (codes unpacked to
        int32, or the codes and the weight, or that weight and a zero or scale gathered
        per input); one layer at a time."""
        q_size = shape.num_attention_heads * shape.head_dim
        return max(shape.intermediate_size, q_size) * shape.hidden_size * 8


WeightFormat = Fp8Weights | Int4Weights
WEIGHT_FORMATS: dict[str, WeightFormat] = {
    f.name: f for f in (Fp8Weights(), Int4Weights(GPTQ), Int4Weights(AWQ), Int4Weights(W4A16))}


def declared_format(quant: Mapping[str, Any]) -> WeightFormat | None:
    """The format config.json's ``quantization_config`` declares, None for one the engine
    does not serve (the caller refuses it by name); BadInput for a variant of a served
    format it does not serve."""
    return next((f for f in WEIGHT_FORMATS.values() if f.declared(quant)), None)


def stored_format(shape: ModelShape, weights: WeightsInfo) -> WeightFormat | None:
    """The served format a checkpoint holds, for an architecture the engine serves (another
    architecture's quantization is a vLLM what-if, counted as stored)."""
    if shape.architecture not in SUPPORTED_ARCHITECTURES:
        return None
    return next((f for f in WEIGHT_FORMATS.values() if f.stored(shape, weights)), None)


def run_format(shape: ModelShape, weights: WeightsInfo, quantize_fp8: bool) -> WeightFormat | None:
    """The format the engine runs: the checkpoint's own, else FP8 with ``--quantization fp8``
    on an unquantized checkpoint, else None."""
    stored = stored_format(shape, weights)
    if stored is None and quantize_fp8 and not shape.quantization:
        return WEIGHT_FORMATS[FP8]
    return stored
