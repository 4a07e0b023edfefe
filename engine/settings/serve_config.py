"""``kvledger serve``'s own options (the server's, beside the engine's ``EngineConfig``) as
one validated dataclass.

Each field is declared once, with ``setting(...)`` (``engine/settings/declare.py``): its default,
its flag, its kind, its ``--help`` line (which shows the default as ``%(default)s``, never
a copy) and, where the InferenceService exposes it, its CRD field (``spec.<name>`` or
``spec.tools.<name>``, whose description may show the default the same way). What each
accepts is ``serve_values.py``'s. Generated from these declarations: serve's flags
(``add_setting_flags``), the server's options (``server/state.py``'s ``ServeOptions`` is
this plus the tenants read from ``--tenants-file``), and in the operator the CRD's fields,
the spec's mapping and the pod's flags. The fields come in three parts, the listener's
(``listener_config.py``), the line's (``line_config.py``) and the OpenAI API's (here), in
the order the pod's flags are written, each ``--help`` group in that order too.

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
from kvledger.engine.settings.kinds import ON, POSITIVE_INT, SECONDS_OR_ZERO, SWITCH, TEXT, choice
from kvledger.engine.settings.line_config import LineConfig
from kvledger.engine.settings.listener_config import ListenerConfig
from kvledger.engine.settings.serve_values import (
    JSON_OBJECT,
    JSON_STRINGS,
    LOG_LEVEL,
    LOGPROBS,
    OPENAI_API,
    PARSER,
    REASONING_PARSER,
    SERVER,
    STRUCTURED_OUTPUTS,
)
from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig


@dataclass(frozen=True)
class ServeConfig(LineConfig, ListenerConfig):
    """Every option of ``kvledger serve`` that is not the engine's: the listener's
    (``ListenerConfig``), the line's (``LineConfig``), then the OpenAI API's, declared here.
    One declaration per field (``setting``): its default, flag, kind, help and, for the
    InferenceService, its CRD field (``defaulted``: the CRD declares the default, and the
    pod always gets it)."""

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
    enable_force_include_usage: bool = setting(  # server/openai_api.py
        False, "--enable-force-include-usage", SWITCH, group=OPENAI_API,
        help="vLLM's: every streamed completion and chat carries its usage, on every chunk "
             "and in a last chunk, as if it asked stream_options {\"include_usage\": true, "
             "\"continuous_usage_stats\": true}")
    enable_request_id_headers: bool = setting(  # server/request_id.py
        False, "--enable-request-id-headers", SWITCH, group=OPENAI_API,
        help="vLLM's: every response carries an X-Request-Id header, the request's own "
             "(echoed) or a new random one")
    exclude_tools_when_tool_choice_none: bool = setting(  # server/request_fields.py
        False, "--exclude-tools-when-tool-choice-none", SWITCH, group=OPENAI_API,
        help="vLLM's: a chat whose tool_choice is \"none\" is rendered without its tools "
             "(else the chat template shows them all the same)")
    enable_server_load_tracking: bool = setting(  # server/server_load.py
        False, "--enable-server-load-tracking", SWITCH, group=OPENAI_API,
        help="vLLM's: GET /load answers {\"server_load\": N}, the generation requests in "
             "flight (without it, 0)")
    enable_tokenizer_info_endpoint: bool = setting(  # server/tokenizer_info.py
        False, "--enable-tokenizer-info-endpoint", SWITCH, group=OPENAI_API,
        help="vLLM's: serve GET /tokenizer_info (tokenizer_config.json's settings and the "
             "chat template), behind the API key as /tokenize is")
    stream_interval: int = setting(  # server/stream_interval.py
        1, "--stream-interval", POSITIVE_INT, group=OPENAI_API,
        help="vLLM's: a streamed answer goes out every N tokens, its first and last at once "
             "(a request's stream_interval may raise it; default %(default)s: every token)")
    sse_keep_alive_interval_s: float = setting(  # server/keep_alive.py
        0, "--sse-keep-alive-interval", SECONDS_OR_ZERO, group=OPENAI_API,
        help="vLLM's: a streamed completion or chat sends an SSE comment (': keep-alive') "
             "whenever it has sent nothing for this many seconds, so a proxy's read timeout "
             "does not cut an answer still prefilling (default %(default)s: none; nothing is sent "
             "while a request waits in line, whose answer may be a 429)")
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
