"""The text of ``kvledger plan``: the breakdown per class, and on a refusal how far short
and the remedies. Sizes are GiB with one decimal; a non-zero size under 0.1 GiB is shown
in MiB (under 0.1 MiB in KiB) so that small models do not read as all zeros.
"""

from __future__ import annotations

from kvledger.engine.checkpoint.layout import MLA, SLIDING
from kvledger.engine.checkpoint.weight_formats import run_format
from kvledger.engine.planner.dtypes import half_precision_note
from kvledger.engine.planner.estimates import (
    NCCL_BYTES_PER_RANK,
    MiB,
    comm_buffer_bytes,
    format_size,
)
from kvledger.engine.planner.limit import largest_utilization
from kvledger.engine.planner.pool import ENGINE_NOTE, ENGINE_RULE, PoolGroup
from kvledger.engine.planner.record import Plan, Remedy
from kvledger.engine.planner.seats import KV_POOL
from kvledger.engine.planner.stages import layers_text, stage_lines, stage_name

SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
               "fp8_e4m3": "fp8", "fp8_e5m2": "fp8_e5m2"}


def render_report(plan: Plan) -> str:
    """The whole report: headline, breakdown, remedies (refusal), limit, warnings."""
    lines = [_headline(plan)]
    lines += _breakdown(plan)
    if not plan.fits:
        lines += _remedy_lines(plan)
    lines.append(_limit_line(plan))
    ready = plan.time_to_ready.plan_text() if plan.time_to_ready is not None else None
    if ready is not None and plan.fits:  # a refused run never starts
        lines.append(ready)
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines) + "\n"


def _headline(plan: Plan) -> str:
    need, limit = format_size(plan.required_bytes), format_size(plan.limit_bytes)
    tp, pp = plan.tensor_parallel_size, plan.pipeline_parallel_size
    if pp > 1:  # every figure is one GPU's of the stage that decides
        gpus = f"{tp} GPUs" if tp > 1 else "1 GPU"
        need = (f"{need} per GPU on {stage_name(plan, plan.stage)}, x {gpus} x {pp} stages "
                f"(--tensor-parallel-size {tp} --pipeline-parallel-size {pp})")
        limit += " per GPU"
    elif tp > 1:  # every figure is one rank's; ranks sharing one memory have 1/N of the limit
        shared = plan.device.kind == "cpu" or plan.unified_memory
        each, ranks = ("per rank", "ranks sharing one memory") if shared else ("per GPU", "GPUs")
        need = (f"{need} {each}, x {tp} {ranks} ({format_size(plan.required_bytes * tp)} "
                f"in all, --tensor-parallel-size {tp})")
        limit += f" {each}"
    if plan.fits:
        spare = format_size(plan.limit_bytes - plan.required_bytes)
        return f"fits: engine requires {need}, limit is {limit} ({spare} to spare)"
    if plan.short_by_bytes > 0:  # the run itself does not fit: that comes first
        also = (f"; the limit is also more than the device's free memory "
                f"({format_size(plan.device.free_bytes)})" if plan.cap_above_free else "")
        return (f"error: engine requires {need}, limit is {limit} "
                f"(short by {format_size(plan.short_by_bytes)}){also}")
    if plan.cap_above_free:
        return _cap_headline(plan)
    # Within the limit, yet refused: a pool smaller than what it must hold.
    kv = plan.kv
    if kv.pool_mode not in ("override", "kv-cache-memory-bytes"):
        return (f"error: the KV pool of {kv.num_blocks} blocks cannot hold the declared "
                f"workload's {kv.required_blocks} blocks")
    source, pool = _explicit_pool(plan)
    return (f"error: the KV pool of {pool} blocks ({source}) cannot hold one "
            f"max_model_len={plan.max_model_len} sequence ({kv.required_blocks} blocks of "
            f"{kv.block_size} tokens)")


def _cap_headline(plan: Plan) -> str:
    """A cap above free memory: the cap, the free memory, and the largest utilization
    within it (vLLM refuses such a cap at start-up too)."""
    d = plan.device
    free = format_size(d.free_bytes)
    refused = "the engine cannot allocate it"
    if plan.limit_source == "--gpu-memory-utilization":
        cap = (f"--gpu-memory-utilization {plan.config.gpu_memory_utilization} x "
               f"{format_size(d.total_bytes)} = {format_size(plan.limit_bytes)}")
        refused += ", and vLLM refuses to start"
    else:
        cap = f"--memory-limit {format_size(plan.limit_bytes)}"
    util = largest_utilization(d)
    fitting = (f"the largest --gpu-memory-utilization within it is {util:g}" if util
               else "no --gpu-memory-utilization is within it")
    return (f"error: the limit ({cap}) is more than the device's free memory ({free}): "
            f"{refused}; {fitting} ({free} free of {format_size(d.total_bytes)})")


