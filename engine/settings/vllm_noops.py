"""The ``vllm serve`` flags that change nothing in what kvledger answers or plans, each
with why, its value checked as vLLM's argparse checks it: knobs that act only with a
feature kvledger refuses, that tune a kind of model or input kvledger does not serve
(Mamba layers, images and audio), or that tune vLLM's own internals. Part of ``RULES``
(``vllm_rules.py``).
"""

from __future__ import annotations

from kvledger.engine.errors import BadInput, clip
from kvledger.engine.settings.flag_values import (
    json_object,
    optional_float,
    optional_int,
    optional_json_object,
    optional_text,
)
from kvledger.engine.settings.vllm_rule import Rule, alone, noop, only

_DP = alone("--data-parallel-size above 1")
_DCP = alone("a context-parallel size above 1")
_EP = alone("--enable-expert-parallel")
_DP_SUPERVISOR = alone("--data-parallel-multi-port-external-lb")
_OFFLOAD = alone("--offload-group-size above 0")
# kvledger serves text: it reads no image, video or audio and runs no encoder for them,
# so vLLM's knobs for those change nothing (vLLM ignores them for a text model too).
_MEDIA = "kvledger takes text only: it reads no image, video or audio"
_ENCODER = "kvledger runs no vision or audio encoder: it takes text only"
# vLLM's knobs for kinds of layers no model kvledger serves or plans has.
_MAMBA = "tunes Mamba (state-space) layers; kvledger serves no model with them"
_LINEAR_ATTN = "picks a kernel for {} layers; kvledger serves no model with them"
_OWN_KERNELS = "kvledger runs its own"


def text_only(text: str) -> dict:
    """--limit-mm-per-prompt: a JSON object whose every modality is 0 (``{"image": 0}``, or
    ``{"image": {"count": 0}}``): text only, what kvledger serves; BadInput otherwise."""
    limits = json_object(text)
    counts = [v.get("count") if isinstance(v, dict) else v for v in limits.values()]
    if limits and all(count == 0 and not isinstance(count, bool) for count in counts):
        return limits
    raise BadInput(f"--limit-mm-per-prompt {clip(text)}: kvledger does not support "
                   "multimodal inputs: it serves text (only every modality at 0)")


