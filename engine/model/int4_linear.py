"""4-bit weight-only linear layers (GPTQ, AWQ, compressed-tensors W4A16; the packing is
``int4_format``'s): the checkpoint's tensors stay in memory as stored (half a byte a
weight, plus the scales and zeros), and each forward dequantizes the layer's weight to the
activations' dtype, ``(code - zero) * scale``, then ``F.linear``.

Per call, not cached: a cached dequantized copy would hold the weights at the model dtype
again (8x the codes in float32) and undo the saving the plan counts. The transient is one
layer's: its codes unpacked to int32, then the weight in the activations' dtype (the zeros
and scales broadcast over groups of consecutive inputs; gathered per input only for
act-order GPTQ): ``Int4Weights.workspace_bytes`` in checkpoint/weight_formats.py. Measured
on the CPU by ``bench/quantized.py`` (docs/benchmarks.md). The same path runs on CUDA (no int4 kernel is
used yet).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvledger.engine.checkpoint.fp8_format import QUANTIZED_PROJECTIONS
from kvledger.engine.checkpoint.int4_format import (
    AWQ_ORDER,
    GPTQ,
    W4A16,
    group_count,
    layer_prefixes,
    layer_shapes,
    scale_name,
)
from kvledger.engine.errors import BadInput

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble k of a word: bits 4k..4k+3
# AWQ: output k of a word's eight is in nibble AWQ_ORDER.index(k); reading the nibbles in
# that order unpacks them in output order, with no reordering copy.
_AWQ_SHIFTS = torch.tensor([4 * AWQ_ORDER.index(k) for k in range(8)], dtype=torch.int32)


def unpack_nibbles(packed: torch.Tensor, dim: int, shifts: torch.Tensor = _SHIFTS) -> torch.Tensor:
    """int32 words -> their eight 4-bit codes (0..15, int32), nibble ``k`` of word ``i``
    at index ``8i + k`` along ``dim`` (0 or 1); ``shifts`` the bit offset of each of the
    eight (``_AWQ_SHIFTS``: AWQ's order)."""
    shifts = shifts.to(packed.device)
    if dim == 0:
        codes = packed.unsqueeze(1) >> shifts.view(1, 8, 1)  # [rows, 8, cols]
        return codes.bitwise_and_(15).reshape(-1, packed.shape[1])
    codes = packed.unsqueeze(2) >> shifts.view(1, 1, 8)      # [rows, cols, 8]
    return codes.bitwise_and_(15).reshape(packed.shape[0], -1)


class Int4Linear(nn.Module):
    """``nn.Linear`` over a 4-bit layer's stored tensors, named as ``method`` stores them
    (buffers, so the model's tensors count them); shapes as ``_layer`` reads them."""

    def __init__(self, method: str, prefix: str, in_features: int, out_features: int,
                 groups: int, *, scale_dtype: torch.dtype, zeros: bool, g_idx: bool,
                 bias: bool) -> None:
        super().__init__()
        self.method, self.in_features, self.out_features = method, in_features, out_features
        self.group_size = in_features // groups
        optional = {"g_idx": g_idx, "weight_zero_point": zeros}
        for part, shape in layer_shapes(method, prefix, in_features, out_features, groups).items():
            dtype = (scale_dtype if part == scale_name(method)
                     else torch.int64 if part == "weight_shape" else torch.int32)
            kept = optional.get(part, True)
            self.register_buffer(part, torch.empty(shape, dtype=dtype) if kept else None)
        self.register_buffer("bias", torch.empty(out_features) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[out, in]`` in ``dtype``: ``(code - zero) * scale`` per group.
        Groups of consecutive inputs broadcast their zeros and scales over a view; only
        act-order GPTQ (a ``g_idx`` that is not ``i // group_size``) gathers them per input."""
        if self.method == W4A16:  # [out, in]; codes and zeros stored + 8
            weight = unpack_nibbles(self.weight_packed, 1).to(dtype)
            grouped = weight.view(self.out_features, -1, self.group_size)
            if self.weight_zero_point is not None:
                grouped.sub_(unpack_nibbles(self.weight_zero_point, 0).to(dtype).unsqueeze(2))
            else:
                grouped.sub_(8)
            grouped.mul_(self.weight_scale.to(dtype).unsqueeze(2))
            return weight
        if self.method == GPTQ:  # [in, out]; zeros stored - 1
            weight = unpack_nibbles(self.qweight, 0).to(dtype)
            zeros = unpack_nibbles(self.qzeros, 1).to(dtype).add_(1)
        else:  # AWQ, [in, out] in its nibble order
            weight = unpack_nibbles(self.qweight, 1, _AWQ_SHIFTS).to(dtype)
            zeros = unpack_nibbles(self.qzeros, 1, _AWQ_SHIFTS).to(dtype)
        scales = self.scales.to(dtype)
        if self._act_order():
            groups = self.g_idx.long()
            weight.sub_(zeros[groups]).mul_(scales[groups])
        else:
            grouped = weight.view(-1, self.group_size, self.out_features)
            grouped.sub_(zeros.unsqueeze(1)).mul_(scales.unsqueeze(1))
        return weight.t()

    def _act_order(self) -> bool:
        """Whether GPTQ's ``g_idx`` groups the inputs other than consecutively (checked once:
        the stored tensors do not change)."""
        if getattr(self, "_act_order_known", None) is None:
            g_idx = getattr(self, "g_idx", None)
            consecutive = torch.arange(self.in_features, device=g_idx.device) // self.group_size \
                if g_idx is not None else None
            self._act_order_known = g_idx is not None and not torch.equal(g_idx.long(), consecutive)
        return self._act_order_known


def install_int4_linears(model: nn.Module, state: dict[str, torch.Tensor], method: str) -> int:
    """Swap each linear layer of ``model`` that ``state`` (a checkpoint, names as Hugging
    Face's) holds 4-bit tensors for into an ``Int4Linear`` shaped as they are stored;
    returns how many. BadInput, one line, for tensors that do not fit the layer. Run
    before assigning: the new layers' tensors are on the meta device, placeholders."""
    swaps = []
    for prefix in sorted(layer_prefixes(state, method)):
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            continue  # the loader names it as unexpected
        if not isinstance(module, nn.Linear) or prefix.rsplit(".", 1)[-1] not in QUANTIZED_PROJECTIONS:
            continue  # loadable_config refuses these before anything loads
        with torch.device("meta"):
            swaps.append((prefix, _layer(module, prefix, state, method)))
    for prefix, layer in swaps:
        parent, _, name = prefix.rpartition(".")
        setattr(model.get_submodule(parent), name, layer)
    return len(swaps)


def _layer(module: nn.Linear, prefix: str, state: dict[str, torch.Tensor], method: str) -> Int4Linear:
    """The layer for ``module``'s stored tensors, its group count read from its scales;
    the loader then checks every stored shape against it."""
    scale = state.get(f"{prefix}.{scale_name(method)}")
    if scale is None:
        raise BadInput(f"4-bit layer {prefix} has no scales")
    return Int4Linear(method, prefix, module.in_features, module.out_features,
                      group_count(method, prefix, tuple(scale.shape)), scale_dtype=scale.dtype,
                      zeros=prefix + ".weight_zero_point" in state,
                      g_idx=prefix + ".g_idx" in state, bias=module.bias is not None)
