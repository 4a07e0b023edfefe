"""The memory plan of a declared run: device bytes per class, the limit, the KV pool.

Precedence (docs/planner.md, "Precedence"):

- limit: the smallest cap given (``--memory-limit``, ``--gpu-memory-utilization`` x total);
  with none, free device memory less a safety margin (wider on a unified pool); a cap
  above free memory does not fit (``limit``).
- KV pool: ``--num-gpu-blocks-override`` blocks; else ``--kv-cache-memory-bytes``; else,
  with a cap, all that is left under it (vLLM); else exactly the declared workload,
  ``max_num_seqs * ceil(max_model_len / block_size)`` blocks.
- max_num_seqs: ``--max-num-seqs``; not given, under a cap that sizes the pool, the whole
  ``max_model_len`` sequences the pool holds, bounded (``seats``); else 16.
- fits: the total is within the limit, the limit within free memory, and the pool holds
  the declared workload (an explicit pool size need only hold one ``max_model_len``
  sequence; a pool that decides the seats, at least one).

A checkpoint of an architecture kvledger's engine serves is planned as the engine runs it,
so one the engine cannot load (quantized weights, tensors it does not know) is bad input
here, never a plan that "fits" (``model.loadable``).
"""

from __future__ import annotations

import dataclasses

from kvledger.engine.checkpoint.contents import (
    ModelShape,
    ModelSource,
    WeightsInfo,
    model_shape,
    read_weights,
)
from kvledger.engine.checkpoint.hf_config import read_config_json
from kvledger.engine.checkpoint.loadable import loadable_config
from kvledger.engine.checkpoint.read_limits import ReadLimits
from kvledger.engine.planner import estimates
from kvledger.engine.planner.attention import attention_backend, gathers_kv
from kvledger.engine.planner.device import DeviceMemory, probe_device
from kvledger.engine.planner.dtypes import resolve_kv_dtype, resolve_model_dtype
from kvledger.engine.planner.limit import (
    FREE_MEMORY,
    cap_above_free,
    fits,
    limit_warnings,
    resolve_limit,
)
from kvledger.engine.planner.lora_bytes import model_slot_bytes
from kvledger.engine.planner.pool import (
    ENGINE_RULE,
    KVGeometry,
    blocks_for,
)
from kvledger.engine.planner.record import KVInfo, Measured, Plan
from kvledger.engine.planner.remedies import find_remedies
from kvledger.engine.planner.run_sizes import (
    kv_layout_geometry,
    kv_rule,
    resolve_max_model_len,
    resolve_max_num_batched_tokens,
)
from kvledger.engine.planner.seats import (
    DECLARED,
    DEFAULT,
    KV_POOL,
    derive_seats,
    seat_bound,
)
from kvledger.engine.planner.sharding import check_shardable, rank_shape
from kvledger.engine.planner.stages import staged
from kvledger.engine.planner.support import check_engine_run, expert_width
from kvledger.engine.planner.weight_bytes import dequantization_bytes, loaded_weight_bytes
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.config_values import DEFAULT_MAX_NUM_SEQS


def read_checkpoint(model_dir: str, limits: ReadLimits | None = None,
                    ) -> tuple[ModelShape, WeightsInfo]:
    """The shape and weights of the checkpoint in ``model_dir``, read within ``limits``
    (kvledger's own when None). For an architecture kvledger's engine serves, whose plan is
    the engine's, BadInput too when the engine could not load it (``loadable_config``):
    ``serve`` would refuse it at start-up, so the plan must not say it fits."""
    raw = read_config_json(model_dir)
    shape = model_shape(raw)
    weights = read_weights(model_dir, limits)
    if kv_rule(shape) == ENGINE_RULE:
        loadable_config(raw, weights.tensors)
    return shape, weights


def make_plan(config: EngineConfig, *, device: DeviceMemory | None = None,
              measured: Measured | None = None, shape: ModelShape | None = None,
              weights: WeightsInfo | None = None, with_remedies: bool = True,
              source: ModelSource | None = None) -> Plan:
    """Plan ``config``. Never raises for "does not fit" (``fits`` is False, with remedies);
    raises BadInput for bad input.

    The engine passes the ``device`` it probed before loading anything (free memory
    drops once weights are loaded) and ``measured`` figures once it has them. The
    checkpoint is read (``read_checkpoint``) from ``source.path`` when given (an hf://
    model's local copy), else from ``config.model``, unless the caller gives both its
    ``shape`` and ``weights`` (a plan without files).
    """
    if shape is None or weights is None:
        read_shape, read_weights_info = read_checkpoint(
            source.path if source is not None else config.model)
        shape = shape if shape is not None else read_shape
        weights = weights if weights is not None else read_weights_info
    device = device if device is not None else probe_device(config)
    measured = measured or Measured()

    def replan(candidate: EngineConfig) -> Plan:
        return _seated_budget(candidate, device, measured, shape, weights)

    plan = dataclasses.replace(replan(config), source=source)
    if not plan.fits and with_remedies:
        plan = dataclasses.replace(plan, remedies=find_remedies(plan, replan))
    return plan


