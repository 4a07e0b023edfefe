"""FP8 linear layers: the weights stay float8_e4m3fn in memory (one byte a weight, the
saving the planner counts) and are multiplied in the activations' dtype.

Two ways to compute, by device:

- Everywhere (the CPU, and CUDA without FP8 matmuls): dequantize the layer's weight to the
  activations' dtype (``weight * weight_scale``, ``dequantize``), then ``F.linear``. The
  dequantized copy is a transient of one layer, freed after its matmul. With a static ``input_scale`` the
  input is first quantized to FP8 and back (``x / input_scale``, clamped to e4m3's range),
  as vLLM quantizes it, so the rounding is the one vLLM's kernels see; dynamic activations
  are not quantized here (weight-only FP8: the same weights, the activations exact).
- CUDA on a card of compute capability 8.9 or above (Ada, Hopper, Blackwell), half-precision
  activations and dimensions multiple of 16: ``torch._scaled_mm`` on the FP8 weight and
  the input quantized to FP8 (by ``input_scale``, else dynamically per tensor or, with
  per-channel weight scales, per token, as vLLM's dynamic scheme does). This path is not
  exercised by the CPU test suite: should the kernel refuse a shape or the card, the layer
  logs it once and computes as above from then on.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvledger.engine.checkpoint.fp8_format import QUANTIZED_PROJECTIONS

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
_SCALED_MM_CAPABILITY = (8, 9)
_E4M3_IN_FP16 = -16512  # 0xBF80 as int16: the sign, then the shifted exponent and mantissa
log = logging.getLogger("kvledger.engine")


class Fp8Linear(nn.Module):
    """``nn.Linear`` over an FP8 weight ``[out, in]`` and its float32 ``weight_scale``
    (``[]`` per tensor, ``[out, 1]`` per channel), with an optional static ``input_scale``
    (``[]``). All are buffers, so the model's tensors count them."""

    def __init__(self, in_features: int, out_features: int, *, per_channel: bool,
                 static_input: bool, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE))
        shape = (out_features, 1) if per_channel else ()
        self.register_buffer("weight_scale", torch.empty(shape, dtype=torch.float32))
        self.register_buffer("input_scale",
                             torch.empty((), dtype=torch.float32) if static_input else None)
        self.register_buffer("bias", torch.empty(out_features) if bias else None)
        self.scaled_mm = True  # until the kernel refuses this layer once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaled_mm and _scaled_mm_fits(self, x):
            try:
                return self._scaled_mm(x)
            except RuntimeError as exc:  # a shape or card the kernel refuses: dequantize
                log.warning("torch._scaled_mm refused an FP8 layer (%s); dequantizing instead",
                            exc)
                self.scaled_mm = False
        if self.input_scale is not None:
            x = quantize(x, self.input_scale).to(x.dtype) * self.input_scale.to(x.dtype)
        return F.linear(x, dequantize(self.weight, self.weight_scale, x.dtype), self.bias)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """FP8 x FP8 on the tensor cores; scales per tensor, or per token and per channel."""
        rows = x.reshape(-1, self.in_features)
        per_channel = self.weight_scale.dim() == 2
        if self.input_scale is not None:
            x_scale = self.input_scale.expand(rows.shape[0], 1) if per_channel else self.input_scale
        elif per_channel:
            x_scale = rows.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
        else:
            x_scale = rows.abs().amax().float().clamp(min=1e-12) / FP8_MAX
        w_scale = self.weight_scale.view(1, -1) if per_channel else self.weight_scale
        out = torch._scaled_mm(quantize(rows, x_scale), self.weight.t(), scale_a=x_scale.contiguous(),
                               scale_b=w_scale, out_dtype=x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def _scaled_mm_fits(layer: Fp8Linear, x: torch.Tensor) -> bool:
    """Whether ``torch._scaled_mm`` may run this layer: CUDA with FP8 tensor cores, half
    precision out (rowwise scales: bfloat16 only), dimensions multiple of 16."""
    if x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if layer.weight_scale.dim() == 2 and x.dtype != torch.bfloat16:
        return False
    if layer.in_features % 16 or layer.out_features % 16:
        return False
    return torch.cuda.get_device_capability(x.device) >= _SCALED_MM_CAPABILITY


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight * scale`` in ``dtype``, equal to ``weight.to(dtype) * scale.to(dtype)``.

    torch's float8 cast is scalar code on the CPU (9.6 ms for a 1408x512 matrix on the
    development machine, against 1.3 ms here), so the bits are moved instead: e4m3fn
    (``s eeee mmm``, bias 7) shifted into float16 (``s eeeee mmmmmmmmmm``, bias 15) is the
    same value times 2^-8 for every finite e4m3 value, subnormals included; the 2^8 joins
    the scale (a power of two: the product still rounds once). e4m3fn has no infinity,
    and its NaN would read as +-480 (a checkpoint's weights have none). Transient: the
    float16 bits, then the ``dtype`` copy (none for float16)."""
    bits = weight.view(torch.int8).to(torch.int16)
    bits.bitwise_left_shift_(7).bitwise_and_(_E4M3_IN_FP16)
    return bits.view(torch.float16).to(dtype).mul_(scale.to(dtype) * 256)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` in FP8, clamped to e4m3's range (vLLM's scaled_fp8_quant)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight ``[..., out, in]`` in FP8 with one float32 scale per output channel
    (``[..., out, 1]``), each row's largest magnitude mapped to e4m3's largest value."""
    scale = weight.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return quantize(weight, scale), scale


def scale_shape(scale: torch.Tensor) -> torch.Tensor:
    """A stored scale as ``Fp8Linear`` holds it: float32, ``[]`` for one per tensor
    (stored ``[]`` or ``[1]``), ``[out, 1]`` for one per channel (``[out]`` or ``[out, 1]``)."""
    scale = scale.to(torch.float32)
    return scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1)


def install_fp8_linears(model: nn.Module, state: dict[str, torch.Tensor]) -> int:
    """Swap each of ``model``'s linear layers that ``state`` (a checkpoint, names as
    Hugging Face's) holds a ``weight_scale`` for into an ``Fp8Linear`` shaped as its
    scales are stored (``scale_shape``); returns how many. Run before assigning: the new
    layers' tensors are on the meta device, placeholders."""
    swaps = []
    for prefix, module in model.named_modules():
        scale = state.get(prefix + ".weight_scale")
        if scale is None or not isinstance(module, nn.Linear):
            continue
        if prefix.rsplit(".", 1)[-1] not in QUANTIZED_PROJECTIONS:
            continue  # loadable_config refuses such a scale before anything loads
        with torch.device("meta"):
            swaps.append((prefix, Fp8Linear(
                module.in_features, module.out_features, per_channel=scale.numel() > 1,
                static_input=prefix + ".input_scale" in state, bias=module.bias is not None)))
    for prefix, layer in swaps:
        parent, _, name = prefix.rpartition(".")
        setattr(model.get_submodule(parent), name, layer)
    return len(swaps)