def _explicit_pool(plan: Plan) -> tuple[str, int]:
    """The flag that sized the pool explicitly, and the blocks it gives."""
    if plan.kv.pool_mode == "override":
        return "--num-gpu-blocks-override", plan.config.num_gpu_blocks_override
    return "--kv-cache-memory-bytes", plan.config.kv_cache_memory_bytes // plan.kv.bytes_per_block


def _row(label: str, size: int, detail: str = "") -> str:
    row = f"  {label:<16}{format_size(size):>9}"
    return f"{row}   ({detail})" if detail else row


def _breakdown(plan: Plan) -> list[str]:
    c, kv, cfg = plan.classes, plan.kv, plan.config
    measured = set(plan.measured)
    weights_dtype = SHORT_DTYPE.get(plan.model_dtype, plan.model_dtype)
    served = run_format(plan.shape, plan.weights, cfg.quantization == "fp8")
    if served is not None:
        how = plan.shape.quantization or f"--quantization {served.name}"
        weights_dtype = f"{how}: {served.label}, the rest {weights_dtype}"
    elif plan.weights.dtype not in ("BF16", "F16", "F32", "F64"):
        weights_dtype = plan.weights.dtype.lower()  # a quantized payload keeps its own dtype
        if plan.shape.quantization:  # e.g. "mxfp4 (u8)": MXFP4 blocks and scales are U8
            weights_dtype = f"{plan.shape.quantization} ({weights_dtype})"
    kv_dtype = SHORT_DTYPE.get(kv.dtype, kv.dtype)
    kv_detail = _kv_detail(plan, kv_dtype)
    if cfg.enforce_eager:
        graphs_detail = "--enforce-eager"
    elif plan.device.kind == "cpu":
        graphs_detail = "none on the CPU"
    else:
        graphs_detail = "measured" if "cuda_graphs" in measured else "estimate"
    context_label = "runtime context" if plan.device.kind == "cpu" else "cuda context"
    if kv.layout != "full":
        kv_detail += f", {kv.layout}"
    lines = [
        _row("weights", c["weights"], ("measured, " if "weights" in measured else "")
             + f"{weights_dtype}, {layers_text(plan)}"),
        _row("activations", c["activations"], ("measured " if "activations" in measured else "")
             + f"peak @ max_num_batched_tokens={plan.max_num_batched_tokens}"),
        _row("KV cache", c["kv_cache"], kv_detail),
        _row("cuda graphs", c["cuda_graphs"], graphs_detail),
        _row(context_label, c["context"], ("measured" if "context" in measured else "estimate")
             + (f" + NCCL buffers {NCCL_BYTES_PER_RANK // MiB} MiB"
                if comm_buffer_bytes(plan.device.kind, plan.tensor_parallel_size
                                     * plan.pipeline_parallel_size) else "")
             + (f" + grammar cache {cfg.grammar_cache_bytes / 2**20:.0f} MiB"
                if plan.device.kind == "cpu" or plan.device.unified else "")),
        *([_row("LoRA adapters", c["lora"], f"{cfg.max_loras} slots x rank "
                f"{cfg.max_lora_rank}, every projection of {plan.shape.num_layers} layers")]
          if cfg.enable_lora else []),
        f"  KV pool: {kv.num_blocks} blocks x {kv.block_size} tokens, "
        f"{format_size(kv.bytes_per_block)} per block ({_pool_holds(plan)})",
        *stage_lines(plan),
        *_seats_lines(plan),
    ]
    if kv.rule != ENGINE_RULE or kv.note != ENGINE_NOTE:
        lines.append(f"  KV layout: {_layout_text(plan)}")
    dtype_note = half_precision_note(cfg, plan.shape, plan.weights, plan.model_dtype)
    if dtype_note:
        lines.append(f"  dtype: {dtype_note}")
    return lines


def _kv_detail(plan: Plan, kv_dtype: str) -> str:
    """The KV cache row's detail: the pool's blocks and what they hold, or on a refusal
    what the run needs of it."""
    kv = plan.kv
    workload = f"max_model_len={plan.max_model_len} x max_num_seqs={plan.max_num_seqs}"
    if plan.max_num_seqs_source == KV_POOL:  # the pool decides the seats: it must hold one
        workload = f"one max_model_len={plan.max_model_len} sequence at least"
    if kv.pool_mode == "cap" and plan.fits:
        held = (_sequences(plan) if plan.max_num_seqs_source == KV_POOL
                else f"{workload} needs {kv.required_blocks} blocks")
        return f"{kv.num_blocks} blocks, all left under the cap, {kv_dtype}; {held}"
    if kv.pool_mode in ("cap", "workload"):  # refused under a cap: what the workload needs
        return f"{workload}, {kv_dtype}"
    flag, pool = _explicit_pool(plan)
    if pool < kv.required_blocks:  # refused: the row and the pool line show what it needs
        return (f"{kv.required_blocks} blocks for one max_model_len sequence; {flag} "
                f"gives {pool}, {kv_dtype}")
    return f"{pool} blocks from {flag}, {kv_dtype}"


