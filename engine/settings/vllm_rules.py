"""What each ``vllm serve`` flag that kvledger does not define itself does here: ``RULES``,
one ``Rule`` (``vllm_rule.py``) a flag: a no-op and why, the values accepted, read, or
refused and why. This file holds the flags kvledger reads, serve's own given to plan or
preflight, and those that ask for what kvledger does anyway; ``vllm_noops.py`` the other
flags that change nothing here, ``vllm_refusals.py`` the refused. ``vllm_flags.py`` makes
the flags of these rules.
"""

from __future__ import annotations

from kvledger.engine.settings.compilation_config import compilation_config, optimization_level
from kvledger.engine.settings.flag_values import (
    CONTENT_FORMATS,
    UVICORN_LOG_LEVELS,
    cert_reqs,
    json_object,
    json_strings,
    log_level,
    max_logprobs,
    optional_int,
    optional_text,
)
from kvledger.engine.settings.kinds import positive_int, seconds_or_zero
from kvledger.engine.settings.reasoning_parsers import (
    REASONING_PARSERS,
    REFUSED_REASONING_PARSERS,
)
from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig
from kvledger.engine.settings.tool_parsers import REFUSED_TOOL_PARSERS, TOOL_PARSERS
from kvledger.engine.settings.vllm_noops import NOOPS
from kvledger.engine.settings.vllm_refusals import REFUSALS
from kvledger.engine.settings.vllm_rule import Rule, noop, only, read, refusal, refuse

__all__ = ["PARSERS", "RULES", "Rule", "refusal"]

# vLLM's --tool-call-parser names kvledger reads calls in (server/tools/formats.py holds
# their readers, one per name; a test checks the two agree), and why the others are
# refused: tool_parsers.py. The same for --reasoning-parser: reasoning_parsers.py.
PARSERS = TOOL_PARSERS

_ONE_DEVICE = "kvledger serves a model on one machine (its GPUs by --tensor-parallel-size)"
_NOT_PLANNED = "{}; the plan does not depend on it"
_SERVE = "`kvledger serve`'s {}; the plan does not depend on it"