def _seated_budget(config: EngineConfig, device: DeviceMemory, measured: Measured,
                   shape: ModelShape, weights: WeightsInfo) -> Plan:
    """The budget at ``--max-num-seqs``; not given, at the seats the KV pool holds under a
    cap (``seats.py``: each candidate re-planned, its activations and CUDA graphs with
    it, so the plan returned is that of the seats it states), else at 16."""
    if config.max_num_seqs is not None:
        return _staged(config, device, measured, shape, weights, config.max_num_seqs, DECLARED)
    if not _cap_sizes_pool(config, resolve_limit(config, device)[1]):
        return _staged(config, device, measured, shape, weights, DEFAULT_MAX_NUM_SEQS, DEFAULT)
    one = _staged(config, device, measured, shape, weights, 1, KV_POOL)
    if not one.fits:  # not one full-context sequence fits: vLLM's refusal
        return one
    bound, why = seat_bound(device, one.max_num_batched_tokens, measured.max_num_seqs)

    def at(seats: int) -> Plan:
        return _staged(config, device, measured, shape, weights, seats, KV_POOL)

    seated = at(derive_seats(lambda seats: at(seats).fits, bound))
    if seated.kv.sequences <= seated.max_num_seqs:
        return seated
    # The pool holds more than the seats: the bound, or one seat more takes activation
    # memory the pool would then lack.
    return dataclasses.replace(seated, seats_note=why if seated.max_num_seqs == bound else
                               "one seat more needs activation memory the pool then lacks")


def _staged(config: EngineConfig, device: DeviceMemory, measured: Measured,
            shape: ModelShape, weights: WeightsInfo, seats: int, seats_source: str) -> Plan:
    """``_budget``, or under ``--pipeline-parallel-size`` P each stage's (``stages.py``)."""
    if config.pipeline_parallel_size == 1:
        return _budget(config, device, measured, shape, weights, seats, seats_source)
    return staged(shape, weights, config.pipeline_parallel_size, lambda s, stage, held: _budget(
        config, device, measured.of_stage(s), stage, held, seats, seats_source))


def _budget(config: EngineConfig, device: DeviceMemory, measured: Measured,
            full_shape: ModelShape, weights: WeightsInfo, seats: int, seats_source: str) -> Plan:
    """One GPU's budget at ``seats`` sequences at once; under ``--tensor-parallel-size`` N
    what one rank holds (``sharding``), where the ranks share one memory (the CPU, a
    unified pool) against 1/N of the limit."""
    tp = config.tensor_parallel_size
    check_shardable(full_shape, tp, expert_width(weights))
    shape = rank_shape(full_shape, tp)
    max_model_len = resolve_max_model_len(config, shape)
    batched_tokens = resolve_max_num_batched_tokens(config, max_model_len)
    model_dtype = resolve_model_dtype(config, shape, weights, device)
    kv_dtype = resolve_kv_dtype(config, model_dtype)
    geometry = kv_layout_geometry(shape, config, kv_dtype, max_model_len, batched_tokens)
    blocks_per_seq = geometry.blocks_per_seq
    # On the CPU's path (TORCH_SDPA) kvledger's engine gathers every decoding sequence's K
    # and V (a later prompt chunk's one sequence among them); on a GPU (TRITON_ATTN) its
    # kernels read the decodes and the later chunks in place, as vLLM's do (a what-if plan
    # for vLLM), so nothing is gathered.
    gathers = gathers_kv(attention_backend(config.attention_backend, device.kind))
    gathered_tokens = (blocks_for(max_model_len, config.block_size) * config.block_size
                       if geometry.rule == ENGINE_RULE else 0)
    gathered_sequences = seats if gathers else 0
    if geometry.rule == ENGINE_RULE:  # what kvledger's engine runs (planner/support.py)
        check_engine_run(config, full_shape, weights)

    classes = _classes(config, device, measured, full_shape, shape, weights, model_dtype,
                       kv_dtype, batched_tokens, (gathered_sequences, gathered_tokens), seats)
    limit, source, margin = resolve_limit(config, device)
    if device.kind == "cpu" or device.unified:  # N ranks in one memory: 1/N of the limit each
        limit //= tp
    non_kv = sum(classes.values())

    block_bytes = geometry.bytes_per_block
    mode, pool, needed = _pool(config, seats, blocks_per_seq, block_bytes, limit - non_kv, source)
    num_blocks = max(pool, needed)  # short of `needed`, the run needs `needed`
    classes["kv_cache"] = num_blocks * block_bytes
    required = non_kv + classes["kv_cache"]
    verdict = fits(required, limit, pool, needed, cap_above_free(limit, source, device))

    return Plan(
        fits=verdict,
        limit_bytes=limit,
        required_bytes=required,
        short_by_bytes=max(0, required - limit),
        limit_source=source,
        classes=classes,
        kv=KVInfo(block_size=config.block_size, num_blocks=num_blocks, dtype=kv_dtype,
                  pool_mode=mode, required_blocks=needed, **_geometry_fields(geometry, num_blocks)),
        remedies=[],
        unified_memory=device.unified,
        max_model_len=max_model_len,
        max_num_batched_tokens=batched_tokens,
        max_num_seqs=seats, max_num_seqs_source=seats_source,
        warnings=limit_warnings(config, device),
        device=device,
        model_dtype=model_dtype,
        config=config,
        shape=full_shape,
        weights=weights,
        margin_bytes=margin,
        measured=measured.given(),
        tensor_parallel_size=tp,
    )


