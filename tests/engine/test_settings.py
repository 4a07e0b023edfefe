"""Every EngineConfig field is declared once (engine/settings/declare.py): its flag, its kind, its
help and its CRD field; the flags are generated from those declarations."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.config_flags import add_engine_flags
from kvledger.engine.settings.declare import settings_of

# field -> (its flag, spec.SECTION.NAME): a new field must be added here, on purpose.
DECLARED = {
    "model": ("--model", None),  # spec.model.path or .uri, mapped by operator/api/spec.py
    "hub_timeout_s": ("--hub-timeout", None),
    "download_dir": ("--download-dir", None),
    "safetensors_load_strategy": ("--safetensors-load-strategy",
                                  "engine.safetensorsLoadStrategy"),
    "safetensors_prefetch_num_threads": ("--safetensors-prefetch-num-threads", None),
    "safetensors_prefetch_block_size": ("--safetensors-prefetch-block-size", None),
    "served_model_name": ("--served-model-name", None),  # spec.model.name
    "served_model_aliases": (None, None),  # the rest of --served-model-name's names
    "max_model_len": ("--max-model-len", "engine.maxModelLen"),
    "max_num_seqs": ("--max-num-seqs", "engine.maxNumSeqs"),
    "max_num_batched_tokens": ("--max-num-batched-tokens", "engine.maxNumBatchedTokens"),
    "block_size": ("--block-size", "engine.blockSize"),
    "dtype": ("--dtype", "engine.dtype"),
    "kv_cache_dtype": ("--kv-cache-dtype", "engine.kvCacheDtype"),
    "tensor_parallel_size": ("--tensor-parallel-size", None),  # from spec.gpus
    "pipeline_parallel_size": ("--pipeline-parallel-size", "engine.pipelineParallelSize"),
    "nodes": (None, None),  # serve's --nnodes ... (engine/settings/node_config.py), not a setting's flag
    "enforce_eager": ("--enforce-eager", "engine.enforceEager"),
    "cudagraph_capture_sizes": ("--cudagraph-capture-sizes", None),
    "max_cudagraph_capture_size": ("--max-cudagraph-capture-size", None),
    "attention_backend": ("--attention-backend", None),  # the device's default in a pod
    "enable_prefix_caching": ("--enable-prefix-caching", "engine.enablePrefixCaching"),
    "enable_sleep_mode": ("--enable-sleep-mode", "engine.enableSleepMode"),
    "prefix_caching_hash_algo": ("--prefix-caching-hash-algo", None),
    "kv_events_config": ("--kv-events-config", None),
    "quantization": ("--quantization", "engine.quantization"),
    "admission": ("--admission", "engine.admission"),
    "scheduling_policy": ("--scheduling-policy", "engine.schedulingPolicy"),
    "priority_headroom": ("--priority-headroom", "engine.priorityHeadroom"),
    "headroom_priority": ("--headroom-priority", "engine.headroomPriority"),
    "memory_limit_bytes": ("--memory-limit", "memory.limit"),
    "gpu_memory_utilization": ("--gpu-memory-utilization", "memory.gpuMemoryUtilization"),
    "num_gpu_blocks_override": ("--num-gpu-blocks-override", "memory.numGpuBlocksOverride"),
    "kv_cache_memory_bytes": ("--kv-cache-memory-bytes", "memory.kvCacheMemoryBytes"),
    "device": ("--device", None),  # from spec.gpus
    "device_memory_bytes": ("--device-memory", None),
    "device_free_bytes": ("--device-free", None),
    "unified_memory": ("--unified-memory", None),
    "container_memory_limit_bytes": ("--container-memory-limit", None),  # spec.resources
    "seed": ("--seed", "engine.seed"),
    "logprobs_mode": ("--logprobs-mode", "engine.logprobsMode"),
    "generation_config": ("--generation-config", "engine.generationConfig"),
    "override_generation_config": ("--override-generation-config", None),
    "tokenizer": ("--tokenizer", None),
    "grammar_cache_bytes": ("--grammar-cache-bytes", None),
    "enable_lora": ("--enable-lora", "engine.enableLora"),
    "lora_modules": ("--lora-modules", None),  # from spec.adapters
    "max_loras": ("--max-loras", "engine.maxLoras"),
    "max_lora_rank": ("--max-lora-rank", "engine.maxLoraRank"),
    "max_cpu_loras": ("--max-cpu-loras", "engine.maxCpuLoras"),
}


def test_every_field_is_declared_with_its_flag_and_crd_field() -> None:
    declared = {f.name: (s.flag, s.crd and f"{s.crd.section}.{s.spec_name}")
                for f, s in settings_of(EngineConfig)}
    assert declared == DECLARED


def test_a_field_declared_without_setting_is_refused_by_the_generators() -> None:
    @dataclass(frozen=True)
    class Undeclared(EngineConfig):
        widgets: int = field(default=1)

    with pytest.raises(TypeError, match=r"Undeclared\.widgets is not declared with setting"):
        add_engine_flags(argparse.ArgumentParser(), Undeclared)
    with pytest.raises(TypeError, match="not declared"):
        Undeclared(model="/m")


def test_every_flag_has_a_help_line_and_its_field_as_dest() -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "model_tag")}
    flagged = {name for name, (flag, _) in DECLARED.items() if flag is not None}
    assert set(actions) == flagged
    assert all(a.help for a in actions.values())
    assert actions["memory_limit_bytes"].option_strings == ["--memory-limit"]
    assert actions["quantization"].option_strings == ["--quantization", "-q"]


def test_help_lists_the_groups_in_order() -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    text = parser.format_help()
    titles = ["model and workload:", "memory caps (the smallest one given wins):",
              "device (what-if planning without the card):", "LoRA adapters (vLLM's flags):"]
    assert [text.index(t) for t in titles] == sorted(text.index(t) for t in titles)
    assert text.index("--hub-timeout") < text.index("--max-model-len") < text.index("--seed")