NOOPS: dict[str, Rule] = {
    # Gone from vLLM, or ignored by vLLM 0.32 itself.
    "--num-scheduler-steps": noop("vLLM's V0 multi-step scheduling, gone since its V1 "
                                  "engine; it changed no answer", nargs=1, parse=int),
    "--max-seq-len-to-capture": noop("vLLM's V0 CUDA graph limit, removed in 0.11; CUDA "
                                     "graphs are per batch size (--cudagraph-capture-sizes)",
                                     nargs=1, parse=int),
    "--max-parallel-loading-workers": noop("vLLM 0.32 ignores it (it warns so)", nargs=1,
                                           parse=optional_int),
    "--show-hidden-metrics-for-version": noop("vLLM 0.32 hides no metric for it to show",
                                              nargs=1, parse=optional_text),
    # Tuning of data, context and expert parallelism, which kvledger runs at 1.
    "--data-parallel-address": noop(_DP, nargs=1),
    "--data-parallel-rpc-port": noop(_DP, nargs=1, parse=int),
    "--data-parallel-backend": noop(_DP, nargs=1),
    "--dp-sync-interval": noop(_DP, nargs=1, parse=int),
    "--prefill-schedule-interval": noop(_DP, nargs=1, parse=int),
    "--disable-nccl-for-dp-synchronization": noop(_DP),
    "--aggregate-engine-logging": noop(_DP),
    "--data-parallel-supervisor-port": noop(_DP_SUPERVISOR, nargs=1, parse=int),
    "--dp-supervisor-probe-interval-s": noop(_DP_SUPERVISOR, nargs=1, parse=float),
    "--dp-supervisor-probe-timeout-s": noop(_DP_SUPERVISOR, nargs=1, parse=float),
    "--dp-supervisor-probe-failure-threshold": noop(_DP_SUPERVISOR, nargs=1, parse=int),
    "--dcp-comm-backend": noop(_DCP, nargs=1, choices=("a2a", "ag_rs")),
    "--dcp-kv-cache-interleave-size": noop(_DCP, nargs=1, parse=int),
    "--cp-kv-cache-interleave-size": noop(_DCP, nargs=1, parse=int),
    "--dcp-q-replicate": noop(_DCP),
    "--all2all-backend": noop(_EP, nargs=1, choices=(
        "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency",
        "deepep_v2", "flashinfer_all2allv", "flashinfer_nvlink_one_sided",
        "flashinfer_nvlink_two_sided", "moonep", "mori_high_throughput", "mori_low_latency",
        "naive", "nixl_ep", "pplx")),
    "--expert-placement-strategy": noop(_EP, nargs=1, choices=("linear", "round_robin")),
    "--enable-ep-weight-filter": noop(_EP),
    "--eplb-config": noop(alone("--enable-eplb"), nargs=1, parse=json_object),
    "--elastic-ep-max-dp-size": noop(alone("--enable-elastic-ep"), nargs=1, parse=int),
    "--dbo-decode-token-threshold": noop(alone("--enable-dbo"), nargs=1, parse=int),
    "--dbo-prefill-token-threshold": noop(alone("--enable-dbo"), nargs=1, parse=int),
    "--ubatch-size": only(["0", "1"], "splitting a step into micro-batches",
                          "0 and 1 run each step whole, as kvledger does"),
    "--fault-tolerance-config": noop(alone("--enable-fault-tolerance"), nargs=1,
                                     parse=json_object),
    "--ray-workers-use-nsight": noop(alone("--distributed-executor-backend ray")),
    # Weight offloading, which kvledger refuses (--cpu-offload-gb above 0).
    "--offload-group-size": only(["0"], "offloading weights to the host",
                                 "0 keeps every weight on the device, as kvledger does"),
    "--offload-num-in-group": noop(_OFFLOAD, nargs=1, parse=int),
    "--offload-prefetch-step": noop(_OFFLOAD, nargs=1, parse=int),
    "--offload-params": noop(_OFFLOAD, nargs="+"),
    "--cpu-offload-params": noop(alone("--cpu-offload-gb above 0"), nargs="+"),
    "--offload-backend": noop("with no weight offloaded, as kvledger requires, it picks "
                              "nothing", nargs=1, choices=("auto", "prefetch", "uva")),
    "--kv-offloading-backend": noop(alone("--kv-offloading-size"), nargs=1,
                                    choices=("lmcache", "native")),
    # Text only: every modality at 0 is what kvledger serves; the rest tune what it lacks.
    "--limit-mm-per-prompt": noop("every modality at 0 asks for text only, what kvledger "
                                  "serves; any other limit is refused", nargs=1,
                                  parse=text_only),
    "--language-model-only": noop("text only is what kvledger serves"),
    "--no-language-model-only": noop("vLLM's default; kvledger still serves text only"),
    "--allowed-local-media-path": noop(_MEDIA, nargs=1),
    "--allowed-media-domains": noop(_MEDIA, nargs="+"),
    "--media-io-kwargs": noop(_MEDIA, nargs=1, parse=json_object),
    "--mm-processor-kwargs": noop(_MEDIA, nargs=1, parse=optional_json_object),
    "--trust-request-mm-kwargs": noop(_MEDIA),
    "--mm-processor-cache-gb": noop(_MEDIA, nargs=1, parse=float),
    "--mm-processor-cache-type": noop(_MEDIA, nargs=1, choices=("lru", "shm")),
    "--mm-shm-cache-max-object-size-mb": noop(_MEDIA, nargs=1, parse=int),
    "--mm-hasher-algorithm": noop(_MEDIA, nargs=1, choices=("blake3", "sha256", "sha512")),
    "--mm-processor-device": noop(_MEDIA, nargs=1, choices=("auto", "cpu")),
    "--mm-device-do-normalize": noop(_MEDIA),
    "--mm-tensor-ipc": noop(_MEDIA, nargs=1, choices=("direct_rpc", "torch_shm")),
    "--mm-ipc-gpu-memory-gb": noop(_MEDIA + "; it plans no memory for them", nargs=1,
                                   parse=float),
    "--enable-shm-tensor-arena": noop(_MEDIA + " to pass between processes"),
    "--interleave-mm-strings": noop(_MEDIA),
    "--disable-chunked-mm-input": noop(_MEDIA),
    "--skip-mm-profiling": noop(_MEDIA + "; it plans no memory for them"),
    "--video-pruning-rate": noop(_MEDIA, nargs=1, parse=optional_float),
    "--video-pruning-method": noop(_MEDIA, nargs=1, choices=("evs", "vidcom2")),
    "--default-mm-loras": noop(_MEDIA + ", so no adapter is picked by one", nargs=1,
                               parse=optional_json_object),
    "--mm-encoder-tp-mode": noop(_ENCODER, nargs=1, choices=("data", "weights")),
    "--mm-encoder-attn-backend": noop(_ENCODER, nargs=1),
    "--mm-encoder-attn-dtype": noop(_ENCODER, nargs=1, choices=("fp8",)),
    "--mm-encoder-fp8-scale-path": noop(_ENCODER, nargs=1),
    "--mm-encoder-fp8-scale-save-path": noop(_ENCODER, nargs=1),
    "--mm-encoder-fp8-scale-save-margin": noop(_ENCODER, nargs=1, parse=float),
    # Kinds of layers and models kvledger does not serve.
    "--mamba-backend": noop(_MAMBA, nargs=1),
    "--mamba-ssu-algorithm": noop(_MAMBA, nargs=1,
                                  choices=("auto", "horizontal", "simple", "vertical")),
    "--mamba-cache-dtype": noop(_MAMBA, nargs=1,
                                choices=("auto", "bfloat16", "float16", "float32")),
    "--mamba-ssm-cache-dtype": noop(_MAMBA, nargs=1,
                                    choices=("auto", "bfloat16", "float16", "float32")),
    "--mamba-block-size": noop(_MAMBA, nargs=1, parse=optional_int),
    "--mamba-cache-mode": noop(_MAMBA, nargs=1, choices=("align", "none")),
    "--mamba-cache-philox-rounds": noop(_MAMBA, nargs=1, parse=int),
    "--enable-mamba-cache-stochastic-rounding": noop(_MAMBA),
    "--enable-mamba-shared-prefix-checkpoint": noop(_MAMBA),
    "--use-replayssm": noop(_MAMBA),
    "--replayssm-buffer-len": noop(_MAMBA, nargs=1, parse=int),
    "--gdn-prefill-backend": noop(_LINEAR_ATTN.format("gated delta net (Qwen3-Next)"),
                                  nargs=1,
                                  choices=("flashinfer", "triton", "cutedsl", "aiter_flydsl")),
    "--kda-prefill-backend": noop(_LINEAR_ATTN.format("Kimi delta attention"), nargs=1,
                                  choices=("auto", "triton", "flashkda", "flashinfer",
                                           "fused")),
    "--kda-decode-backend": noop(_LINEAR_ATTN.format("Kimi delta attention"), nargs=1,
                                 choices=("auto", "native", "flashinfer", "triton")),
    "--sparse-indexer-topk-backend": noop(
        _LINEAR_ATTN.format("DeepSeek-V3.2's sparse attention"), nargs=1,
        choices=("aiter", "auto", "cooperative", "deep_select", "flashinfer", "per_row",
                 "persistent", "torch")),
    "--swa-bounded-replay": noop("tunes DeepSeek-V4.1's sliding window; kvledger does not "
                                 "serve it"),
    "--kv-sharing-fast-prefill": noop("a prefill shortcut for models whose layers share KV "
                                      "(Gemma 3n); kvledger serves none"),
    "--enable-hc-sp": noop("HyperConnection sequence parallelism, for Qwen4Exp; kvledger "
                           "does not serve it"),
    "--engram-config": noop("tunes Engram (n-gram embedding) models; kvledger serves none",
                            nargs=1, parse=optional_json_object),
    "--enable-flash-late-interaction": noop("tunes pooling models' scoring; kvledger "
                                            "generates text"),
    "--max-lora-cls-labels": noop("LoRA classification heads, for pooling models; kvledger "
                                  "generates text", nargs=1, parse=optional_int),
    # vLLM's internals: how fast vLLM runs, never what it answers or what kvledger plans.
    "--async-scheduling": noop("how vLLM overlaps scheduling with a step on the GPU; "
                               "answers and the plan do not depend on it"),
    "--renderer-num-workers": noop("the threads vLLM's API server renders prompts in; "
                                   "answers and the plan do not depend on them", nargs=1,
                                   parse=int),
    "--enable-flashinfer-autotune": noop("kvledger runs no FlashInfer kernel to tune"),
    "--specialize-active-lora": noop("vLLM's CUDA graphs per count of active adapters; "
                                     "answers and the plan do not depend on them"),
    "--fully-sharded-loras": noop("how vLLM splits LoRA's work across tensor-parallel GPUs; "
                                  "answers and the plan do not depend on it"),
    "--enable-mixed-moe-lora-format": noop("lays out LoRA for MoE experts; kvledger adapts "
                                           "no expert and refuses an adapter that does"),
    "--enable-moe-shared-loras": noop("lays out LoRA for MoE experts; kvledger adapts no "
                                      "expert and refuses an adapter that does"),
    "--enable-tower-connector-lora": noop("LoRA on a vision tower; kvledger runs none and "
                                          "refuses an adapter that adapts one"),
    "--prefix-match-unit": noop("where vLLM's prefix-cache hits may end; kvledger's end at a "
                                "block, and answers and the plan do not depend on it",
                                nargs=1, parse=optional_int),
    "--prefix-cache-retention-interval": noop(
        "tunes vLLM's prefix cache of sliding-window and Mamba layers; kvledger's engine "
        "keeps every layer's whole context", nargs=1, parse=optional_int),
    "--enable-cumem-allocator": noop("vLLM's CUDA allocator; kvledger allocates with "
                                     "torch's, its sleep mode included"),
    "--sleep-mode-offload-cudagraph": noop("kvledger drops its decode graphs on sleep and "
                                           "captures them again on wake"),
    "--enable-nccl-comm-suspend": noop("kvledger's sleep mode runs one process, which holds "
                                       "no NCCL communicator"),
    "--moe-backend": only(["auto"], "choosing vLLM's MoE kernels", _OWN_KERNELS),
    "--linear-backend": only(["auto"], "choosing vLLM's linear kernels", _OWN_KERNELS),
    "--performance-mode": only(["balanced"], "vLLM's other performance modes",
                               "kvledger has one, tuned by --max-num-seqs, "
                               "--max-num-batched-tokens and --cudagraph-capture-sizes"),
    "--jit-monitor-mode": only(["warn"], "failing a step that compiles a kernel after "
                               "warm-up", "a warning changes no answer"),
    "--jit-monitor-verbose": noop("details of vLLM's warnings about kernels compiled after "
                                  "warm-up"),
    # Tuning of what kvledger refuses, or of endpoints it does not serve.
    "--long-prefill-token-threshold-adaptive": noop(alone(
        "--long-prefill-token-threshold above 0")),
    "--fingerprint-value": noop(alone("--fingerprint-mode custom"), nargs=1,
                                parse=optional_text),
    "--enable-log-deltas": noop(alone("--enable-log-outputs")),
    "--collect-detailed-traces": noop(alone("--otlp-traces-endpoint"), nargs="+",
                                      choices=("all", "model", "worker")),
    "--kv-cache-metrics-sample": noop(alone("--kv-cache-metrics"), nargs=1, parse=float),
    "--per-request-spec-decode-metrics": noop(alone("--speculative-config"), nargs=1,
                                              choices=("detailed", "none", "summary")),
    "--cohere-format": noop(alone("--tokenizer-mode cohere"), nargs=1),
    "--cohere-is-reasoning-model": noop("shapes vLLM's /cohere/v2/chat, which kvledger does "
                                        "not serve"),
    "--anthropic-disabled-thinking-effort": noop(
        "tunes vLLM's Anthropic /v1/messages, which kvledger does not serve", nargs=1,
        choices=("auto", "high", "low", "max", "medium", "none", "xhigh")),
    # The model's files.
    "--code-revision": noop("kvledger never runs a checkpoint's code", nargs=1,
                            parse=optional_text),
    "--pt-load-map-location": noop("kvledger loads safetensors only, never a PyTorch .pt "
                                   "checkpoint", nargs=1),
    "--ignore-patterns": noop("kvledger downloads only the files it reads (config.json, "
                              "the tokenizer, the safetensors)", nargs="+"),
    "--allow-deprecated-quantization": noop("kvledger refuses by name every quantization "
                                            "method it does not serve, deprecated or not"),
    "--config-format": only(["auto", "hf"], "vLLM's Mistral config format",
                            "kvledger reads config.json"),
}
