"""Every option of ``kvledger serve`` that is not the engine's is one ServeConfig field
(engine/settings/serve_config.py): its flag, default, help and CRD field; serve's "server" and "the
OpenAI API" flags are generated from those declarations, and the server runs with them."""

from __future__ import annotations

import argparse
import re

import pytest

from kvledger.engine.cli import build_parser
from kvledger.engine.errors import BadInput
from kvledger.engine.server.state import ServeOptions
from kvledger.engine.settings.declare import (
    add_setting_flags,
    default_of,
    settings_of,
    values_from_args,
)
from kvledger.engine.settings.kinds import parse_size
from kvledger.engine.settings.serve_config import ServeConfig
from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig

# field -> (its flag, spec.SECTION.NAME, its default): a new field must be added here, on
# purpose; "" is spec's own level.
DECLARED = {
    "host": ("--host", None, "0.0.0.0"),
    "port": ("--port", ".port", 8000),
    "uds": ("--uds", None, None),
    # TLS: not in the CRD (a gateway or ingress terminates it in a cluster)
    "ssl_keyfile": ("--ssl-keyfile", None, None),
    "ssl_certfile": ("--ssl-certfile", None, None),
    "ssl_ca_certs": ("--ssl-ca-certs", None, None),
    "ssl_cert_reqs": ("--ssl-cert-reqs", None, 0),
    "ssl_ciphers": ("--ssl-ciphers", None, None),
    "enable_ssl_refresh": ("--enable-ssl-refresh", None, False),
    "root_path": ("--root-path", None, None),
    "api_keys": ("--api-key", None, ()),  # apiKeySecretRef: the engine's KVLEDGER_API_KEY
    "api_key_file": ("--api-key-file", None, None),
    "salt_cache_per_key": ("--cache-salt-per-key", None, False),
    "metrics_api_key": ("--metrics-api-key", None, None),
    "shutdown_grace_s": ("--shutdown-grace", ".shutdownGraceSeconds", 30),
    "max_queue_wait_s": ("--max-queue-wait", ".maxQueueWaitSeconds", None),
    "max_queue_len": ("--max-queue-len", ".maxQueueLength", 256),
    "max_queue_len_per_tenant": ("--max-queue-len-per-tenant", ".maxQueueLengthPerTenant",
                                 None),
    "tenant_fairness": ("--tenant-fairness", ".tenantFairness", True),
    "tenants_file": ("--tenants-file", None, None),  # from tenantsSecretRef, mounted
    "sleep_level_file": ("--sleep-level-file", None, None),  # from spec.sleep, mounted
    "tenant_header": ("--tenant-header", None, None),
    "tenant_header_from": ("--tenant-header-from", None, ()),
    "objective_header": ("--objective-header", None, None),
    "objectives_file": ("--objectives-file", None, None),
    "backfill": ("--backfill", None, False),
    "max_body_bytes": ("--max-body-bytes", None, 4 * 2**20),
    "header_timeout_s": ("--header-timeout", None, 10.0),
    "body_timeout_s": ("--body-timeout", None, 30.0),
    "write_timeout_s": ("--write-timeout", None, 60.0),
    "keepalive_timeout_s": ("--keepalive-timeout", None, 75.0),
    "grammar_compile_timeout_s": ("--grammar-compile-timeout", None, 10.0),
    "tool_call_parser": ("--tool-call-parser", "tools.toolCallParser", None),
    "reasoning_parser": ("--reasoning-parser", ".reasoningParser", None),
    "structured_outputs_config": ("--structured-outputs-config", ".structuredOutputs",
                                  StructuredOutputsConfig()),
    "enable_auto_tool_choice": ("--enable-auto-tool-choice", "tools.enableAutoToolChoice",
                                False),
    "chat_template": ("--chat-template", None, None),
    "response_role": ("--response-role", None, "assistant"),
    "chat_template_content_format": ("--chat-template-content-format", None, "auto"),
    "trust_request_chat_template": ("--trust-request-chat-template", None, False),
    "default_chat_template_kwargs": ("--default-chat-template-kwargs", None, {}),
    "allow_runtime_lora_updating": ("--allow-runtime-lora-updating",
                                    ".allowRuntimeLoraUpdating", False),
    "allowed_origins": ("--allowed-origins", None, ()),
    "allowed_methods": ("--allowed-methods", None, ("*",)),
    "allowed_headers": ("--allowed-headers", None, ("*",)),
    "allow_credentials": ("--allow-credentials", None, False),
    "log_level": ("--log-level", None, "info"),
    "log_requests": ("--enable-log-requests", None, False),
    "return_tokens_as_token_ids": ("--return-tokens-as-token-ids", None, False),
    "prompt_tokens_details": ("--enable-prompt-tokens-details", None, False),
    "enable_force_include_usage": ("--enable-force-include-usage", None, False),
    "enable_request_id_headers": ("--enable-request-id-headers", None, False),
    "exclude_tools_when_tool_choice_none": ("--exclude-tools-when-tool-choice-none", None,
                                            False),
    "enable_server_load_tracking": ("--enable-server-load-tracking", None, False),
    "enable_tokenizer_info_endpoint": ("--enable-tokenizer-info-endpoint", None, False),
    "stream_interval": ("--stream-interval", None, 1),
    "sse_keep_alive_interval_s": ("--sse-keep-alive-interval", None, 0),
    "max_logprobs": ("--max-logprobs", None, 20),
}
SERVE_GROUPS = ("server", "the OpenAI API (vLLM's flags)")


