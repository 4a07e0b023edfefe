"""Pipeline parallelism (``--pipeline-parallel-size P``): which layers and tensors each stage
holds, as vLLM splits a model.

- **Layers** (``stage_layer_counts``): vLLM's ``get_pp_indices``. Each stage gets
  ``num_layers // P`` decoder layers; a remainder goes one layer each to the stages before
  the last, from the second-to-last backwards (the last also runs the final norm, the LM
  head and the sampler). 80 layers over 3 stages: 27, 27, 26; 61 over 4: 15, 15, 16, 15.
  ``VLLM_PP_LAYER_PARTITION`` ("31,30") overrides it, as in vLLM.
- **Tensors** (``tensor_stages``): a decoder layer's tensors (``...layers.N...``) go to the
  stage holding layer N (an index past the last layer, DeepSeek-V3's multi-token-prediction
  layer, to the last stage); a vision tower's and its projector's to the first stage, as
  vLLM runs the encoder there; the input embedding to the first stage, and to the last too
  when the LM head is tied to it (vLLM's last stage then holds the embedding as its head);
  every other tensor (the final norm, the LM head) to the last stage.
- **Shape** (``stage_shape``): what one stage computes: its layers (and their attention
  kinds), and the logits only on the last stage.

Every figure of a pipeline-parallel plan is what one GPU of one stage holds; the KV pool
has the same number of blocks on every stage (each holds its own layers' share of every
sequence), the fewest any stage can hold, as vLLM takes the smallest across its workers.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping

from kvledger.engine.checkpoint.contents import EMBEDDING_SUFFIXES, ModelShape, WeightsInfo
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.estimates import format_size
from kvledger.engine.planner.limit import fits
from kvledger.engine.planner.record import Plan, StageFigures

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# A multimodal checkpoint's encoders number their own layers: vLLM runs them on stage 1.
_ENCODERS = ("vision_tower.", "visual.", "vision_model.", "multi_modal_projector.")


def stage_layer_counts(num_layers: int, stages: int,
                       env: Mapping[str, str] | None = None) -> list[int]:
    """Decoder layers per stage, first stage first (BadInput for a split that cannot be)."""
    if stages > num_layers:
        raise BadInput(f"--pipeline-parallel-size {stages} is more stages than the model's "
                       f"{num_layers} layers")
    given = (os.environ if env is None else env).get(PARTITION_ENV)
    if given:
        try:
            counts = [int(part) for part in given.split(",")]
        except ValueError:
            raise BadInput(f"{PARTITION_ENV}={given!r}: give each stage's layers, "
                           "e.g. 31,30") from None
        if len(counts) != stages or sum(counts) != num_layers or min(counts) < 1:
            raise BadInput(f"{PARTITION_ENV}={given!r} must give {stages} stages of at least "
                           f"one layer, {num_layers} layers in all")
        return counts
    counts = [num_layers // stages] * stages
    for i in range(2, num_layers % stages + 2):
        counts[-i] += 1
    return counts


def stage_bounds(num_layers: int, stages: int,
                 env: Mapping[str, str] | None = None) -> list[tuple[int, int]]:
    """``[(first layer, end layer)]`` of each stage."""
    bounds, start = [], 0
    for count in stage_layer_counts(num_layers, stages, env):
        bounds.append((start, start + count))
        start += count
    return bounds


def tensor_stages(name: str, bounds: list[tuple[int, int]], tied: bool) -> tuple[int, ...]:
    """The stages that hold tensor ``name``."""
    last = len(bounds) - 1
    if any(part in name for part in _ENCODERS):  # a vision tower feeds the first stage
        return (0,)
    layer = _LAYER.search(name)
    if layer is not None:
        index = int(layer.group(1))
        return next(((s,) for s, (start, end) in enumerate(bounds) if start <= index < end),
                    (last,))
    if name.endswith(EMBEDDING_SUFFIXES):
        return (0, last) if tied and last > 0 else (0,)
    return (last,)


def stage_weights(weights: WeightsInfo, bounds: list[tuple[int, int]], stage: int,
                  tied: bool) -> WeightsInfo:
    """The part of ``weights`` that stage ``stage`` loads (its totals recomputed)."""
    if not weights.tensors:
        raise BadInput("planning --pipeline-parallel-size needs the checkpoint's tensor names "
                       "(its safetensors headers); these weights are known only by their totals")
    held = tuple(t for t in weights.tensors if stage in tensor_stages(t.name, bounds, tied))
    by_dtype: dict[str, int] = {}
    for t in held:
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
    return dataclasses.replace(weights, tensors=held, num_tensors=len(held),
                               total_bytes=sum(t.nbytes for t in held), bytes_by_dtype=by_dtype)


def stage_shape(shape: ModelShape, bounds: list[tuple[int, int]], stage: int) -> ModelShape:
    """What stage ``stage`` computes: its layers and their attention, and logits (the
    vocabulary) on the last stage alone."""
    start, end = bounds[stage]
    layout = shape.layout
    if layout is not None:
        layout = dataclasses.replace(layout, layers=layout.layers[start:end])
    last = stage == len(bounds) - 1
    return dataclasses.replace(shape, num_layers=end - start, layout=layout,
                               vocab_size=shape.vocab_size if last else 0)


def staged(shape: ModelShape, weights: WeightsInfo, stages: int,
           budget: Callable[[int, ModelShape, WeightsInfo], Plan]) -> Plan:
    """The plan of ``stages`` pipeline stages: ``budget`` (one GPU's budget of stage ``s``'s
    shape and weights) for each, every stage's pool cut to the fewest blocks any holds,
    and the figures of the stage that decides (the first that does not fit, else the one
    with the least to spare), with every stage's in ``Plan.stages``."""
    bounds = stage_bounds(shape.num_layers, stages)
    plans = [budget(s, stage_shape(shape, bounds, s),
                    stage_weights(weights, bounds, s, shape.tie_word_embeddings))
             for s in range(stages)]
    # A pool sized by memory (a cap, --kv-cache-memory-bytes) is the fewest blocks any stage
    # holds, as vLLM takes; one sized by the workload, the most any stage's layers need (a
    # stage of sliding layers needs a block more a sequence than one of full layers).
    workload = all(p.kv.pool_mode == "workload" for p in plans)
    blocks = (max if workload else min)(p.kv.num_blocks for p in plans)
    plans = [_with_blocks(p, blocks) for p in plans]
    short = [s for s, p in enumerate(plans) if not p.fits]
    deciding = short[0] if short else min(
        range(stages), key=lambda s: plans[s].limit_bytes - plans[s].required_bytes)
    figures = tuple(StageFigures(s, start, end, p.fits, p.required_bytes, p.limit_bytes,
                                 dict(p.classes), p.kv.bytes_per_block)
                    for s, ((start, end), p) in enumerate(zip(bounds, plans, strict=True)))
    return dataclasses.replace(plans[deciding], shape=shape, weights=weights,
                               pipeline_parallel_size=stages, stage=deciding, stages=figures)


