"""What the start's prediction times on the device before anything is loaded
(``planner/ready_time.py`` predicts from them): a copy from host memory to the device in
the model's dtype (placing each loaded tensor; allocating the KV pool), on the CPU a
oneDNN reorder of the model's own MLP shape (packing the linear layers), and a matmul of
the model's own shape (the profiled steps' arithmetic). Each takes a few tens of
milliseconds."""

from __future__ import annotations

import time

import torch

from kvledger.engine.model.cpu_linear import PACK_FOR_ROWS, packable
from kvledger.engine.planner.ready_time import ReadSpeed

# Tokens of the timed matmul: a prefill's, not a decode's; a GPU needs more rows than the
# CPU to run at the rate a long prefill gets (timed here on the CPU only).
MATMUL_ROWS = {"cpu": 256, "cuda": 2048}


def place_speed(device: torch.device, dtype: torch.dtype,
                sample_bytes: int = 64 << 20) -> ReadSpeed:
    """A timed copy of ``sample_bytes`` from host memory to ``device`` in ``dtype`` (a
    loaded tensor's placing): what the start's prediction counts per pass."""
    source = torch.empty(sample_bytes // dtype.itemsize, dtype=dtype)
    source.fill_(1)  # touched: the pages exist before the timing
    started = time.perf_counter()
    placed = source.to(device, copy=True)
    _sync(device)
    elapsed = time.perf_counter() - started
    del placed
    if device.type == "cuda":  # not left in the allocator's cache for the weights to meet
        torch.cuda.empty_cache()
    return ReadSpeed(sample_bytes, elapsed)


@torch.inference_mode()
def pack_speed(device: torch.device, dtype: torch.dtype, hidden: int,
               intermediate: int) -> ReadSpeed | None:
    """On the CPU, a timed oneDNN reorder of an ``[intermediate, hidden]`` weight in
    ``dtype`` (``cpu_linear.PackedLinear``'s packing of the model's own MLP shape), the
    faster of two after one untimed; None where nothing is packed (another device, a
    dtype this CPU's oneDNN cannot pack)."""
    if device.type != "cpu" or not packable(dtype):
        return None
    weight = torch.ones(intermediate, hidden, dtype=dtype)
    torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
    fastest = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
        fastest = min(fastest, time.perf_counter() - started)
    return ReadSpeed(weight.numel() * weight.element_size(), fastest)


@torch.inference_mode()
def matmul_speed(device: torch.device, dtype: torch.dtype, hidden: int,
                 intermediate: int, min_seconds: float = 0.03, max_repeats: int = 20) -> float:
    """Floating-point operations a second of a ``[MATMUL_ROWS, hidden] x [hidden,
    intermediate]`` product in ``dtype`` on ``device`` (an MLP's projection): the fastest
    of at least three runs, repeated for ``min_seconds`` (a small model's product is
    microseconds, where one run times the thread pool waking, not the arithmetic), after
    one untimed run (the library's first call sets itself up)."""
    count = MATMUL_ROWS.get(device.type, MATMUL_ROWS["cpu"])
    rows = torch.ones(count, hidden, dtype=dtype, device=device)
    weight = torch.ones(intermediate, hidden, dtype=dtype, device=device)
    torch.nn.functional.linear(rows, weight)
    _sync(device)
    fastest, spent, runs = float("inf"), 0.0, 0
    while runs < 3 or (spent < min_seconds and runs < max_repeats):
        started = time.perf_counter()
        torch.nn.functional.linear(rows, weight)
        _sync(device)
        elapsed = time.perf_counter() - started
        fastest, spent, runs = min(fastest, elapsed), spent + elapsed, runs + 1
    del rows, weight
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * count * hidden * intermediate / max(fastest, 1e-9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
