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
weights dominate (``tests/engine/model/test_cpu_linear.py``; the step figures are in
docs/benchmarks.md).

Not on every CPU, though: on one machine the packed step ran at 0.72x ``nn.Linear``'s
speed for one to three rows. So whether packing pays is measured at start-up
(``packing_pays``) on the model's own layers, and the engine keeps the faster.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import deque
from collections.abc import Sequence

import torch
from torch import nn

# The batch size oneDNN picks the packed layout for; any layout serves every batch, and
# this one was as fast as each batch's own from 1 to 256 rows (within ~10%).
PACK_FOR_ROWS = 8
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# The start-up measurement: the first layers holding up to SAMPLE_BYTES of weights, more
# than a CPU's last-level cache, so that they stream from memory as in a step, run at
# each of SAMPLE_ROWS rows, dense and packed in turn, the best of SAMPLE_REPEATS sweeps.
# Packing stays unless the dense sweeps' sum is the smaller. With under
# MEASURE_MIN_BYTES of weights in all, everything sits in cache and the timings would
# say nothing of a step: packed, unmeasured.
SAMPLE_BYTES = 128 << 20
MEASURE_MIN_BYTES = 32 << 20
SAMPLE_ROWS = (1, 4, 16)
SAMPLE_REPEATS = 3

log = logging.getLogger("kvledger.engine")


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


def measured_bytes(linear_bytes: int) -> int:
    """The weights' bytes ``packing_pays`` streams deciding for a model of
    ``linear_bytes`` of linear weights (0: under ``MEASURE_MIN_BYTES``, packed
    unmeasured): its sample, dense and packed, at each of ``SAMPLE_ROWS``, each
    ``SAMPLE_REPEATS`` times."""
    if linear_bytes < MEASURE_MIN_BYTES:
        return 0
    return 2 * len(SAMPLE_ROWS) * SAMPLE_REPEATS * min(SAMPLE_BYTES, linear_bytes)


def _weight_bytes(layer: nn.Linear) -> int:
    return layer.weight.numel() * layer.weight.element_size()


def sweep_seconds(layers: Sequence[nn.Module], rows: int) -> float:
    """The best of ``SAMPLE_REPEATS`` passes of ``rows`` rows through every layer in
    turn (each on its own input: the layers need not chain)."""
    inputs = []
    for layer in layers:
        weight = layer.weight if isinstance(layer, nn.Linear) else layer.packed
        inputs.append(torch.randn(rows, layer.in_features, dtype=weight.dtype))
    best = math.inf
    with torch.inference_mode():
        for _ in range(SAMPLE_REPEATS):
            start = time.perf_counter()
            for layer, x in zip(layers, inputs, strict=True):
                layer(x)
            best = min(best, time.perf_counter() - start)
    return best


def packing_pays(dense: Sequence[nn.Linear], packed: Sequence[PackedLinear]) -> bool:
    """Whether ``packed`` (the same layers as ``dense``, packed) ran the sample faster:
    dense and packed sweeps alternate at each of ``SAMPLE_ROWS`` rows, so a machine that
    speeds up or slows down meanwhile touches both alike."""
    dense_s = packed_s = 0.0
    for rows in SAMPLE_ROWS:
        dense_s += sweep_seconds(dense, rows)
        packed_s += sweep_seconds(packed, rows)
    pays = packed_s <= dense_s
    log.info("CPU linear layers: %s (oneDNN packed %.2f ms against nn.Linear %.2f ms over "
             "%d layers at %s rows)", "packed" if pays else "left on nn.Linear",
             packed_s * 1e3, dense_s * 1e3, len(dense), "/".join(map(str, SAMPLE_ROWS)))
    return pays


def pack_linears(model: nn.Module, device: torch.device, *, measure: bool = True) -> int:
    """Swap each ``nn.Linear`` of ``model`` on the CPU for a ``PackedLinear``, when
    ``packing_pays`` on a sample of them (``measure``; False packs unmeasured); returns
    how many. Nothing changes on another device, for a dtype this CPU's oneDNN cannot
    pack (``packable``), or for a layer whose weight is shared (tied embeddings: a packed
    copy would hold it twice). The sample's packed copies live beside the dense weights
    while it is measured: at most ``SAMPLE_BYTES`` more, for a moment."""
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
    sample: list[nn.Linear] = []
    if measure and sum(_weight_bytes(child) for *_, child in swaps) >= MEASURE_MIN_BYTES:
        held = 0
        for *_, child in swaps:  # the first layers, until SAMPLE_BYTES are held
            if held >= SAMPLE_BYTES:
                break
            sample.append(child)
            held += _weight_bytes(child)
    packed = [PackedLinear(layer.weight, layer.bias) for layer in sample]
    if sample and not packing_pays(sample, packed):
        return 0
    del sample
    count, todo, ready = len(swaps), deque(swaps), deque(packed)
    del swaps, packed
    while todo:  # a layer at a time, so that each dense weight goes once it is packed
        parent, name, child = todo.popleft()
        setattr(parent, name, ready.popleft() if ready else
                PackedLinear(child.weight, child.bias))
    return count
