"""Every ``vllm serve`` flag kvledger does not define itself, and what it does here.

A vLLM launch line must port as it is: each of vLLM's flags is kvledger's own (same name,
same behaviour: ``engine/settings/*_config.py``, ``engine/server/serve.py``), accepted because it
changes nothing here (the reason is in ``--help``), or refused by name with one line and
exit 2 saying why; never argparse's ``unrecognized arguments``. ``RULES`` is the one owner
of the last two; a vLLM flag without a rule is refused as unsupported.

``VLLM_SERVE_FLAGS`` (``vllm_serve_flags.py``) lists vLLM's flags, read from its source.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from kvledger.engine.errors import BadInput
from kvledger.engine.settings.vllm_serve_flags import VLLM_SERVE_FLAGS

# vLLM's --tool-call-parser names kvledger reads calls in (server/tools/formats.py holds
# their readers, one per name; a test checks the two agree).
PARSERS = ("hermes", "llama3_json", "mistral")


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
    read: bool = False  # accepted and read (``why`` says how), not a no-op

    @property
    def refused_always(self) -> bool:
        return bool(self.unsupported) and not self.accepts


def _noop(why: str, nargs: int | str = 0) -> Rule:
    return Rule(why=why, nargs=nargs)


def _only(values: Sequence[str], unsupported: str, why: str) -> Rule:
    return Rule(why=why, unsupported=unsupported, accepts=frozenset(values), nargs=None)


def _refuse(unsupported: str) -> Rule:
    return Rule(unsupported=unsupported)


_ONE_DEVICE = "kvledger serves a model on one machine (its GPUs by --tensor-parallel-size)"
_NOT_PLANNED = "{}; the plan does not depend on it"
_EAGER = ("kvledger runs eagerly: no torch.compile or CUDA graphs for an optimization or "
          "compilation level to tune")

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
    "--nnodes": _noop(_NOT_PLANNED.format("the machines a run spans"), nargs=1),
    "--node-rank": _noop(_NOT_PLANNED.format("which machine this is"), nargs=1),
    "--master-addr": _noop(_NOT_PLANNED.format("the first machine's address"), nargs=1),
    "--master-port": _noop(_NOT_PLANNED.format("the first machine's port"), nargs=1),
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
                          "nothing is swapped to the host", nargs=1),
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
                                 "`kvledger serve --log-level` sets its level", nargs=1),
    "--disable-fastapi-docs": _noop("kvledger serves no API docs pages"),
    "--use-tqdm-on-load": _noop("kvledger shows no progress bar while loading"),
    "--no-use-tqdm-on-load": _noop("kvledger shows no progress bar while loading"),
    "--config": Rule(why="a YAML file of flags, read as vLLM reads it (the command line's "
                         "own flags win; engine/settings/launch_line.py)", nargs=1, read=True),
    "--optimization-level": _noop(_EAGER, nargs=1),  # -O0..3, -O.level=N (launch_line)
    "--compilation-config": _noop(_EAGER, nargs=1),
    "--calculate-kv-scales": _refuse("computing fp8 KV cache scales as it runs: an fp8 KV "
                                     "cache is divided by the checkpoint's k_scale/v_scale, "
                                     "else 1.0"),
    "--hf-overrides": _refuse("overriding config.json's fields: edit the checkpoint's "
                              "config.json, which the planner and the engine both read"),
    # kvledger serve's own flags, given to plan or preflight.
    "--host": _noop(_NOT_PLANNED.format("`kvledger serve`'s address"), nargs=1),
    "--port": _noop(_NOT_PLANNED.format("`kvledger serve`'s port"), nargs=1),
    "--api-key": _noop(_NOT_PLANNED.format("`kvledger serve`'s API keys"), nargs="+"),
    "--log-level": _noop(_NOT_PLANNED.format("`kvledger serve`'s log level"), nargs=1),
    # Refused with a pointer to what kvledger does instead.
    "--return-tokens-as-token-ids": _noop(_NOT_PLANNED.format(
        "`kvledger serve`'s logprobs' token names")),
    "--enable-prompt-tokens-details": _noop(_NOT_PLANNED.format("`kvledger serve`'s usage")),
    "--max-logprobs": _noop(_NOT_PLANNED.format("`kvledger serve`'s logprobs limit"), nargs=1),
    "--revision": _refuse("--revision: name it in the model, --model hf://ORG/NAME@REVISION"),
    "--hf-token": _refuse("--hf-token: set $HF_TOKEN"),
    "--chat-template": _noop(_NOT_PLANNED.format("`kvledger serve`'s chat template"),
                             nargs=1),
    "--trust-request-chat-template": _noop(_NOT_PLANNED.format(
        "`kvledger serve`'s trust in a request's chat template")),
    "--default-chat-template-kwargs": _noop(_NOT_PLANNED.format(
        "`kvledger serve`'s chat template variables"), nargs=1),
    "--enable-auto-tool-choice": _noop(_NOT_PLANNED.format("`kvledger serve`'s tool calling")),
    "--tool-call-parser": _only(PARSERS, "that tool-call parser",
                                _NOT_PLANNED.format("`kvledger serve`'s tool-call format")),
    "--reasoning-parser": _refuse("reasoning parsers"),
    "--enable-reasoning": _refuse("reasoning parsers"),
    "--speculative-config": _refuse("speculative decoding"),
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
    names = sorted(rule.accepts)
    listed = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 2 else names)
    accepted = f" (only {listed})" if names else ""
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
    if rule.read:
        return f"vLLM's: {rule.why}"
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
        "`vllm serve` flag is refused by name, one error line, exit 2 (engine/settings/vllm_flags.py)")
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


def verdicts(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each of vLLM's flags (its first spelling) as ``parser`` takes it: ``implemented``
    (the command's own flag, or read), ``no-op`` or ``refused``."""
    actions = parser._option_string_actions
    out = {}
    for spelled in VLLM_SERVE_FLAGS:
        flag = _forms(spelled)[0][0]
        action = actions[flag]
        if not isinstance(action, _VllmFlag):
            out[flag] = "implemented"
        elif action.rule is None or action.rule.refused_always:
            out[flag] = "refused"
        else:
            out[flag] = "implemented" if action.rule.read else "no-op"
    return out
