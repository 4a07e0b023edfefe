"""Remedies for a plan that does not fit, each found by re-planning with the change.

A remedy is offered only when the re-plan fits. ``--max-model-len`` and
``--max-num-seqs`` are the LARGEST values that fit, found by binary search over whole
tokens / sequences (fitting only gets harder as either grows): re-planning with the value
fits, and one token / one sequence more does not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvledger.engine.planner.checkpoint import DTYPE_BITS
from kvledger.engine.planner.estimates import DTYPE_BYTES
from kvledger.engine.planner.layout import SLIDING

if TYPE_CHECKING:
    from kvledger.engine.planner.plan import Plan

# Bits per parameter of the "smaller quantization" we test the budget with (AWQ/GPTQ int4).
QUANTIZED_BITS = 4
QUANTIZATION = "a smaller quantization"


@dataclass(frozen=True)
class Remedy:
    flag: str | None  # None for advice that is not one flag ("a smaller quantization")
    value: int | str | None
    kv_bytes: int  # the KV cache class after the change
    note: str = ""
    weights_bytes: int | None = None  # the weights class after the change, when it changes
    also: tuple[tuple[str, int], ...] = ()  # other flag changes this remedy needs

    def to_json(self) -> dict:
        return {"flag": self.flag, "value": self.value, "kv_bytes": self.kv_bytes,
                "note": self.note, "weights_bytes": self.weights_bytes,
                "also": {flag: value for flag, value in self.also}}


Replan = Callable[..., "Plan"]  # replan(config, weights_bytes=None) -> Plan


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
    if plan.classes["cuda_graphs"] > 0:
        eager = with_(enforce_eager=True)
        if eager.fits:
            out.append(Remedy("--enforce-eager", None, eager.classes["kv_cache"],
                              note="no CUDA graphs"))
    out += _bigger_explicit_pool(plan, with_)
    out += _smaller_step(plan, with_, others_help=bool(out))
    quantized = _quantization(plan, replan, others_help=bool(out))
    if quantized is not None:
        out.append(quantized)
    return out


def _smaller_step(plan: Plan, with_: Callable[..., Plan], *, others_help: bool) -> list[Remedy]:
    """The largest ``--max-num-batched-tokens`` that fits (never below ``--max-num-seqs``),
    offered when the activations are at least half the budget, when sliding-window layers
    hold a step's tokens on top of their window (vLLM's rule), or nothing else helps."""
    from kvledger.engine.planner.report import format_size  # report imports this module

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
                   note=f"activations -> {format_size(candidate.classes['activations'])}")]


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


def _quantization(plan: Plan, replan: Replan, *, others_help: bool) -> Remedy | None:
    """Offered when weights dominate the budget, or nothing else helps, and weights at
    QUANTIZED_BITS per parameter would fit: with the same flags, or else (when nothing
    else helps) together with the largest ``--max-model-len`` that then fits."""
    weights = plan.classes["weights"]
    dominate = weights * 2 >= plan.required_bytes
    if not dominate and others_help:
        return None
    params = sum(nbytes * 8 // DTYPE_BITS[d] for d, nbytes in plan.weights.bytes_by_dtype.items())
    smaller = params * QUANTIZED_BITS // 8
    if smaller >= weights:
        return None
    note = "weights dominate this budget" if dominate else "only smaller weights can help"
    candidate = replan(plan.config, weights_bytes=smaller)
    if candidate.fits:
        return Remedy(None, QUANTIZATION, candidate.classes["kv_cache"], note=note,
                      weights_bytes=smaller)
    if others_help:
        return None

    def fits_with(n: int) -> bool:
        return replan(dataclasses.replace(plan.config, max_model_len=n), weights_bytes=smaller).fits

    best_len = largest_fitting(fits_with, 1, plan.max_model_len - 1)
    if best_len is None:
        return None
    candidate = replan(dataclasses.replace(plan.config, max_model_len=best_len),
                       weights_bytes=smaller)
    return Remedy(None, QUANTIZATION, candidate.classes["kv_cache"],
                  note=f"only smaller weights can help, with --max-model-len {best_len}",
                  weights_bytes=smaller, also=(("--max-model-len", best_len),))
