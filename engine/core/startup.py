"""An engine's start-up, before it serves a token: plan on the device probed before
anything is loaded (refuse if it cannot fit) -> load the weights -> profile a prefill and
a mixed step -> re-plan with the measured figures (refuse again if that no longer fits)
-> allocate the KV pool the plan sized. ``LLMEngine.from_config`` runs it."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvledger.engine.checkpoint.hub.cache import serving_source
from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.core import sleep
from kvledger.engine.core.cpu_threads import cap_torch_threads
from kvledger.engine.core.rank_start import start_ranks
from kvledger.engine.core.runner import (
    TORCH_DTYPES,
    ModelRunner,
)
from kvledger.engine.core.start_probes import predict_start
from kvledger.engine.errors import BadInput, DoesNotFit
from kvledger.engine.kv.events import KVEventLog
from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.model import paged_attention
from kvledger.engine.model.generation_config import describe as describe_defaults
from kvledger.engine.model.loader import Weights, weights_bytes
from kvledger.engine.model.tokenizer import Tokenizer
from kvledger.engine.planner.attention import TRITON_ATTN, attention_backend
from kvledger.engine.planner.device import (
    DeviceMemory,
    probe_device,
    probe_host,
)
from kvledger.engine.planner.estimates import capture_sizes, format_size
from kvledger.engine.planner.limit import host_memory_note
from kvledger.engine.planner.plan import Measured, Plan, make_plan
from kvledger.engine.planner.report import render_report
from kvledger.engine.settings.config import EngineConfig

log = logging.getLogger("kvledger.engine")


def build(config: EngineConfig) -> tuple[Plan, Tokenizer, ModelRunner, KVLedger]:
    """The measured plan, tokenizer, model runner (KV pool allocated) and ledger of an
    engine. Raises DoesNotFit if either plan does not fit, BadInput for an unsupported
    or broken checkpoint. An hf:// model is loaded from the hub cache (``serving_source``:
    downloaded first when incomplete, unless HF_HUB_OFFLINE is set)."""
    check_stages(config)
    sleep.check(config)  # --enable-sleep-mode's limits, before anything is read
    source = serving_source(config.model, config.download_dir, hub_timeout_s=config.hub_timeout_s)
    model_config = ModelConfig.from_dir(source.path)  # refuses unsupported architectures
    # What the engine can run beyond that is the plan's verdict (planner/support.py),
    # given before anything is loaded.
    device_memory = probe_device(config)  # before loading: free memory drops after
    plan = make_plan(config, device=device_memory, source=source)
    if not plan.fits:
        raise DoesNotFit(render_report(plan), plan)
    device = torch_device(config.device)
    if reads_in_place(config, device):  # refused before anything is loaded
        paged_attention.require(device)
    if config.enable_sleep_mode and device.type == "cuda":  # level 1's host copy
        sleep.check_host(plan.classes["weights"], probe_host(
            container_limit_bytes=config.container_memory_limit_bytes))
    cap_torch_threads(torch)  # a pod's CPU limit is a quota torch does not see
    tokenizer = Tokenizer(source.path, config.generation_config,
                          config.tokenizer, config.override_generation_config)
    log.info("%s", describe_defaults(tokenizer.sampling_defaults, config.generation_config,
                                     config.override_generation_config,
                                     tokenizer.max_tokens_cap, source.path))
    planned_on = device_memory  # with --nnodes, the smallest machine's device
    ready = predict_start(config, plan, model_config, Path(source.path), device,
                          paged=reads_in_place(config, device))
    with ready.phase("read"):
        if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
            runner, planned_on = start_ranks(config, plan, source, device, device_memory,
                                              paged=reads_in_place(config, device))
        else:
            weights = Weights(source.path, model_config, TORCH_DTYPES[plan.model_dtype], device,
                              quantize_fp8=config.quantization == "fp8"
                              and not model_config.weight_format,
                              reading=config.weight_reading)
            runner = ModelRunner(weights.load(), device, plan.max_model_len,
                                 plan.kv.block_size, fuse=not config.enable_lora,
                                 paged=reads_in_place(config, device))
            runner.weights = weights  # read again on waking from sleep level 2 (core/sleep.py)
    runner.time_to_ready = ready  # the server adds its warm-up
    runner.prompt_logits = config.logprobs_mode.endswith("logits")  # rank 0's (ranks': spec)
    graphs = (config.tensor_parallel_size == config.pipeline_parallel_size == 1
              and not config.enforce_eager and not config.enable_lora
              and runner.can_use_decode_graphs())
    with ready.phase("profile"):
        if config.pipeline_parallel_size > 1:
            measured = _measure_stages(runner, plan, device, device_memory, config)
        else:
            measured = _measure(runner, plan, device, device_memory, config,
                                graphs_captured=graphs and device.type == "cuda")
    measured_plan = make_plan(config, device=planned_on, measured=measured, source=source)
    log_predicted_vs_measured(plan, measured_plan)
    if not measured_plan.fits:
        raise DoesNotFit(render_report(measured_plan), measured_plan)
    if config.enable_lora:  # the adapter slots, as the plan's lora class counts them
        lora_bytes = runner.enable_lora(config.max_loras, config.max_lora_rank)
        log.info("LoRA: %d adapter slots at rank %d (%d bytes)", config.max_loras,
                 config.max_lora_rank, lora_bytes)
    kv = measured_plan.kv
    note = host_memory_note(measured_plan.limit_bytes, measured_plan.limit_source,
                            kv.pool_mode, measured_plan.classes["kv_cache"], planned_on,
                            config.gpu_memory_utilization)
    if note is not None:  # before the allocation, which takes a while at many GiB
        log.info("%s", note)
    # With decode graphs, one block more than the ledger hands out: the padding's.
    with ready.phase("kv"):
        pool_bytes = runner.allocate_kv_cache(kv.num_blocks + (1 if graphs else 0), kv.dtype)
    if graphs:
        with ready.phase("graphs"):
            _use_decode_graphs(runner, measured_plan, capture=device.type == "cuda")
    log.info("KV pool: %d blocks x %d tokens (%d bytes), %d sequences of %d tokens; "
             "max_num_seqs %d (%s)", kv.num_blocks, kv.block_size, pool_bytes, kv.sequences,
             measured_plan.max_model_len, measured_plan.max_num_seqs,
             measured_plan.max_num_seqs_source)
    ledger = KVLedger(kv.num_blocks, kv.block_size,
                      enable_prefix_caching=config.enable_prefix_caching,
                      overcommit=config.admission == "safe", max_live=measured_plan.max_num_seqs,
                      max_adapters=config.max_loras if config.enable_lora else None,
                      events=_event_log(config, kv.block_size, model_config.sliding_window))
    log.info("%s", ready.describe())
    return measured_plan, tokenizer, runner, ledger


def _event_log(config: EngineConfig, block_size: int, window: int | None) -> KVEventLog | None:
    """Where the ledger logs KV events for the publisher (``--kv-events-config``), or None."""
    events = config.kv_events_config
    if events is None or not events.enabled:
        return None
    return KVEventLog(block_size, window, max_batches=events.max_queue_size,
                      hash_algo=config.prefix_caching_hash_algo)


def reads_in_place(config: EngineConfig, device: torch.device) -> bool:
    """Whether attention reads the KV pool in place on ``device`` (planner/attention.py)."""
    return attention_backend(config.attention_backend, device.type) == TRITON_ATTN


def _measure(runner: ModelRunner, plan: Plan, device: torch.device,
             device_memory: DeviceMemory, config: EngineConfig, *,
             graphs_captured: bool) -> Measured:
    """What the loaded model takes: its weights, a profiled step's peak, the context; the
    CUDA graphs, captured after the pool, stay the plan's (None) when there will be any."""
    return Measured(
        weights_bytes=weights_bytes(runner.model),
        activation_peak_bytes=runner.profile(plan.max_num_batched_tokens, plan.max_model_len,
                                             plan.max_num_seqs, plan.kv.dtype),
        context_bytes=context_bytes(device, device_memory, config),
        cuda_graph_bytes=None if graphs_captured else 0,
        max_num_seqs=plan.max_num_seqs,  # seats the pool decides: never more than profiled
    )


