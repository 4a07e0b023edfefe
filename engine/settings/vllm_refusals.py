"""The ``vllm serve`` flags kvledger refuses, each saying why: the feature kvledger lacks
and, where there is one, what to do instead. An on/off flag's ``--no-`` form, vLLM's
default, is accepted (``lacks``). Part of ``RULES`` (``vllm_rules.py``).
"""

from __future__ import annotations

from kvledger.engine.settings.vllm_rule import Rule, lacks, refuse

_DP = "data parallelism: run one kvledger per replica (an InferenceService's replicas)"
_SPEC = "speculative decoding"
_NUMA = "binding ranks to NUMA nodes: run kvledger under numactl"
_CODE = "loading Python classes into the server"
_TIMEOUT = "another timeout for the ranks' collectives: kvledger's fail after 60 s"
_LOGGING = "a logging config: --log-level sets kvledger's level"

REFUSALS: dict[str, Rule] = {
    # Data and expert parallelism (the flags that only tune them: vllm_noops.py).
    "--data-parallel-rank": refuse(_DP),
    "--data-parallel-start-rank": refuse(_DP),
    "--data-parallel-multi-port-external-lb": refuse(_DP),
    **lacks("--data-parallel-hybrid-lb", _DP),
    **lacks("--data-parallel-external-lb", _DP),
    **lacks("--enable-expert-parallel", "expert parallelism yet"),
    **lacks("--enable-eplb", "expert parallelism's load balancer (EPLB)"),
    **lacks("--enable-elastic-ep", "elastic expert parallelism"),
    **lacks("--enable-dbo", "dual-batch overlap (micro-batches for expert parallelism)"),
    **lacks("--enable-fault-tolerance", "recovering from a lost data-parallel engine"),
    **lacks("--enable-batch-sharded-sampling", "sampling sharded across tensor-parallel "
                                               "ranks"),
    # Ranks and devices.
    "--device-ids": refuse("choosing GPUs by --device-ids: set $CUDA_VISIBLE_DEVICES"),
    "--distributed-timeout-seconds": refuse(_TIMEOUT),
    "--cpu-distributed-timeout-seconds": refuse(_TIMEOUT),
    **lacks("--numa-bind", _NUMA),
    "--numa-bind-nodes": refuse(_NUMA),  # vLLM takes them only with --numa-bind
    "--numa-bind-cpus": refuse(_NUMA),
    **lacks("--fail-on-environ-validation", "failing on a VLLM_* environment variable "
                                            "vLLM does not know"),
    # Speculative decoding.
    "--speculative-config": refuse(_SPEC),
    "--spec-method": refuse(_SPEC),
    "--spec-model": refuse(_SPEC),
    "--spec-tokens": refuse(_SPEC),
    # KV cache: offloading, transfer between instances, per-layer dtypes.
    "--kv-offloading-size": refuse("offloading the KV cache to host memory"),
    "--kv-transfer-config": refuse("moving KV caches between instances (disaggregated "
                                   "prefill, LMCache)"),
    "--ec-transfer-config": refuse("moving encoder caches between instances"),
    "--kv-cache-dtype-skip-layers": refuse("keeping some layers' KV cache out of "
                                           "--kv-cache-dtype: every layer uses it"),
    "--disable-hybrid-kv-cache-manager": refuse(
        "planning vLLM's KV cache without its hybrid manager (kvledger's own engine gives "
        "every layer the whole context)"),
    "--no-disable-hybrid-kv-cache-manager": refuse(
        "vLLM's hybrid KV cache manager in its engine: each layer holds the whole context"),
    # Scheduling and admission: kvledger admits a request when its prompt and output cap
    # fit, and the rest wait in its line (--max-queue-len, --max-queue-wait).
    "--max-num-active-seqs": refuse("a running limit under --max-num-seqs: set "
                                    "--max-num-seqs"),
    "--max-num-scheduled-tokens": refuse("a step limit under --max-num-batched-tokens: set "
                                         "--max-num-batched-tokens"),
    "--max-num-queued-reqs": refuse("a limit on the requests in flight: --max-queue-len "
                                    "limits those waiting (429)"),
    "--max-num-queued-tokens": refuse("a limit on the prompt tokens awaiting prefill: "
                                      "--max-queue-wait bounds a request's wait"),
    "--no-scheduler-reserve-full-isl": refuse("admitting a request before its prompt fits: "
                                              "admission counts its prompt and output cap"),
    "--scheduler-cls": refuse(_CODE),
    # The model and its files.
    "--hf-token": refuse("--hf-token: set $HF_TOKEN", secret=True),
    "--hf-overrides": refuse("overriding config.json's fields: edit the checkpoint's "
                             "config.json, which the planner and the engine both read"),
    "--hf-config-path": refuse("a config.json apart from the model's: put it in --model's "
                               "folder"),
    "--tokenizer-revision": refuse("a tokenizer revision of its own: --revision (or "
                                   "hf://ORG/NAME@REV) pins the tokenizer with the model"),
    "--model-class-overrides": refuse("overriding a model's class: kvledger runs its own "
                                      "code for the architectures it serves"),
    "--model-loader-extra-config": refuse("vLLM's model loader settings: "
                                          "--safetensors-load-strategy tunes loading"),
    "--quantization-config": refuse("per-layer quantization settings: --quantization fp8 "
                                    "quantizes the whole model"),
    "--calculate-kv-scales": refuse("computing fp8 KV cache scales as it runs: an fp8 KV "
                                    "cache is divided by the checkpoint's k_scale/v_scale, "
                                    "else 1.0"),
    **lacks("--disable-sliding-window", "turning a model's sliding window off: kvledger "
                                        "runs the attention config.json declares"),
    **lacks("--skip-tokenizer-init", "serving without a tokenizer (token ids in and out)"),
    "--diffusion-config": refuse("diffusion language models"),
    "--pooler-config": refuse("pooling models: kvledger generates text"),
    "--io-processor-plugin": refuse("IO processor plugins (pooling models' inputs and "
                                    "outputs)"),
    # Multimodal inputs (the knobs that only tune them: vllm_noops.py) and LoRA.
    **lacks("--enable-mm-embeds", "multimodal embeddings as input: it serves text"),
    **lacks("--mm-encoder-only", "running only a model's vision or audio encoder"),
    "--ec-manager-config": refuse("an encoder cache manager: it runs no vision or audio "
                                  "encoder"),
    "--lora-target-modules": refuse("restricting LoRA to some modules: an adapter adapts "
                                    "every projection it holds"),
    # Kernels and code vLLM loads.
    "--attention-config": refuse("vLLM's attention kernel settings: --attention-backend "
                                 "picks kvledger's"),
    "--kernel-config": refuse("vLLM's kernel settings: kvledger runs its own kernels"),
    "--ir-op-priority": refuse("vLLM's kernel dispatch order: kvledger runs its own kernels"),
    "--additional-config": refuse("vLLM's platform plugins' settings"),
    "--worker-extension-cls": refuse(_CODE),
    "--logits-processors": refuse("logits processors of your own (" + _CODE + ")"),
    "--middleware": refuse("ASGI middleware: its HTTP server is aiohttp"),
    # Sampling and what an answer returns.
    **lacks("--enable-prompt-embeds", "prompt embeddings as input"),
    **lacks("--enable-return-routed-experts", "returning the experts a token was routed to"),
    "--aux-output-config": refuse("auxiliary outputs (the experts a token was routed to)"),
    **lacks("--return-sampling-mask", "returning the tokens a sample was drawn from"),
    **lacks("--use-fp64-gumbel", "FP64 sampling noise"),
    **lacks("--enable-trace-replay", "replaying a given token trace"),
    "--watermark-config": refuse("watermarking generated text"),
    "--reasoning-config": refuse("vLLM's reasoning config (a forced end of thinking): "
                                 "--reasoning-parser names the think tags"),
    "--guided-decoding-backend": refuse("choosing a structured-output backend: it uses "
                                        "llguidance"),
    # Endpoints and servers kvledger does not run.
    "--grpc": refuse("a gRPC server: it serves the OpenAI API over HTTP"),
    "--grpc-port": refuse("a gRPC server: it serves the OpenAI API over HTTP"),
    **lacks("--tokens-only", "vLLM's tokens-in, tokens-out endpoint"),
    **lacks("--enable-scale-out", "vLLM's scale-out endpoints (/render, /inference/v1/...)"),
    **lacks("--enable-offline-docs", "API docs pages (/docs)"),
    "--tool-server": refuse("built-in tool servers (MCP, demo tools): tools run in the "
                            "client"),
    "--tool-parser-plugin": refuse("parser plugins: --tool-call-parser takes kvledger's "
                                   "names"),
    "--reasoning-parser-plugin": refuse("parser plugins: --reasoning-parser takes kvledger's "
                                        "names"),
    "--tool-strict-level": refuse("a server-wide floor on constraining tool calls"),
    "--weight-transfer-config": refuse("updating weights while serving (RL weight "
                                       "transfer)"),
    "--sleep-preserve-parameter-names": refuse("keeping named weights across a level-2 "
                                               "sleep (RL weight updates)"),
    # Logs, metrics and traces beyond kvledger's (/metrics serves vLLM's names).
    **lacks("--enable-log-outputs", "logging answers: kvledger never logs a prompt's or "
                                    "an answer's text"),
    **lacks("--log-error-stack", "logging error stack traces: an error is one line"),
    **lacks("--enable-logging-iteration-details", "logging each engine step's details"),
    **lacks("--enable-per-request-metrics", "timing metrics in each answer"),
    **lacks("--kv-cache-metrics", "KV cache residency metrics"),
    **lacks("--cudagraph-metrics", "CUDA graph metrics"),
    **lacks("--enable-mfu-metrics", "model FLOPs utilization metrics"),
    **lacks("--enable-layerwise-nvtx-tracing", "NVTX ranges per layer"),
    "--custom-histogram-buckets": refuse("other histogram buckets on /metrics"),
    "--otlp-traces-endpoint": refuse("OpenTelemetry traces"),
    "--profiler-config": refuse("vLLM's profiler (torch or proton traces)"),
    "--logging-config": refuse(_LOGGING),
    "--log-config-file": refuse(_LOGGING),
}
