"""``kvledger serve``: listen at once (``/health``), plan and load, warm up (``/ready``), serve;
on SIGTERM (or Ctrl-C's SIGINT) stop admitting, let in-flight requests finish within the
grace, exit 0; a tensor-parallel rank that dies: /health 503, every request failed, exit 1.
This module is the verb (its flags, checked once); ``server/serve.py`` runs the server."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys

from kvledger.engine import json_text, serve_defaults
from kvledger.engine.checkpoint.hub.cache import offline_snapshot
from kvledger.engine.checkpoint.hub.uri import is_hub_uri, parse_uri
from kvledger.engine.config_flags import add_engine_flags, config_from_args
from kvledger.engine.errors import BadInput
from kvledger.engine.model.chat_template import compiled, template_argument
from kvledger.engine.node_config import add_node_flags, nodes_from_args
from kvledger.engine.sampling.params import MAX_LOGPROBS
from kvledger.engine.server.serve import serve
from kvledger.engine.server.state import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    ServeOptions,
)
from kvledger.engine.server.tenants import read_tenants_file
from kvledger.engine.settings import positive_seconds, size_arg
from kvledger.engine.vllm_flags import PARSERS, RULES, add_vllm_flags, refusal

HELP = "plan (measured), load the model and serve HTTP"


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _tool_call_parser(name: str) -> str:
    """One of ``PARSERS``; any other is refused by name as plan refuses it."""
    if name not in PARSERS:
        raise BadInput(refusal("--tool-call-parser", [name], RULES["--tool-call-parser"]))
    return name


def _chat_template(value: str) -> str:
    """--chat-template's template, read and compiled now: a bad one exits 2 before the
    server listens."""
    source = template_argument(value)
    try:
        compiled(source)
    except BadInput as exc:
        raise BadInput(f"--chat-template: {exc}") from None
    return source


def _max_logprobs(text: str) -> int:
    """--max-logprobs: 0..MAX_LOGPROBS; vLLM's -1 (the vocabulary) is refused by name."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= MAX_LOGPROBS:
        raise BadInput(f"--max-logprobs {text}: kvledger reports at most {MAX_LOGPROBS} "
                       f"logprobs per token (0-{MAX_LOGPROBS})")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json_text.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _add_line_flags(s) -> None:
    """The admission line's flags: its length and the tenants that share it."""
    s.add_argument("--max-queue-len", type=_count, default=serve_defaults.MAX_QUEUE_LEN, metavar="N",
                   help="requests that cannot be reserved now wait in one line of at most "
                        f"N (default {serve_defaults.MAX_QUEUE_LEN}; nobody overtakes the first in "
                        "its order, unless --backfill); a request that finds it full is a 429 "
                        "queue_full (0: no line, answer at once)")
    s.add_argument("--max-queue-len-per-tenant", type=_count, default=None, metavar="N",
                   help="places in line one API key may hold; one more is a 429 "
                        "tenant_queue_full for that key alone (default: half the line with "
                        "two keys or more, else all of it)")
    s.add_argument("--tenants-file", default=None, metavar="PATH",
                   help="tenants as YAML (a mounted Secret): each a name (its metrics "
                        "label), its API keys, its weight in the line, its places in line "
                        "(maxQueued) and its default and most urgent priorities; its keys "
                        "open /v1/* as --api-key's do (docs/serving.md, tenants)")
    s.add_argument("--tenant-header", default=None, metavar="NAME",
                   help="a header a gateway sets to name the request's tenant (e.g. "
                        "x-kvledger-tenant), believed only from --tenant-header-from, once "
                        "(given twice: a 400); a name the tenants file lacks runs at its "
                        "least urgent tier")
    s.add_argument("--tenant-header-from", nargs="+", action="extend", default=None,
                   metavar="CIDR", help="the peers whose --tenant-header is believed "
                                        "(e.g. the gateway's pod network)")
    s.add_argument("--tenant-fairness", action=argparse.BooleanOptionalAction,
                   default=serve_defaults.TENANT_FAIRNESS,
                   help="the line takes turns between API keys (weighted fair queuing), so "
                        "one key's flood delays another key's request by about one admission "
                        "(default on; --no-tenant-fairness: arrival order)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_flags(parser)
    add_node_flags(parser)
    s = parser.add_argument_group("server")
    s.add_argument("--host", default="0.0.0.0",
                   help="the address to listen on (default 0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=serve_defaults.PORT,
                   help=f"the port to listen on (default {serve_defaults.PORT})")
    s.add_argument("--api-key", nargs="+", action="extend", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and "
                        "/detokenize; several keys (repeat the flag, or list them) each open "
                        "it (default: $KVLEDGER_API_KEY; unset = no key)")
    s.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="more API keys, one per line (blank lines and # comments skipped), "
                        "e.g. a mounted Secret")
    s.add_argument("--cache-salt-per-key", action="store_true",
                   help="key the prefix cache by API key too: requests under different keys "
                        "never share KV blocks, so none can tell from its timing what another "
                        "key's clients sent")
    s.add_argument("--metrics-api-key", default=os.environ.get("KVLEDGER_METRICS_API_KEY"),
                   metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /metrics (default: "
                        "$KVLEDGER_METRICS_API_KEY; unset = open, as Prometheus expects; its "
                        "prefix-cache counters tell how much of a guessed prompt was cached)")
    _add_line_flags(s)
    s.add_argument("--backfill", action=argparse.BooleanOptionalAction, default=False,
                   help="plan the first 4 in line at their soonest starts, as the KV pool "
                        "is projected (a token per step), and let one planned for now go "
                        "first: it delays none of those plans (default off: strict FIFO)")
    s.add_argument("--max-queue-wait", type=_seconds, default=None, metavar="SECONDS",
                   help="a request waits in line at most this long before its 429 (default: "
                        "as long as it takes, or until its client leaves; 0: answer at once)")
    s.add_argument("--shutdown-grace", type=_seconds, default=float(serve_defaults.SHUTDOWN_GRACE_S),
                   metavar="SECONDS",
                   help="on SIGTERM, let in-flight requests run this long before aborting them "
                        f"(default {serve_defaults.SHUTDOWN_GRACE_S})")
    s.add_argument("--max-body-bytes", type=size_arg, default=DEFAULT_MAX_BODY_BYTES,
                   metavar="SIZE", help="larger request bodies get 413 (default 4MiB)")
    s.add_argument("--header-timeout", type=positive_seconds, default=DEFAULT_HEADER_TIMEOUT_S,
                   metavar="SECONDS", help="close a connection whose request headers take "
                   f"longer than this (default {DEFAULT_HEADER_TIMEOUT_S:g})")
    s.add_argument("--body-timeout", type=positive_seconds, default=DEFAULT_BODY_TIMEOUT_S,
                   metavar="SECONDS", help="answer 408 to a request whose body takes longer "
                   f"than this after its headers (default {DEFAULT_BODY_TIMEOUT_S:g})")
    s.add_argument("--keepalive-timeout", type=_seconds, default=DEFAULT_KEEPALIVE_TIMEOUT_S,
                   metavar="SECONDS", help="close a keep-alive connection idle this long "
                   f"(default {DEFAULT_KEEPALIVE_TIMEOUT_S:g}; 0: one request per connection)")
    s.add_argument("--grammar-compile-timeout", type=positive_seconds,
                   default=DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, metavar="SECONDS",
                   help="a structured-output schema whose grammar takes longer than this to "
                        f"compile is a 400 (default {DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S:g})")
    _api_flags(parser.add_argument_group("the OpenAI API (vLLM's flags)"))
    add_vllm_flags(parser)


def _api_flags(s: argparse._ArgumentGroup) -> None:
    """Tool calling, chat templates, LoRA updates, logging and what answers carry."""
    s.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="vLLM's: serve tool_choice \"auto\" (the model chooses; its calls are "
                        "parsed with --tool-call-parser); without it \"auto\", the default "
                        "when a request gives tools, is a 400")
    s.add_argument("--tool-call-parser", type=_tool_call_parser, default=None, metavar="NAME",
                   help=f"vLLM's: the tool-call format, one of {', '.join(PARSERS)} "
                        "(default: the one the chat template shows, else hermes)")
    s.add_argument("--chat-template", type=_chat_template, default=None, metavar="FILE|TEMPLATE",
                   help="vLLM's: render every chat with this jinja2 template (a file's path, or "
                        "the template itself) instead of the model's (chat_template.jinja, "
                        "additional_chat_templates/, tokenizer_config.json's chat_template)")
    s.add_argument("--trust-request-chat-template", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="vLLM's: let a request's own chat_template render it (a template is "
                        "code the server runs; default off: such a request is a 400)")
    s.add_argument("--default-chat-template-kwargs", type=_json_object, default={},
                   metavar="JSON",
                   help="vLLM's: variables every chat template render gets (e.g. "
                        "'{\"enable_thinking\": false}'); a request's chat_template_kwargs "
                        "override them")
    s.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with "
                        "--enable-lora), as vLLM does when $VLLM_ALLOW_RUNTIME_LORA_UPDATING "
                        "is true (that variable is read too)")
    s.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error"),
                   help="the server's log level (default info)")
    s.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="vLLM's: log a line per admitted request (its id, prompt tokens, "
                        "max_tokens, n, model and sampling parameters; never the prompt's text)")
    s.add_argument("--return-tokens-as-token-ids", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="vLLM's: logprobs name their tokens token_id:N for every request (a "
                        "request's own return_tokens_as_token_ids does it for that request)")
    s.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="vLLM's: answers' usage carry prompt_tokens_details.cached_tokens, the "
                        "prompt tokens found in the prefix cache (with several tenants, add "
                        "--cache-salt-per-key, or it tells one what another sent)")
    s.add_argument("--max-logprobs", type=_max_logprobs, default=MAX_LOGPROBS, metavar="N",
                   help=f"vLLM's: the most logprobs a request may ask per token (default and "
                        f"most {MAX_LOGPROBS}); more is a 400")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0 <= args.port <= 65535:
        raise BadInput(f"--port must be in 0..65535, got {args.port}")
    if args.max_body_bytes < 1:
        raise BadInput(f"--max-body-bytes must be at least 1 byte, got {args.max_body_bytes}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise BadInput("--enable-auto-tool-choice requires --tool-call-parser")
    config = config_from_args(args)
    nodes = nodes_from_args(args, config.tensor_parallel_size * config.pipeline_parallel_size)
    if nodes is not None and nodes.rank > 0:  # no API here: this machine's ranks only
        from kvledger.engine.core.node_machine import run_node

        return run_node(config, nodes)
    config = dataclasses.replace(config, nodes=nodes)
    if is_hub_uri(config.model):
        from huggingface_hub import constants

        if constants.is_offline_mode():
            # Not in the (read-only) cache: say so at once, before listening, not after.
            offline_snapshot(parse_uri(config.model), config.download_dir)
    api_keys = _api_keys(args)
    tenants = read_tenants_file(args.tenants_file) if args.tenants_file else ()
    if args.cache_salt_per_key and not api_keys and not any(t.keys for t in tenants):
        raise BadInput("--cache-salt-per-key needs API keys (--api-key, --api-key-file or "
                       "--tenants-file)")
    options = ServeOptions(api_keys=api_keys, salt_cache_per_key=args.cache_salt_per_key,
                           metrics_api_key=args.metrics_api_key or None,
                           max_queue_wait_s=args.max_queue_wait,
                           max_queue_len=args.max_queue_len,
                           backfill=args.backfill,
                           tenant_fairness=args.tenant_fairness,
                           max_queue_len_per_tenant=args.max_queue_len_per_tenant,
                           tenants=tenants, tenant_header=args.tenant_header,
                           tenant_header_from=tuple(args.tenant_header_from or ()),
                           shutdown_grace_s=args.shutdown_grace,
                           max_body_bytes=args.max_body_bytes,
                           header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                           keepalive_timeout_s=args.keepalive_timeout,
                           grammar_compile_timeout_s=args.grammar_compile_timeout,
                           enable_auto_tool_choice=args.enable_auto_tool_choice,
                           tool_call_parser=args.tool_call_parser,
                           allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                           log_requests=args.enable_log_requests,
                           return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                           prompt_tokens_details=args.enable_prompt_tokens_details,
                           max_logprobs=args.max_logprobs,
                           chat_template=args.chat_template,
                           trust_request_chat_template=args.trust_request_chat_template,
                           default_chat_template_kwargs=args.default_chat_template_kwargs)
    return asyncio.run(serve(config, options, args.host, args.port))


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key's keys (else $KVLEDGER_API_KEY's) and --api-key-file's, in that order."""
    keys = list(args.api_key or [])
    if not keys and os.environ.get("KVLEDGER_API_KEY"):
        keys.append(os.environ["KVLEDGER_API_KEY"])
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as file:
                lines = file.read().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise BadInput(f"--api-key-file {args.api_key_file}: cannot read it ({exc})") from None
        from_file = [line.strip() for line in lines
                     if line.strip() and not line.lstrip().startswith("#")]
        if not from_file:
            raise BadInput(f"--api-key-file {args.api_key_file} holds no key")
        keys += from_file
    if any(not key.strip() for key in keys):
        raise BadInput("--api-key must not be empty")
    return tuple(dict.fromkeys(keys))