def _use_decode_graphs(runner: ModelRunner, plan: Plan, *, capture: bool) -> None:
    """Decode steps from static buffers at vLLM's capture sizes (core/decode_graphs.py),
    captured as CUDA graphs on a GPU: their bytes beside what the plan set aside."""
    config = plan.config
    sizes = capture_sizes(plan.max_num_seqs, config.cudagraph_capture_sizes,
                          config.max_cudagraph_capture_size)
    if not sizes:  # every size given is above max_num_seqs, or none was given
        return
    if capture and runner.time_to_ready is not None:  # the capture's prediction
        runner.time_to_ready.graph_sizes = len(sizes)
    runner.use_decode_graphs(sizes, capture=capture)
    if not capture:
        return
    taken, planned = runner.decode_graphs.captured_bytes, plan.classes["cuda_graphs"]
    log.log(logging.WARNING if taken > planned else logging.INFO,
            "CUDA graphs took %s, the plan set aside %s%s", format_size(taken),
            format_size(planned), " (more than planned)" if taken > planned else "")


def _measure_stages(runner, plan: Plan, device: torch.device, device_memory: DeviceMemory,
                    config: EngineConfig) -> Measured:
    """Every pipeline stage's own figures, each its fullest rank's: what each rank loaded
    and its part of a profiled step; the context rank 0's (the others' are estimated)."""
    tp = config.tensor_parallel_size
    ranks = runner.measure(plan.max_num_batched_tokens, plan.max_model_len,
                           plan.max_num_seqs, plan.kv.dtype)

    def most(stage: int, key: str) -> int | None:
        values = [getattr(r, key) for r in ranks[stage * tp:(stage + 1) * tp]
                  if getattr(r, key) is not None]
        return max(values) if values else None

    stages = tuple(Measured(
        weights_bytes=most(s, "weights_bytes"),
        activation_peak_bytes=most(s, "activation_peak_bytes"),
        context_bytes=context_bytes(device, device_memory, config) if s == 0 else None,
        cuda_graph_bytes=0, max_num_seqs=plan.max_num_seqs)
        for s in range(config.pipeline_parallel_size))
    return Measured(max_num_seqs=plan.max_num_seqs, stages=stages)