def test_every_option_is_declared_with_its_flag_crd_field_and_default() -> None:
    declared = {f.name: (s.flag, s.crd and f"{s.crd.section}.{s.spec_name}", default_of(f))
                for f, s in settings_of(ServeConfig)}
    assert declared == DECLARED


def test_serves_own_flags_are_the_declared_ones_with_their_defaults() -> None:
    """The groups of serve's --help hold exactly ServeConfig's flags, and parsing nothing
    gives ServeConfig's defaults: no flag is declared by hand beside them."""
    parser = build_parser("serve")
    groups = {g.title: g for g in parser._action_groups}
    actions = [a for title in SERVE_GROUPS for a in groups[title]._group_actions]
    assert {a.option_strings[0] for a in actions} == {flag for flag, _, _ in DECLARED.values()}
    assert all(a.help and a.dest in DECLARED for a in actions)
    args = parser.parse_args(["--model", "/m"])
    assert ServeConfig(**values_from_args(args, ServeConfig)) == ServeConfig()


def test_help_shows_each_declared_default() -> None:
    """A help line that names its default names the declared one (argparse's %(default)s,
    or the words of a switch and a size): changing a default changes its help."""
    parser = argparse.ArgumentParser()
    add_setting_flags(parser, ServeConfig, {})
    helps = {a.dest: parser._get_formatter()._expand_help(a) for a in parser._actions}
    checked = 0
    for f, declared in settings_of(ServeConfig):
        default = default_of(f)
        said = re.search(r"(?:\(|; )default (?:and most )?([^;:)]+)", helps[f.name])
        if said is None or said.group(1).startswith("$") or default in (None, ()):
            continue
        shown, checked = said.group(1).strip(), checked + 1
        if isinstance(default, bool):
            assert shown == ("on" if default else "off"), declared.flag
        elif declared.kind.metavar == "SIZE":
            assert parse_size(shown) == default, declared.flag
        else:
            assert shown == (f"{default:g}" if isinstance(default, float) else str(default)), \
                declared.flag
    assert checked == 18  # every default a help line names


@pytest.mark.parametrize(("values", "message"), [
    ({"port": 70000}, "--port must be in 0..65535, got 70000"),
    ({"max_body_bytes": 0}, "--max-body-bytes must be at least 1 byte, got 0"),
    ({"enable_auto_tool_choice": True}, "--enable-auto-tool-choice requires --tool-call-parser"),
    ({"max_queue_len": -1}, "--max-queue-len must be a whole number >= 0, got -1"),
    ({"shutdown_grace_s": -1}, "--shutdown-grace must be a number of seconds >= 0, got -1"),
    ({"tool_call_parser": "openai"}, "--tool-call-parser openai"),
    ({"reasoning_parser": "granite"}, "--reasoning-parser granite"),
    ({"max_logprobs": 21}, "--max-logprobs 21: kvledger reports at most 20"),
])
def test_a_value_out_of_its_kind_is_one_line_naming_the_flag(values, message) -> None:
    with pytest.raises(BadInput, match=f"^{re.escape(message)}"):
        ServeConfig(**values)


def test_the_server_runs_with_the_declared_options_and_the_tenants_read() -> None:
    config = ServeConfig(max_queue_len=7, api_keys=["k"], tenant_header_from=["10.0.0.0/8"])
    assert (config.api_keys, config.tenant_header_from) == (("k",), ("10.0.0.0/8",))
    options = ServeOptions.of(config, metrics_api_key="m")
    assert (options.max_queue_len, options.metrics_api_key, options.tenants) == (7, "m", ())
    assert ServeOptions().max_queue_len == 256 and ServeOptions().shutdown_grace_s == 30


def test_the_flags_render_back_to_the_same_options() -> None:
    config = ServeConfig(port=9000, max_queue_wait_s=0, tenant_fairness=False,
                         api_keys=("a", "b"), default_chat_template_kwargs={"x": 1},
                         tool_call_parser="hermes", enable_auto_tool_choice=True,
                         allow_runtime_lora_updating=True)
    flags = config.to_flags()
    assert flags[:4] == ["--port", "9000", "--api-key", "a"]
    args = build_parser("serve").parse_args(["--model", "/m", *flags])
    assert ServeConfig(**values_from_args(args, ServeConfig)) == config
    assert ServeConfig().to_flags() == []
    # A field a resource gives is passed on at its default too; a switch only off.
    assert ServeConfig().to_flags(given={"max_queue_len", "tenant_fairness"}) == [
        "--max-queue-len", "256"]
