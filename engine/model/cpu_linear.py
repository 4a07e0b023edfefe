"""Linear layers on the CPU through oneDNN with the weights packed once, at start-up.

A decode step multiplies a handful of rows (one per running sequence) by every weight
matrix, so its cost is reading the weights. MKL's sgemm, behind ``F.linear``, does that
well for one row (a matrix-vector product) and badly for two to a few dozen: on the
2-core development machine a [M, 512] x [512, 1408] product took 59 us at M=1, 177 us
at M=3 and 543 us at M=32. oneDNN's inner product on weights reordered for it
(``torch.ops.mkldnn``, what torch.compile's CPU freezing uses) took 39-49 us for M=1..4
and 163 us at M=32, the same numbers as ``F.linear`` to float rounding (a relative
1e-6: another order of summation).
So a step costs nearly the same for one sequence or a few, as it should while the
weights dominate (``tests/engine/test_cpu_linear.py``; the step figures are in
docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

# The batch size oneDNN picks the packed layout for; any layout serves every batch, and
# this one was as fast as each batch's own from 1 to 256 rows (within ~10%).
PACK_FOR_ROWS = 8
PACKED_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward on a weight in oneDNN's packed layout (a buffer, so it is
    counted with the model's tensors; it has no dense twin)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(
            weight.detach(), PACK_FOR_ROWS))
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


@functools.cache
def packable(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs weights of ``dtype``: float32 anywhere; bfloat16
    only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, so not on an AVX2-only CPU, where
    torch refuses the reorder and MKL's path stays."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype),
                                                PACK_FOR_ROWS)
    except RuntimeError:
        return False
    return True


def pack_linears(model: nn.Module, device: torch.device) -> int:
    """Swap each ``nn.Linear`` of ``model`` on the CPU for a ``PackedLinear``; returns how
    many. Nothing changes on another device, for a dtype this CPU's oneDNN cannot pack
    (``packable``), or for a layer whose weight is shared (tied embeddings: a packed copy
    would hold it twice)."""
    if device.type != "cpu":
        return 0
    shared = {id(p) for name, p in model.named_parameters(remove_duplicate=False)
              if name.endswith("embed_tokens.weight")}
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if (isinstance(child, nn.Linear) and packable(child.weight.dtype)
                    and id(child.weight) not in shared):
                swaps.append((parent, name, child))
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child.weight, child.bias))
    return len(swaps)