def check_stages(config: EngineConfig) -> None:
    """What the engine does not run with pipeline stages yet (BadInput, exit 2)."""
    pp = config.pipeline_parallel_size
    if pp == 1:
        return
    if config.enable_lora:
        raise BadInput(f"--pipeline-parallel-size {pp}: kvledger's engine does not serve LoRA "
                       "adapters across pipeline stages")


def torch_device(flag: str) -> torch.device:
    if flag == "cuda" or (flag == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise BadInput("--device cuda, but torch sees no CUDA device (is this a CPU build of torch?)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def context_bytes(device: torch.device, probed: DeviceMemory, config: EngineConfig) -> int | None:
    """Device memory this process took that torch's allocator does not hold (CUDA
    context, cuBLAS handles); None on the CPU, where the planner's estimate stands.

    The plan's limit is the memory free when ``probed`` was read, before this process
    touched the device, so memory already in use then (other processes; on a unified
    pool the OS and every host process) is outside the budget and must not count
    again: the context is the drop in free memory since the probe, read the same way
    (NVML, or host memory on a unified pool), less what the allocator reserves. Only a
    what-if device, which has no such reading, falls back to ``total - free - reserved``
    from ``cudaMemGetInfo``."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    reserved = torch.cuda.memory_reserved(device)
    if probed.kind == "cuda":
        now = probe_device(config)
        if now.kind == "cuda":
            return max(0, probed.free_bytes - now.free_bytes - reserved)
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - reserved)


def log_predicted_vs_measured(predicted: Plan, measured: Plan) -> None:
    for name, before in predicted.classes.items():
        after = measured.classes[name]
        source = "measured" if name in measured.measured else "estimated"
        log.info("memory %-11s predicted %12d  %s %12d  (%+d)", name, before, source, after,
                 after - before)