def _classes(config: EngineConfig, device: DeviceMemory, measured: Measured,
             full_shape: ModelShape, shape: ModelShape, weights: WeightsInfo, model_dtype: str,
             kv_dtype: str, batched_tokens: int, gathered: tuple[int, int],
             seats: int) -> dict[str, int]:
    """Every class but the KV cache (0 here): measured where the engine measured it, else
    estimated (``estimates``, ``weight_bytes``); ``shape`` is one rank's."""
    tp = config.tensor_parallel_size
    on_cpu = device.kind == "cpu"
    dtype_bytes = estimates.DTYPE_BYTES[model_dtype]
    return {
        "weights": _pick(measured.weights_bytes, loaded_weight_bytes(
            weights, model_dtype, shape=full_shape, quantize_fp8=config.quantization == "fp8",
            tensor_parallel_size=tp)),  # planner/weight_bytes.py
        "activations": _pick(measured.activation_peak_bytes, estimates.activation_peak_bytes(
            shape, dtype_bytes, batched_tokens, seats,
            context_tokens=gathered[1], kv_dtype_bytes=estimates.DTYPE_BYTES[kv_dtype],
            gathered_sequences=gathered[0])
            + dequantization_bytes(shape, weights, model_dtype, batched_tokens,
                                   quantize_fp8=config.quantization == "fp8")
            + estimates.matmul_workspace_bytes(device.kind)),
        "kv_cache": 0,
        "cuda_graphs": 0 if config.enforce_eager or on_cpu else _pick(
            measured.cuda_graph_bytes, estimates.cuda_graph_bytes(shape, len(
                estimates.capture_sizes(seats, config.cudagraph_capture_sizes,
                                        config.max_cudagraph_capture_size)))),
        # Where the device's memory is the host's, the compiled grammars share it.
        "context": _pick(measured.context_bytes, estimates.context_bytes(device.kind)
                         + estimates.comm_buffer_bytes(device.kind,
                                                       tp * config.pipeline_parallel_size))
        + (config.grammar_cache_bytes if on_cpu or device.unified else 0),
        "lora": (model_slot_bytes(shape, config.max_loras, config.max_lora_rank, dtype_bytes)
                 if config.enable_lora else 0),  # the adapter slots
    }


def _pool(config: EngineConfig, seats: int, blocks_per_seq: int, block_bytes: int,
          room_bytes: int, source: str) -> tuple[str, int, int]:
    """(mode, blocks the pool is given, blocks the run needs): a declared pool
    (``--num-gpu-blocks-override``, ``--kv-cache-memory-bytes``) needs one whole sequence;
    under a cap the pool is all the ``room_bytes`` left; else the workload (its seats'
    ``max_model_len`` sequences)."""
    workload_blocks = seats * blocks_per_seq
    if config.num_gpu_blocks_override is not None:
        return "override", config.num_gpu_blocks_override, blocks_per_seq
    if config.kv_cache_memory_bytes is not None:
        return ("kv-cache-memory-bytes", config.kv_cache_memory_bytes // block_bytes,
                blocks_per_seq)
    if _cap_sizes_pool(config, source):
        return "cap", max(0, room_bytes // block_bytes), workload_blocks
    return "workload", workload_blocks, workload_blocks


def _cap_sizes_pool(config: EngineConfig, limit_source: str) -> bool:
    """Whether the pool is all that is left under a cap: a cap given, and no explicit pool
    (``--num-gpu-blocks-override``, ``--kv-cache-memory-bytes``), which wins over it."""
    return (limit_source != FREE_MEMORY and config.num_gpu_blocks_override is None
            and config.kv_cache_memory_bytes is None)


def _geometry_fields(geometry: KVGeometry, num_blocks: int) -> dict[str, object]:
    """KVInfo's fields that the layout's geometry (``pool.kv_layout_geometry``) gives, and
    the whole ``max_model_len`` sequences a pool of ``num_blocks`` holds."""
    return {"bytes_per_block": geometry.bytes_per_block,
            "bytes_per_token": geometry.bytes_per_token,
            "blocks_per_seq": geometry.blocks_per_seq, "layout": geometry.layout,
            "rule": geometry.rule, "note": geometry.note,
            "layers_per_block": geometry.layers_per_block,
            "bytes_per_seq": geometry.blocks_per_seq * geometry.bytes_per_block,
            "groups": geometry.groups, "sequences": num_blocks // geometry.blocks_per_seq}


def _pick(measured_value: int | None, estimate: int) -> int:
    return estimate if measured_value is None else measured_value
