"""``kvledger serve``'s own options (the server's, beside the engine's ``EngineConfig``) as
one validated dataclass.

Each field is declared once, with ``setting(...)`` (``engine/settings/declare.py``): its default,
its flag, its kind, its ``--help`` line (which shows the default as ``%(default)s``, never
a copy) and, where the InferenceService exposes it, its CRD field (``spec.<name>`` or
``spec.tools.<name>``, whose description may show the default the same way). What each
accepts is ``serve_values.py``'s. Generated from these declarations: serve's flags
(``add_setting_flags``), the server's options (``server/state.py``'s ``ServeOptions`` is
this plus the tenants read from ``--tenants-file``), and in the operator the CRD's fields,
the spec's mapping and the pod's flags. The fields are declared in the order the pod's
flags are written, each ``--help`` group in that order too.

A secret or a local path given only on the command line (``--api-key``, ``--api-key-file``)
is declared without a CRD field; the operator passes keys as env from a Secret.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config_values import MAX_LOGPROBS
from kvledger.engine.settings.declare import Crd, check_settings, render_flags, setting
from kvledger.engine.settings.flag_values import CONTENT_FORMATS
from kvledger.engine.settings.kinds import (
    COUNT,
    ON,
    SECONDS,
    SECONDS_OR_ZERO,
    SWITCH,
    TEXT,
    choice,
)
from kvledger.engine.settings.serve_values import (
    BODY_BYTES,
    JSON_OBJECT,
    JSON_STRINGS,
    LAST_WORDS,
    LOG_LEVEL,
    LOGPROBS,
    OPENAI_API,
    PARSER,
    PORT,
    REASONING_PARSER,
    ROOT_PATH,
    SERVER,
    STRUCTURED_OUTPUTS,
    WORDS,
)
from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig


@dataclass(frozen=True)
class ServeConfig:
    """Every option of ``kvledger serve`` that is not the engine's. One declaration per
    field (``setting``): its default, flag, kind, help and, for the InferenceService, its
    CRD field (``defaulted``: the CRD declares the default, and the pod always gets it)."""

    host: str = setting(
        "0.0.0.0", "--host", TEXT, group=SERVER,
        help="the address to listen on (default %(default)s: every IPv4 interface; '::' every "
             "IPv6 and IPv4 one, as vLLM's)")
    port: int = setting(
        8000, "--port", PORT, group=SERVER, help="the port to listen on (default %(default)s)",
        crd=Crd("", "HTTP port of the engine and the Service", schema={"maximum": 65535},
                defaulted=True))
    root_path: str | None = setting(  # server/root_path.py
        None, "--root-path", ROOT_PATH, group=SERVER,
        help="vLLM's: the path prefix a path-routing proxy serves the API under (e.g. "
             "/llama): a request under it is served as the path after it (/llama/v1/models "
             "is /v1/models), and one outside it as it is, as FastAPI's root_path")
    api_keys: tuple[str, ...] = setting(  # serve adds $KVLEDGER_API_KEY's and the file's
        (), "--api-key", LAST_WORDS, metavar="KEY", group=SERVER,
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize; "
             "several keys, listed, each open it; as in vLLM a later --api-key (the "
             "command line's after a --config file's) replaces an earlier one (default: "
             "$KVLEDGER_API_KEY and vLLM's $VLLM_API_KEY; unset = no key)")
    api_key_file: str | None = setting(
        None, "--api-key-file", TEXT, metavar="PATH", group=SERVER,
        help="more API keys, one per line (blank lines and # comments skipped), e.g. a "
             "mounted Secret")
    salt_cache_per_key: bool = setting(
        False, "--cache-salt-per-key", ON, group=SERVER,
        help="key the prefix cache by API key too: requests under different keys never share "
             "KV blocks, so none can tell from its timing what another key's clients sent")
    metrics_api_key: str | None = setting(  # serve reads $KVLEDGER_METRICS_API_KEY if unset
        None, "--metrics-api-key", TEXT, metavar="KEY", group=SERVER,
        help="require 'Authorization: Bearer KEY' on /metrics and /v1/budget, whose "
             "prefix-cache counters tell how much of a guessed prompt was cached, and no "
             "tenant's key then opens them (default: $KVLEDGER_METRICS_API_KEY; unset: "
             "/metrics open, as Prometheus expects, /v1/budget behind the API keys)")
    shutdown_grace_s: float = setting(  # vLLM's --shutdown-timeout (its default is 0)
        30, "--shutdown-grace", SECONDS_OR_ZERO, aliases=("--shutdown-timeout",), group=SERVER,
        help="on SIGTERM, let in-flight requests run this long before aborting them, as "
             "vLLM's --shutdown-timeout (0: abort them at once; default %(default)s)",
        crd=Crd("", "on SIGTERM (scale-down, rollout, eviction), how long in-flight requests "
                    "may finish before they are aborted (--shutdown-grace); the pod's grace is "
                    "20 s more", name="shutdownGraceSeconds",
                schema={"type": "integer", "maximum": 3600}, defaulted=True))
    max_queue_wait_s: float | None = setting(  # None: a waiter waits as long as it takes
        None, "--max-queue-wait", SECONDS_OR_ZERO, group=SERVER,
        help="a request waits in line at most this long before its 429 (default: as long as "
             "it takes, or until its client leaves; 0: answer at once)",
        crd=Crd("", "how long a request may wait in line for its KV reservation before a 429 "
                    "(--max-queue-wait; 0: refused at once; not set: as long as it takes)",
                name="maxQueueWaitSeconds", schema={"type": "integer", "maximum": 600}))
    max_queue_len: int = setting(
        256, "--max-queue-len", COUNT, group=SERVER,
        help="requests that cannot be reserved now wait in one line of at most N (default "
             "%(default)s; nobody overtakes the first in its order, unless --backfill); a "
             "request that finds it full is a 429 queue_full (0: no line, answer at once)",
        crd=Crd("", "how many requests may wait in line for their KV reservations, taking "
                    "turns between tenants; one more is a 429 queue_full (--max-queue-len; 0: "
                    "refused at once; not set: %(default)s); what requestsWaiting autoscaling "
                    "counts", name="maxQueueLength", schema={"maximum": 100000}))
    max_queue_len_per_tenant: int | None = setting(  # None: Tenants' default (half, or all)
        None, "--max-queue-len-per-tenant", COUNT, group=SERVER,
        help="places in line one API key may hold; one more is a 429 tenant_queue_full for "
             "that key alone (default: half the line with two keys or more, else all of it)",
        crd=Crd("", "places in line one tenant (API key) may hold; one more is its own 429 "
                    "tenant_queue_full (--max-queue-len-per-tenant; not set: half the line "
                    "with two keys or more)", name="maxQueueLengthPerTenant",
                schema={"maximum": 100000}))
    tenant_fairness: bool = setting(
        True, "--tenant-fairness", SWITCH, group=SERVER,
        help="the line takes turns between API keys (weighted fair queuing), so one key's "
             "flood delays another key's request by about one admission (default on; "
             "--no-tenant-fairness: arrival order)",
        crd=Crd("", "the line takes turns between tenants (default %(default)s; false: arrival "
                    "order, --no-tenant-fairness)"))
    tenants_file: str | None = setting(  # the operator's: spec.tenantsSecretRef, mounted
        None, "--tenants-file", TEXT, metavar="PATH", group=SERVER,
        help="tenants as YAML (a mounted Secret): each a name (its metrics label), its API "
             "keys, its weight in the line, its places in line (maxQueued) and its default "
             "and most urgent priorities; its keys open /v1/* as --api-key's do "
             "(docs/serving.md, tenants)")
    tenant_header: str | None = setting(  # a gateway's header naming the tenant
        None, "--tenant-header", TEXT, metavar="NAME", group=SERVER,
        help="a header a gateway sets to name the request's tenant (e.g. x-kvledger-tenant), "
             "believed only from --tenant-header-from, once (given twice: a 400); a name the "
             "tenants file lacks runs at its least urgent tier")
    tenant_header_from: tuple[str, ...] = setting(
        (), "--tenant-header-from", WORDS, metavar="CIDR", group=SERVER,
        help="the peers whose --tenant-header is believed (e.g. the gateway's pod network)")
    objective_header: str | None = setting(  # the operator's, behind an InferencePool
        None, "--objective-header", TEXT, metavar="NAME", group=SERVER,
        help="a header a gateway sets to name the request's InferenceObjective (e.g. "
             "x-gateway-inference-objective), believed only from --tenant-header-from, "
             "once; its priority (from --objectives-file) is the request's when it asks "
             "none, under --scheduling-policy priority")
    objectives_file: str | None = setting(  # the operator's: the pool's objectives, mounted
        None, "--objectives-file", TEXT, metavar="PATH", group=SERVER,
        help="the objectives --objective-header may name, as YAML (objectives: a list of "
             "name and priority, higher more urgent, as InferenceObjective's), read again "
             "each second when it changes (docs/serving.md, objectives)")
    backfill: bool = setting(
        False, "--backfill", SWITCH, group=SERVER,
        help="plan the first 4 in line at their soonest starts, as the KV pool is projected "
             "(a token per step), and let one planned for now go first: it delays none of "
             "those plans (default off: strict FIFO)")
    max_body_bytes: int = setting(
        4 * 2**20, "--max-body-bytes", BODY_BYTES, group=SERVER,
        help="larger request bodies get 413 (default 4MiB)")
    # Slow clients: a request's headers must arrive within this of its first byte (or of the
    # connection opening), its body within this of its headers; an idle keep-alive
    # connection closes after the last. 75 s outlasts the 60 s idle timeout of common load
    # balancers, so they, not the server, close idle connections (no race on reuse).
    header_timeout_s: float = setting(
        10.0, "--header-timeout", SECONDS, group=SERVER,
        help="close a connection whose request headers take longer than this (default "
             "%(default)g)")
    body_timeout_s: float = setting(
        30.0, "--body-timeout", SECONDS, group=SERVER,
        help="answer 408 to a request whose body takes longer than this after its headers "
             "(default %(default)g)")
    # A client that reads none of an answer while the server holds more than the socket's
    # buffer of it (a 30 MB /tokenize answer) keeps that in memory: this drops it.
    write_timeout_s: float = setting(
        60.0, "--write-timeout", SECONDS, group=SERVER,
        help="close a connection whose client has read nothing of its answer for this long "
             "while the server waits to write more (default %(default)g)")
    keepalive_timeout_s: float = setting(
        75.0, "--keepalive-timeout", SECONDS_OR_ZERO, group=SERVER,
        help="close a keep-alive connection idle this long (default %(default)g; 0: one "
             "request per connection)")
    # A client's 570 KiB anyOf took about 2 s on one core; typical schemas take milliseconds.
    grammar_compile_timeout_s: float = setting(
        10.0, "--grammar-compile-timeout", SECONDS, group=SERVER,
        help="a structured-output schema whose grammar takes longer than this to compile is "
             "a 400 (default %(default)g)")
    tool_call_parser: str | None = setting(  # None: the one the chat template shows
        None, "--tool-call-parser", PARSER, group=OPENAI_API,
        help=f"vLLM's: the tool-call format, one of {', '.join(PARSER.values)} (default: the "
             "one the chat template shows, else hermes)",
        crd=Crd("tools", "the format calls are written and parsed in (--tool-call-parser; "
                         "default: the chat template's)"))
    reasoning_parser: str | None = setting(  # None: answers are not split
        None, "--reasoning-parser", REASONING_PARSER, group=OPENAI_API,
        help=f"vLLM's: split a think-tag model's answer into message.reasoning and its "
             f"content, one of {', '.join(REASONING_PARSER.values)} (default: not split)",
        crd=Crd("", "split a think-tag model's answer into message.reasoning and its "
                    "content (--reasoning-parser: vLLM's parser of that name)"))
    structured_outputs_config: StructuredOutputsConfig = setting(  # noqa: RUF009 (frozen)
        StructuredOutputsConfig(), "--structured-outputs-config", STRUCTURED_OUTPUTS,
        group=OPENAI_API,
        help="vLLM's JSON, or its keys one by one (--structured-outputs-config.backend "
             "guidance): backend (auto, guidance: llguidance, kvledger's engine; xgrammar, "
             "outlines, lm-format-enforcer: llguidance writing JSON as they do, objects "
             "closed, their whitespace, serving what they would refuse), "
             "disable_any_whitespace, disable_additional_properties, enable_in_reasoning "
             "(constrain the reasoning too), reasoning_parser (docs/serving.md)",
        crd=Crd("", "vLLM's --structured-outputs-config: how JSON is written, and whether "
                    "the constraint covers the reasoning", name="structuredOutputs"))
    enable_auto_tool_choice: bool = setting(
        False, "--enable-auto-tool-choice", SWITCH, group=OPENAI_API,
        help="vLLM's: serve tool_choice \"auto\" (the model chooses; its calls are parsed with "
             "--tool-call-parser); without it \"auto\", the default when a request gives "
             "tools, is a 400",
        crd=Crd("tools", "let the model choose to call (--enable-auto-tool-choice)"))
    chat_template: str | None = setting(  # serve reads and compiles it: the template's source
        None, "--chat-template", TEXT, metavar="FILE|TEMPLATE", group=OPENAI_API,
        help="vLLM's: render every chat with this jinja2 template (a file's path, or the "
             "template itself) instead of the model's (chat_template.jinja, "
             "additional_chat_templates/, tokenizer_config.json's chat_template)")
    trust_request_chat_template: bool = setting(
        False, "--trust-request-chat-template", SWITCH, group=OPENAI_API,
        help="vLLM's: let a request's own chat_template render it (a template is code the "
             "server runs; default off: such a request is a 400)")
    response_role: str = setting(
        "assistant", "--response-role", TEXT, metavar="ROLE", group=OPENAI_API,
        help="vLLM's: the role a chat's answer has when the request asks for a generation "
             "prompt (else the last message's, as vLLM answers; default %(default)s)")
    chat_template_content_format: str = setting(
        "auto", "--chat-template-content-format", choice(CONTENT_FORMATS), group=OPENAI_API,
        help="vLLM's: how the chat template gets a message's content: string (text parts "
             "joined by newlines), openai (a list of {\"type\": \"text\", \"text\": ...} "
             "parts), or auto (default: openai when the template loops over a message's "
             "content, else string)")
    default_chat_template_kwargs: Mapping[str, Any] = setting(  # under a request's own
        None, "--default-chat-template-kwargs", JSON_OBJECT, group=OPENAI_API, factory=dict,
        help="vLLM's: variables every chat template render gets (e.g. "
             "'{\"enable_thinking\": false}'); a request's chat_template_kwargs override them")
    allow_runtime_lora_updating: bool = setting(  # server/lora_routes.py
        False, "--allow-runtime-lora-updating", ON, group=OPENAI_API,
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with "
             "--enable-lora), as vLLM does when $VLLM_ALLOW_RUNTIME_LORA_UPDATING is true "
             "(that variable is read too)",
        crd=Crd("", "serve /v1/load_lora_adapter and /v1/unload_lora_adapter "
                    "(--allow-runtime-lora-updating; needs apiKeySecretRef)"))
    sleep_level_file: str | None = setting(  # the operator's: spec.sleep, mounted
        None, "--sleep-level-file", TEXT, metavar="PATH", group=SERVER,
        help="with --enable-sleep-mode: a file naming the sleep level the engine should be "
             "at (0, 1 or 2; empty or absent: awake), read every second; each change is "
             "acted on as POST /sleep (waiting for what is admitted) or /wake_up would")
    # Cross-origin requests from browsers (server/cors.py): off unless origins are named,
    # where vLLM's default allows every origin.
    allowed_origins: tuple[str, ...] = setting(
        (), "--allowed-origins", JSON_STRINGS, group=OPENAI_API,
        help="vLLM's: the origins whose browsers may call the API, a JSON list ('[\"*\"]': "
             "any; unless given, none: no CORS headers, where vLLM allows every origin)")
    allowed_methods: tuple[str, ...] = setting(
        ("*",), "--allowed-methods", JSON_STRINGS, group=OPENAI_API,
        help="vLLM's: the methods such a browser may use, a JSON list (unless given, all)")
    allowed_headers: tuple[str, ...] = setting(
        ("*",), "--allowed-headers", JSON_STRINGS, group=OPENAI_API,
        help="vLLM's: the request headers such a browser may send, a JSON list (unless "
             "given, any)")
    allow_credentials: bool = setting(
        False, "--allow-credentials", SWITCH, group=OPENAI_API,
        help="vLLM's: let such a browser send its cookies and credentials (the origin is then "
             "named, never '*')")
    log_level: str = setting(
        "info", "--log-level", LOG_LEVEL, group=OPENAI_API,
        help="the server's log level: critical, error, warning, info or debug, in any case "
             "(vLLM's DEBUG is debug; default %(default)s)")
    log_requests: bool = setting(
        False, "--enable-log-requests", SWITCH, group=OPENAI_API,
        help="vLLM's: log a line per admitted request (its id, prompt tokens, max_tokens, n, "
             "model and sampling parameters; never the prompt's text)")
    return_tokens_as_token_ids: bool = setting(
        False, "--return-tokens-as-token-ids", SWITCH, group=OPENAI_API,
        help="vLLM's: logprobs name their tokens token_id:N for every request (a request's "
             "own return_tokens_as_token_ids does it for that request)")
    prompt_tokens_details: bool = setting(  # usage.prompt_tokens_details.cached_tokens
        False, "--enable-prompt-tokens-details", SWITCH, group=OPENAI_API,
        help="vLLM's: answers' usage carry prompt_tokens_details.cached_tokens, the prompt "
             "tokens found in the prefix cache (with several tenants, add "
             "--cache-salt-per-key, or it tells one what another sent)")
    max_logprobs: int = setting(
        MAX_LOGPROBS, "--max-logprobs", LOGPROBS, group=OPENAI_API,
        help=f"vLLM's: the most logprobs a request may ask per token (default and most "
             f"{MAX_LOGPROBS}); more is a 400")

    def __post_init__(self) -> None:
        outputs = self.structured_outputs_config  # its reasoning_parser, unless the flag's
        if self.reasoning_parser is None and getattr(outputs, "reasoning_parser", ""):
            object.__setattr__(self, "reasoning_parser", outputs.reasoning_parser)
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        object.__setattr__(self, "tenant_header_from", tuple(self.tenant_header_from))
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        check_settings(self, ServeConfig)  # each value in its kind's domain
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise BadInput("--enable-auto-tool-choice requires --tool-call-parser")

    def to_flags(self, given: Collection[str] = ()) -> list[str]:
        """The flags that reproduce these options (``render_flags``; ``given``: the fields a
        resource set, passed on at their defaults too)."""
        return render_flags(self, given)
