"""What each ``vllm serve`` flag that kvledger does not define itself does here: ``RULES``,
one ``Rule`` a flag (a no-op and why, the values accepted, read, or refused and why), and
the one line a refused flag ends in. ``vllm_flags.py`` makes the flags of these rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
from kvledger.engine.settings.kinds import seconds_or_zero
from kvledger.engine.settings.reasoning_parsers import (
    REASONING_PARSERS,
    REFUSED_REASONING_PARSERS,
)
from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig
from kvledger.engine.settings.tool_parsers import REFUSED_TOOL_PARSERS, TOOL_PARSERS

# vLLM's --tool-call-parser names kvledger reads calls in (server/tools/formats.py holds
# their readers, one per name; a test checks the two agree), and why the others are
# refused: tool_parsers.py. The same for --reasoning-parser: reasoning_parsers.py.
PARSERS = TOOL_PARSERS


@dataclass(frozen=True)
class Rule:
    """What one vLLM flag does here.

    ``accepts`` empty and ``unsupported`` empty: accepted as a no-op (``why`` says why
    nothing changes) whatever its value, or any value ``parse`` (vLLM's argparse type)
    reads and ``choices`` (vLLM's argparse choices) holds. ``accepts`` given: those values
    are accepted (they ask for what kvledger does anyway), any other is refused.
    ``unsupported`` given and no ``accepts``: refused whenever it is given. ``read``: the
    value ``parse`` gives is kept as the namespace's ``_vllm_<flag>`` for
    ``config_flags.py`` to read. ``reasons``: why a refused value is refused, for the
    values vLLM knows (its other reasoning parsers).
    """

    why: str = ""
    unsupported: str = ""
    accepts: frozenset[str] = frozenset()
    nargs: int | str | None = "*"
    read: bool = False  # accepted and read (``why`` says how), not a no-op
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    reasons: tuple[tuple[str, str], ...] = ()  # (value, why it is refused)
    secret: bool = False  # its value is a credential: never echoed in the refusal

    @property
    def refused_always(self) -> bool:
        return bool(self.unsupported) and not self.accepts


def _noop(why: str, nargs: int | str = 0, parse: Callable[[str], Any] | None = None,
          choices: tuple[str, ...] | None = None) -> Rule:
    return Rule(why=why, nargs=nargs, parse=parse, choices=choices)


def _read(why: str, parse: Callable[[str], Any]) -> Rule:
    return Rule(why=why, nargs=1, read=True, parse=parse)


def _only(values: Sequence[str], unsupported: str, why: str,
          reasons: dict[str, str] | None = None) -> Rule:
    return Rule(why=why, unsupported=unsupported, accepts=frozenset(values), nargs=None,
                reasons=tuple(sorted((reasons or {}).items())))


def _refuse(unsupported: str, secret: bool = False) -> Rule:
    return Rule(unsupported=unsupported, secret=secret)


_ONE_DEVICE = "kvledger serves a model on one machine (its GPUs by --tensor-parallel-size)"
_NOT_PLANNED = "{}; the plan does not depend on it"
_SERVE = "`kvledger serve`'s {}; the plan does not depend on it"

# flag (as typed; a --no- form has its own rule where it differs) -> Rule
RULES: dict[str, Rule] = {
    # Parallelism: --tensor-parallel-size and --pipeline-parallel-size are kvledger's own
    # (engine/settings/workload_config.py); the others at 1 are what kvledger does.
    "--data-parallel-size": _only(["1"], "data parallelism yet", _ONE_DEVICE),
    "--decode-context-parallel-size": _only(["1"], "context parallelism yet", _ONE_DEVICE),
    "--prefill-context-parallel-size": _only(["1"], "context parallelism yet", _ONE_DEVICE),
    "--enable-expert-parallel": _refuse("expert parallelism yet"),
    "--no-enable-expert-parallel": _noop(_ONE_DEVICE),
    # vLLM's multi-node flags: a plan is per GPU of each stage wherever the stages run
    # (--pipeline-parallel-size); `kvledger serve` runs the machines (engine/settings/node_config.py).
    "--nnodes": _noop(_NOT_PLANNED.format("the machines a run spans"), nargs=1, parse=int),
    "--node-rank": _noop(_NOT_PLANNED.format("which machine this is"), nargs=1, parse=int),
    "--master-addr": _noop(_NOT_PLANNED.format("the first machine's address"), nargs=1),
    "--master-port": _noop(_NOT_PLANNED.format("the first machine's port"), nargs=1,
                           parse=int),
    "--api-server-count": _only(["1"], "more than one API server process",
                                "kvledger serves from one process"),
    "--distributed-executor-backend": _only(["uni", "mp"], "vLLM's ray executor",
                                            "kvledger starts one process per rank itself"),
    "--disable-custom-all-reduce": _noop("kvledger's all-reduce is torch.distributed's "
                                         "(NCCL, gloo on the CPU), never a custom one"),
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
    "--swap-space": _noop("kvledger reserves a request's KV blocks when it admits it, so "
                          "nothing is swapped to the host", nargs=1, parse=float),
    "--use-v2-block-manager": _noop("kvledger's KV cache is paged in blocks already"),
    "--disable-frontend-multiprocessing": _noop("kvledger serves from one process"),
    "--disable-cascade-attn": _noop("kvledger has no cascade attention"),
    "--lora-dtype": _only(["auto"], "another dtype for LoRA adapters",
                          "adapters run in the model's dtype"),
    "--no-enable-log-requests": _noop("kvledger does not log requests"),
    "--disable-log-requests": _noop("kvledger does not log requests"),
    "--enable-log-requests": _noop(_NOT_PLANNED.format("`kvledger serve`'s request log")),
    "--disable-log-stats": _noop("kvledger logs no periodic engine stats; /metrics serves "
                                 "them"),
    "--disable-uvicorn-access-log": _noop("kvledger writes no HTTP access log"),
    "--uvicorn-log-level": _noop("kvledger's HTTP server is aiohttp, not uvicorn; "
                                 "`kvledger serve --log-level` sets its level", nargs=1,
                                 choices=UVICORN_LOG_LEVELS),
    "--max-log-len": _noop("kvledger never logs a prompt's text or token ids "
                           "(--enable-log-requests logs sizes and parameters)", nargs=1,
                           parse=optional_int),
    "--disable-fastapi-docs": _noop("kvledger serves no API docs pages"),
    "--use-tqdm-on-load": _noop("kvledger shows no progress bar while loading"),
    "--no-use-tqdm-on-load": _noop("kvledger shows no progress bar while loading"),
    "--config": Rule(why="a YAML file of flags, read as vLLM reads it (the command line's "
                         "own flags win; engine/settings/launch_line.py)", nargs=1, read=True),
    # -O0..3 (launch_line.py) and the compilation config (-cc, or its keys one by one,
    # dotted_args.py): whether and which decode steps are CUDA graphs.
    "--optimization-level": _read(
        "-O0 captures no CUDA graphs, as --enforce-eager (vLLM's O0: cudagraph_mode NONE); "
        "-O1, -O2 and -O3 capture them, as kvledger does anyway (it has no torch.compile "
        "to tune)", optimization_level),
    "--compilation-config": _read(
        "JSON, or its keys one by one (-cc.KEY=VALUE): cudagraph_mode NONE is "
        "--enforce-eager, any other mode captures; cudagraph_capture_sizes and "
        "max_cudagraph_capture_size are --cudagraph-capture-sizes and "
        "--max-cudagraph-capture-size; its other keys tune torch.compile, which kvledger "
        "does not run, and change nothing", compilation_config),
    "--calculate-kv-scales": _refuse("computing fp8 KV cache scales as it runs: an fp8 KV "
                                     "cache is divided by the checkpoint's k_scale/v_scale, "
                                     "else 1.0"),
    "--hf-overrides": _refuse("overriding config.json's fields: edit the checkpoint's "
                              "config.json, which the planner and the engine both read"),
    # kvledger serve's own flags (server/serve.py, settings/serve_config.py, node_config.py),
    # given to plan or preflight: a launch line plans as it serves, each value checked as
    # vLLM's argparse checks it, and one serve refuses (--max-logprobs -1) refused here too
    # (tests/engine/test_vllm_flag_values.py).
    "--headless": _noop(_SERVE.format("API-less machines (--node-rank above 0)")),
    "--host": _noop(_SERVE.format("address"), nargs=1),
    "--port": _noop(_SERVE.format("port"), nargs=1, parse=int),
    "--root-path": _noop(_SERVE.format("path prefix"), nargs=1),
    "--uds": _noop(_SERVE.format("unix socket"), nargs=1),
    "--ssl-keyfile": _noop(_SERVE.format("TLS key"), nargs=1),
    "--ssl-certfile": _noop(_SERVE.format("TLS certificate"), nargs=1),
    "--ssl-ca-certs": _noop(_SERVE.format("TLS client CA"), nargs=1),
    "--ssl-cert-reqs": _noop(_SERVE.format("TLS client-certificate demand"), nargs=1,
                             parse=cert_reqs),
    "--ssl-ciphers": _noop(_SERVE.format("TLS ciphers"), nargs=1),
    "--enable-ssl-refresh": _noop(_SERVE.format("TLS file reloading")),
    "--api-key": _noop(_SERVE.format("API keys"), nargs="+"),
    "--log-level": _noop(_SERVE.format("log level"), nargs=1, parse=log_level),
    "--shutdown-timeout": _noop(_SERVE.format("shutdown grace"), nargs=1,
                                parse=seconds_or_zero),
    "--allowed-origins": _noop(_SERVE.format("CORS origins"), nargs=1, parse=json_strings),
    "--allowed-methods": _noop(_SERVE.format("CORS methods"), nargs=1, parse=json_strings),
    "--allowed-headers": _noop(_SERVE.format("CORS headers"), nargs=1, parse=json_strings),
    "--allow-credentials": _noop(_SERVE.format("CORS credentials")),
    "--response-role": _noop(_SERVE.format("chat answers' role"), nargs=1),
    "--chat-template-content-format": _noop(_SERVE.format("chat message content format"),
                                            nargs=1, choices=CONTENT_FORMATS),
    "--return-tokens-as-token-ids": _noop(_SERVE.format("logprobs' token names")),
    "--enable-prompt-tokens-details": _noop(_SERVE.format("usage")),
    "--max-logprobs": _noop(_SERVE.format("logprobs limit"), nargs=1, parse=max_logprobs),
    "--chat-template": _noop(_SERVE.format("chat template"), nargs=1),
    "--trust-request-chat-template": _noop(_SERVE.format(
        "trust in a request's chat template")),
    "--default-chat-template-kwargs": _noop(_SERVE.format("chat template variables"), nargs=1,
                                            parse=json_object),
    "--enable-auto-tool-choice": _noop(_SERVE.format("tool calling")),
    "--tool-call-parser": _only(PARSERS, "that tool-call parser",
                                _SERVE.format("tool-call format"), REFUSED_TOOL_PARSERS),
    "--reasoning-parser": _only(REASONING_PARSERS, "that reasoning parser",
                                _SERVE.format("reasoning parser"), REFUSED_REASONING_PARSERS),
    "--structured-outputs-config": _noop(_SERVE.format("structured outputs config"), nargs=1,
                                         parse=StructuredOutputsConfig.parse),
    # The model's revision: read into --model (settings/config_flags.py).
    "--revision": _read("an hf:// model's revision (a branch, tag or commit), as "
                        "hf://ORG/NAME@REVISION names it; a local folder has none",
                        optional_text),
    # Refused with a pointer to what kvledger does instead, or by the feature it lacks.
    "--hf-token": _refuse("--hf-token: set $HF_TOKEN", secret=True),
    "--enable-reasoning": _refuse("reasoning parsers"),
    "--speculative-config": _refuse("speculative decoding"),
    "--limit-mm-per-prompt": _refuse("multimodal inputs: it serves text"),
    "--guided-decoding-backend": _refuse("choosing a structured-output backend: it uses "
                                         "llguidance"),
}


def refusal(flag: str, values: Sequence[str], rule: Rule | None) -> str:
    """The one line a refused flag ends in: the flag as typed, its value, and why."""
    given = " ".join([flag, *(["***"] if rule is not None and rule.secret and values
                               else values)])
    if rule is None or not rule.unsupported:
        return f"{given}: kvledger does not support vLLM's {flag}"
    names = sorted(rule.accepts)
    listed = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 2 else names)
    accepted = f" (only {listed})" if names else ""
    why = next((f": {why}" for value, why in rule.reasons if value in values), "")
    return f"{given}: kvledger does not support {rule.unsupported}{accepted}{why}"