# flag (as typed; a --no- form has its own rule where it differs) -> Rule
_RULES: dict[str, Rule] = {
    # Parallelism: --tensor-parallel-size and --pipeline-parallel-size are kvledger's own
    # (engine/settings/workload_config.py); the others at 1 are what kvledger does.
    "--data-parallel-size": only(["1"], "data parallelism yet", _ONE_DEVICE),
    "--decode-context-parallel-size": only(["1"], "context parallelism yet", _ONE_DEVICE),
    "--prefill-context-parallel-size": only(["1"], "context parallelism yet", _ONE_DEVICE),
    "--data-parallel-size-local": only(["1"], "data parallelism yet", _ONE_DEVICE),
    # vLLM's multi-node flags: a plan is per GPU of each stage wherever the stages run
    # (--pipeline-parallel-size); `kvledger serve` runs the machines (engine/settings/node_config.py).
    "--nnodes": noop(_NOT_PLANNED.format("the machines a run spans"), nargs=1, parse=int),
    "--node-rank": noop(_NOT_PLANNED.format("which machine this is"), nargs=1, parse=int),
    "--master-addr": noop(_NOT_PLANNED.format("the first machine's address"), nargs=1),
    "--master-port": noop(_NOT_PLANNED.format("the first machine's port"), nargs=1,
                          parse=int),
    "--api-server-count": only(["1"], "more than one API server process",
                               "kvledger serves from one process"),
    "--distributed-executor-backend": only(["uni", "mp"], "vLLM's ray executor",
                                           "kvledger starts one process per rank itself"),
    "--disable-custom-all-reduce": noop("kvledger's all-reduce is torch.distributed's "
                                        "(NCCL, gloo on the CPU), never a custom one"),
    "--cpu-offload-gb": only(["0"], "offloading weights to the host",
                             "0 keeps every weight on the device, as kvledger does"),
    # Asks for what kvledger always does.
    "--trust-remote-code": noop("kvledger runs its own code for the architectures it "
                                "serves, never a checkpoint's"),
    "--no-trust-remote-code": noop("kvledger never runs a checkpoint's code"),
    "--enable-chunked-prefill": noop("kvledger always prefills long prompts in chunks"),
    "--no-enable-chunked-prefill": refuse("turning chunked prefill off"),
    "--load-format": only(["auto", "safetensors"], "vLLM's other weight formats",
                          "kvledger loads safetensors"),
    "--runner": only(["auto", "generate"], "vLLM's pooling runner",
                     "kvledger generates text"),
    "--convert": only(["auto", "none"], "converting a model for pooling",
                      "kvledger serves the model as it is"),
    "--tokenizer-mode": only(["auto", "hf"], "vLLM's other tokenizer modes",
                             "kvledger reads the model's tokenizer.json"),
    "--model-impl": only(["auto"], "choosing vLLM's or transformers' model code",
                         "kvledger has its own"),
    "--swap-space": noop("kvledger reserves a request's KV blocks when it admits it, so "
                         "nothing is swapped to the host", nargs=1, parse=float),
    "--use-v2-block-manager": noop("kvledger's KV cache is paged in blocks already"),
    "--disable-frontend-multiprocessing": noop("kvledger serves from one process"),
    "--disable-cascade-attn": noop("kvledger has no cascade attention"),
    "--lora-dtype": only(["auto"], "another dtype for LoRA adapters",
                         "adapters run in the model's dtype"),
    "--worker-cls": only(["auto"], "a worker class of your own", "kvledger's ranks are its "
                         "own"),
    "--scheduler-reserve-full-isl": noop("kvledger admits a request only when its prompt "
                                         "and output cap both fit"),
    "--watermark": only(["0", "0.0"], "keeping KV blocks free at admission",
                        "kvledger reserves each admitted request's cap, so it preempts none"),
    "--long-prefill-token-threshold": only(["0"], "capping one prompt's share of a step",
                                           "0 caps none, as kvledger"),
    "--fingerprint-mode": only(["none"], "a system_fingerprint in answers",
                               "kvledger's answers carry none"),
    "--enable-reasoning": noop("--reasoning-parser turns reasoning on, as in vLLM, which "
                               "has dropped this flag"),
    "--no-enable-log-requests": noop("kvledger does not log requests"),
    "--disable-log-requests": noop("kvledger does not log requests"),
    "--enable-log-requests": noop(_NOT_PLANNED.format("`kvledger serve`'s request log")),
    "--disable-log-stats": noop("kvledger logs no periodic engine stats; /metrics serves "
                                "them"),
    "--disable-uvicorn-access-log": noop("kvledger writes no HTTP access log"),
    "--disable-access-log-for-endpoints": noop("kvledger writes no HTTP access log to "
                                               "leave paths out of", nargs=1,
                                               parse=optional_text),
    # Limits of h11, one of uvicorn's two HTTP parsers: vLLM's server parses with the other,
    # httptools (installed with fastapi[standard]), which reads neither, and no uvicorn
    # reads a header count at all. kvledger's parser is aiohttp's.
    "--h11-max-incomplete-event-size": noop(
        "vLLM's server parses HTTP with httptools, which ignores it; kvledger's aiohttp bounds "
        "a request's head by each line's length (8190 bytes) and its header count (128), "
        "and its body by --max-body-bytes", nargs=1, parse=int),
    "--h11-max-header-count": noop(
        "uvicorn, vLLM's HTTP server, never reads it; kvledger's aiohttp takes at most 128 "
        "headers a request (more is a 400)", nargs=1, parse=int),
    "--uvicorn-log-level": noop("kvledger's HTTP server is aiohttp, not uvicorn; "
                                "`kvledger serve --log-level` sets its level", nargs=1,
                                choices=UVICORN_LOG_LEVELS),
    "--max-log-len": noop("kvledger never logs a prompt's text or token ids "
                          "(--enable-log-requests logs sizes and parameters)", nargs=1,
                          parse=optional_int),
    "--disable-fastapi-docs": noop("kvledger serves no API docs pages"),
    "--use-tqdm-on-load": noop("kvledger shows no progress bar while loading"),
    "--no-use-tqdm-on-load": noop("kvledger shows no progress bar while loading"),
    "--config": Rule(why="a YAML file of flags, read as vLLM reads it (the command line's "
                         "own flags win; engine/settings/launch_line.py)", nargs=1, read=True),
    # -O0..3 (launch_line.py) and the compilation config (-cc, or its keys one by one,
    # dotted_args.py): whether and which decode steps are CUDA graphs.
    "--optimization-level": read(
       "-O0 captures no CUDA graphs, as --enforce-eager (vLLM's O0: cudagraph_mode NONE); "
       "-O1, -O2 and -O3 capture them, as kvledger does anyway (it has no torch.compile "
       "to tune)", optimization_level),
    "--compilation-config": read(
       "JSON, or its keys one by one (-cc.KEY=VALUE): cudagraph_mode NONE is "
       "--enforce-eager, any other mode captures; cudagraph_capture_sizes and "
       "max_cudagraph_capture_size are --cudagraph-capture-sizes and "
       "--max-cudagraph-capture-size; its other keys tune torch.compile, which kvledger "
       "does not run, and change nothing", compilation_config),
    # kvledger serve's own flags (server/serve.py, settings/serve_config.py, node_config.py),
    # given to plan or preflight: a launch line plans as it serves, each value checked as
    # vLLM's argparse checks it, and one serve refuses (--max-logprobs -1) refused here too
    # (tests/engine/test_vllm_flag_values.py).
    "--headless": noop(_SERVE.format("API-less machines (--node-rank above 0)")),
    "--host": noop(_SERVE.format("address"), nargs=1),
    "--port": noop(_SERVE.format("port"), nargs=1, parse=int),
    "--root-path": noop(_SERVE.format("path prefix"), nargs=1),
    "--uds": noop(_SERVE.format("unix socket"), nargs=1),
    "--ssl-keyfile": noop(_SERVE.format("TLS key"), nargs=1),
    "--ssl-certfile": noop(_SERVE.format("TLS certificate"), nargs=1),
    "--ssl-ca-certs": noop(_SERVE.format("TLS client CA"), nargs=1),
    "--ssl-cert-reqs": noop(_SERVE.format("TLS client-certificate demand"), nargs=1,
                            parse=cert_reqs),
    "--ssl-ciphers": noop(_SERVE.format("TLS ciphers"), nargs=1),
    "--enable-ssl-refresh": noop(_SERVE.format("TLS file reloading")),
    "--api-key": noop(_SERVE.format("API keys"), nargs="+"),
    "--log-level": noop(_SERVE.format("log level"), nargs=1, parse=log_level),
    "--shutdown-timeout": noop(_SERVE.format("shutdown grace"), nargs=1,
                               parse=seconds_or_zero),
    "--allowed-origins": noop(_SERVE.format("CORS origins"), nargs=1, parse=json_strings),
    "--allowed-methods": noop(_SERVE.format("CORS methods"), nargs=1, parse=json_strings),
    "--allowed-headers": noop(_SERVE.format("CORS headers"), nargs=1, parse=json_strings),
    "--allow-credentials": noop(_SERVE.format("CORS credentials")),
    "--response-role": noop(_SERVE.format("chat answers' role"), nargs=1),
    "--chat-template-content-format": noop(_SERVE.format("chat message content format"),
                                           nargs=1, choices=CONTENT_FORMATS),
    "--return-tokens-as-token-ids": noop(_SERVE.format("logprobs' token names")),
    "--enable-prompt-tokens-details": noop(_SERVE.format("usage")),
    "--enable-force-include-usage": noop(_SERVE.format("usage in every stream")),
    "--enable-request-id-headers": noop(_SERVE.format("X-Request-Id headers")),
    "--exclude-tools-when-tool-choice-none": noop(_SERVE.format(
        "tools left out of a chat whose tool_choice is none")),
    "--enable-server-load-tracking": noop(_SERVE.format("/load count")),
    "--enable-tokenizer-info-endpoint": noop(_SERVE.format("/tokenizer_info")),
    "--stream-interval": noop(_SERVE.format("stream chunking"), nargs=1, parse=positive_int),
    "--sse-keep-alive-interval": noop(_SERVE.format("SSE keep-alive"), nargs=1,
                                      parse=seconds_or_zero),
    "--max-logprobs": noop(_SERVE.format("logprobs limit"), nargs=1, parse=max_logprobs),
    "--chat-template": noop(_SERVE.format("chat template"), nargs=1),
    "--trust-request-chat-template": noop(_SERVE.format(
       "trust in a request's chat template")),
    "--default-chat-template-kwargs": noop(_SERVE.format("chat template variables"), nargs=1,
                                           parse=json_object),
    "--enable-auto-tool-choice": noop(_SERVE.format("tool calling")),
    "--tool-call-parser": only(PARSERS, "that tool-call parser",
                               _SERVE.format("tool-call format"), REFUSED_TOOL_PARSERS),
    "--reasoning-parser": only(REASONING_PARSERS, "that reasoning parser",
                               _SERVE.format("reasoning parser"), REFUSED_REASONING_PARSERS),
    "--structured-outputs-config": noop(_SERVE.format("structured outputs config"), nargs=1,
                                        parse=StructuredOutputsConfig.parse),
    # The model's revision: read into --model (settings/config_flags.py).
    "--revision": read("an hf:// model's revision (a branch, tag or commit), as "
                       "hf://ORG/NAME@REVISION names it; a local folder has none",
                       optional_text),
}

# One owner: every rule above, in vllm_noops.py or in vllm_refusals.py (a test checks that
# no flag has two).
RULES: dict[str, Rule] = {**_RULES, **NOOPS, **REFUSALS}