def _sequences(plan: Plan) -> str:
    return (f"holds {plan.kv.sequences} sequence{'s' if plan.kv.sequences != 1 else ''} of "
            f"{plan.max_model_len} tokens")


def _seats_lines(plan: Plan) -> list[str]:
    """With --max-num-seqs not given under a cap: the seats the pool decided (seats.py)."""
    if plan.max_num_seqs_source != KV_POOL:
        return []
    if not plan.fits:
        return [f"  concurrency: --max-num-seqs not given: the KV pool left under the cap must "
                f"hold one sequence of {plan.max_model_len} tokens"]
    bounded = f"; {plan.seats_note}" if plan.seats_note else ""
    return [f"  concurrency: KV pool {_sequences(plan)}: max_num_seqs {plan.max_num_seqs} "
            f"(--max-num-seqs not given{bounded})"]


def _pool_holds(plan: Plan) -> str:
    """What the pool holds: tokens of every layer, or blocks shared by layer groups."""
    kv = plan.kv
    tables = sum(g.num_groups for g in kv.groups)
    if tables <= 1:
        return f"{kv.num_blocks * kv.block_size} tokens"
    return (f"{tables} block tables of {kv.layers_per_block} layers share it; one "
            f"max_model_len sequence takes {kv.blocks_per_seq} blocks")


def _group_text(group: PoolGroup, block_size: int, step_tokens: int) -> str:
    if group.attention == MLA:
        what = f"{group.num_layers} MLA layers x {group.head_size}-element latent (K only)"
    else:
        kind = "sliding-window" if group.attention == SLIDING else "full-attention"
        what = (f"{group.num_layers} {kind} layers x {group.num_kv_heads} KV heads x "
                f"{group.head_size}")
    if group.attention == SLIDING:  # vLLM keeps the window and a step's new tokens
        per_table = group.blocks_per_seq // group.num_groups
        where = f" in each of {group.num_groups} block tables" if group.num_groups > 1 else ""
        what += (f", window {group.sliding_window} + a step of {step_tokens} tokens "
                 f"({per_table} blocks of {block_size} per sequence{where})")
    return what


def _layout_text(plan: Plan) -> str:
    """The layout as allocated, its layer groups, per-token bytes and the rule applied."""
    kv = plan.kv
    groups = " + ".join(_group_text(g, kv.block_size, plan.max_num_batched_tokens)
                        for g in kv.groups)
    return f"{kv.layout}: {groups}, {kv.bytes_per_token} bytes per token; {kv.note}"


def remedy_text(remedy: Remedy) -> tuple[str, str]:
    """``(what to change, what it gives)`` of one remedy."""
    change = remedy.flag if remedy.value is None else f"{remedy.flag} {remedy.value}"
    change += "".join(f" {flag} {value}" for flag, value in remedy.also)
    result = f"KV -> {format_size(remedy.kv_bytes)}"
    return change, f"{remedy.note}, {result}" if remedy.note else result


def _remedy_lines(plan: Plan) -> list[str]:
    # Under a cap above free memory, what the remedies aim at is the free memory.
    target = plan.device.free_bytes if plan.cap_above_free else plan.limit_bytes
    limit = format_size(target)
    if not plan.remedies:
        if plan.classes["weights"] > target:
            why = f"the weights alone are {format_size(plan.classes['weights'])}"
        else:  # the declared run, not a pool that fills a cap above free memory
            declared = (plan.required_bytes - plan.classes["kv_cache"]
                        + plan.kv.required_blocks * plan.kv.bytes_per_block)
            why = f"as declared it needs {format_size(declared)}"
        return [f"  no single change of flags fits within {limit}: {why}"]
    lines = [f"  to fit within {limit}, try one of:"]
    for remedy in plan.remedies:
        change, result = remedy_text(remedy)
        lines.append(f"    {change:<25} ({result})")  # a long flag still gets its space
    return lines


def _limit_line(plan: Plan) -> str:
    d = plan.device
    pool = ", unified pool" if d.unified else ""
    where = f"{d.name}, {format_size(d.total_bytes)} total, {format_size(d.free_bytes)} free{pool}"
    if plan.limit_source == "free-memory":
        return (f"  limit: free memory less a {format_size(plan.margin_bytes)} safety margin "
                f"({where})")
    if plan.limit_source == "--gpu-memory-utilization":
        return (f"  limit: --gpu-memory-utilization {plan.config.gpu_memory_utilization} x "
                f"{format_size(d.total_bytes)} ({where})")
    return f"  limit: {plan.limit_source} {format_size(plan.limit_bytes)} ({where})"