def _with_blocks(plan: Plan, blocks: int) -> Plan:
    """``plan`` with a pool of ``blocks``, re-judged."""
    if blocks == plan.kv.num_blocks:
        return plan
    kv = dataclasses.replace(plan.kv, num_blocks=blocks,
                             sequences=blocks // max(1, plan.kv.blocks_per_seq))
    classes = dict(plan.classes, kv_cache=blocks * kv.bytes_per_block)
    required = sum(classes.values())
    verdict = fits(required, plan.limit_bytes, blocks, kv.required_blocks, plan.cap_above_free)
    return dataclasses.replace(plan, kv=kv, classes=classes, required_bytes=required,
                               short_by_bytes=max(0, required - plan.limit_bytes), fits=verdict)


def stage_name(plan: Plan, stage: int) -> str:
    """``stage 2 of 3 (layers 26-52)``."""
    figures = plan.stages[stage]
    return (f"stage {stage + 1} of {plan.pipeline_parallel_size} (layers "
            f"{figures.first_layer}-{figures.end_layer - 1})")


def layers_text(plan: Plan) -> str:
    """The layers the plan's weights are: ``80 layers``, or ``26 of 80 layers``."""
    if plan.pipeline_parallel_size == 1:
        return f"{plan.shape.num_layers} layers"
    held = plan.stages[plan.stage]
    return f"{held.end_layer - held.first_layer} of {plan.shape.num_layers} layers"


def stage_lines(plan: Plan) -> list[str]:
    """The report's line of every stage's requirement per GPU (none without stages)."""
    if plan.pipeline_parallel_size == 1:
        return []

    def row(f: StageFigures) -> str:
        text = (f"{f.stage + 1}: layers {f.first_layer}-{f.end_layer - 1}, "
                f"{format_size(f.required_bytes)}")
        if not f.fits:
            short = f.required_bytes - f.limit_bytes
            text += f" (short by {format_size(short)})" if short > 0 else " (does not fit)"
        return text

    return [f"  stages, per GPU: {' | '.join(row(f) for f in plan.stages)}"]
