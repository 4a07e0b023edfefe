"""Remedies for a plan that does not fit, each found by re-planning with the change.

A remedy is offered only when the re-plan fits. ``--max-model-len`` and
``--max-num-seqs`` are the LARGEST values that fit, found by binary search over whole
tokens / sequences (fitting only gets harder as either grows): re-planning with the value
fits, and one token / one sequence more does not.

One spreads the model over more GPUs: the smallest ``--tensor-parallel-size`` up to
``MAX_GPUS_PER_MACHINE`` that the model shards into and that fits, per GPU (on discrete
GPUs only: ranks sharing one memory gain nothing). Another over more machines: the
smallest ``--pipeline-parallel-size`` up to ``MAX_STAGES`` that fits at this tensor
parallel size (``stages.py``), offered only when no tensor parallel size does.

One changes the weights: ``--quantization fp8`` for an unquantized checkpoint (its linear
layers in FP8 on load, planned at that size). None offers "a smaller quantization" of
another checkpoint: the bytes of one cannot be known from this checkpoint's headers, and
most such methods kvledger's engine refuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvledger.engine.checkpoint.layout import SLIDING
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.estimates import DTYPE_BYTES, format_size
from kvledger.engine.planner.limit import largest_utilization
from kvledger.engine.planner.record import Plan, Remedy

MAX_GPUS_PER_MACHINE = 8  # an 8-GPU node (DGX/HGX): the most one pod's GPUs can be
MAX_STAGES = 16  # pipeline stages, one machine each: beyond this a remedy is not offered

if TYPE_CHECKING:
    from kvledger.engine.settings.config import EngineConfig


Replan = Callable[["EngineConfig"], Plan]


def largest_fitting(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """The largest n in [low, high] with fits(n), assuming fits is monotone (true then false)."""
    if high < low or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def find_remedies(plan: Plan, replan: Replan) -> list[Remedy]:
    if plan.cap_above_free:  # no other change helps while the cap cannot be allocated
        return _cap_within_free(plan, replan)
    config = plan.config
    out: list[Remedy] = []

    def with_(**changes) -> Plan:
        return replan(dataclasses.replace(config, **changes))

    best_len = largest_fitting(lambda n: with_(max_model_len=n).fits, 1, plan.max_model_len - 1)
    if best_len is not None:
        out.append(Remedy("--max-model-len", best_len,
                          with_(max_model_len=best_len).classes["kv_cache"]))
    best_seqs = largest_fitting(lambda n: with_(max_num_seqs=n).fits, 1, plan.max_num_seqs - 1)
    if best_seqs is not None:
        out.append(Remedy("--max-num-seqs", best_seqs,
                          with_(max_num_seqs=best_seqs).classes["kv_cache"]))
    if DTYPE_BYTES[plan.kv.dtype] > 1:
        fp8 = with_(kv_cache_dtype="fp8")
        if fp8.fits:
            out.append(Remedy("--kv-cache-dtype", "fp8", fp8.classes["kv_cache"]))
    # Quantized weights are not sharded (plan.py): on one GPU only.
    if not plan.shape.quantization and config.quantization is None and config.tensor_parallel_size == 1:
        quantized = with_(quantization="fp8")
        if quantized.fits:
            out.append(Remedy("--quantization", "fp8", quantized.classes["kv_cache"],
                              note=f"linear layers in FP8 on load: weights -> "
                                   f"{_size(quantized.classes['weights'])}"))
    # More machines only where more GPUs of this one do not do: tensor parallelism within
    # a machine, pipeline stages across machines, as vLLM advises.
    out += _more_gpus(plan, with_) or _more_stages(plan, with_)
    if plan.classes["cuda_graphs"] > 0:
        eager = with_(enforce_eager=True)
        if eager.fits:
            out.append(Remedy("--enforce-eager", None, eager.classes["kv_cache"],
                              note="no CUDA graphs"))
    out += _bigger_explicit_pool(plan, with_)
    out += _smaller_step(plan, with_, others_help=bool(out))
    return out


def _more_gpus(plan: Plan, with_: Callable[..., Plan]) -> list[Remedy]:
    """The smallest ``--tensor-parallel-size`` above this one that fits, re-planned."""
    if plan.device.kind == "cpu" or plan.unified_memory:
        return []
    for size in range(plan.tensor_parallel_size + 1, MAX_GPUS_PER_MACHINE + 1):
        try:
            candidate = with_(tensor_parallel_size=size)
        except BadInput:  # the model does not shard into this many
            continue
        if candidate.fits:
            return [Remedy("--tensor-parallel-size", size, candidate.classes["kv_cache"],
                           note=f"per GPU, x {size} GPUs: weights -> "
                                f"{_size(candidate.classes['weights'])} each")]
    return []


def _more_stages(plan: Plan, with_: Callable[..., Plan]) -> list[Remedy]:
    """The smallest ``--pipeline-parallel-size`` above this one that fits, re-planned."""
    if plan.device.kind == "cpu" or plan.unified_memory:
        return []
    for stages in range(plan.pipeline_parallel_size + 1,
                        min(MAX_STAGES, plan.shape.num_layers) + 1):
        try:
            candidate = with_(pipeline_parallel_size=stages)
        except BadInput:  # weights known by their totals alone cannot be split by layer
            return []
        if candidate.fits:
            return [Remedy("--pipeline-parallel-size", stages, candidate.classes["kv_cache"],
                           note=f"{stages} stages, one machine each: the fullest GPU's "
                                f"weights -> {_size(candidate.classes['weights'])}")]
    return []


def _cap_within_free(plan: Plan, replan: Replan) -> list[Remedy]:
    """The cap that decides the limit, lowered to the device's free memory: the largest
    ``--gpu-memory-utilization`` within it, or ``--memory-limit`` of all of it. Offered
    alone when the run then fits; else each remedy of the lowered plan, together with it."""
    if plan.limit_source == "--gpu-memory-utilization":
        flag, value = "--gpu-memory-utilization", largest_utilization(plan.device)
        field = "gpu_memory_utilization"
    else:
        flag, value, field = "--memory-limit", plan.device.free_bytes, "memory_limit_bytes"
    if not value:  # nothing is free (or under 1% of it): no cap within it can run anything
        return []
    lowered = dataclasses.replace(plan.config, **{field: value})
    candidate = replan(lowered)
    if candidate.fits:
        return [Remedy(flag, value, candidate.classes["kv_cache"])]
    return [dataclasses.replace(r, also=((flag, value), *r.also))
            for r in find_remedies(candidate, replan)]


def _size(nbytes: int) -> str:
    return format_size(nbytes)


def _smaller_step(plan: Plan, with_: Callable[..., Plan], *, others_help: bool) -> list[Remedy]:
    """The largest ``--max-num-batched-tokens`` that fits (never below ``--max-num-seqs``),
    offered when the activations are at least half the budget, when sliding-window layers
    hold a step's tokens on top of their window (vLLM's rule), or nothing else helps."""
    dominate = plan.classes["activations"] * 2 >= plan.required_bytes
    sliding = any(group.attention == SLIDING for group in plan.kv.groups)
    if not dominate and not sliding and others_help:
        return []
    best = largest_fitting(lambda n: with_(max_num_batched_tokens=n).fits, plan.max_num_seqs,
                           plan.max_num_batched_tokens - 1)
    if best is None:
        return []
    candidate = with_(max_num_batched_tokens=best)
    return [Remedy("--max-num-batched-tokens", best, candidate.classes["kv_cache"],
                   note=f"activations -> {_size(candidate.classes['activations'])}")]


def _bigger_explicit_pool(plan: Plan, with_: Callable[..., Plan]) -> list[Remedy]:
    """An explicit pool smaller than one sequence: the smallest pool that holds one."""
    if plan.kv.pool_mode == "override" and plan.config.num_gpu_blocks_override < plan.kv.required_blocks:
        candidate = with_(num_gpu_blocks_override=plan.kv.required_blocks)
        if candidate.fits:
            return [Remedy("--num-gpu-blocks-override", plan.kv.required_blocks,
                           candidate.classes["kv_cache"])]
    if plan.kv.pool_mode == "kv-cache-memory-bytes":
        needed_bytes = plan.kv.required_blocks * plan.kv.bytes_per_block
        if plan.config.kv_cache_memory_bytes < needed_bytes:
            candidate = with_(kv_cache_memory_bytes=needed_bytes)
            if candidate.fits:
                return [Remedy("--kv-cache-memory-bytes", needed_bytes,
                               candidate.classes["kv_cache"])]
    return []
