"""serve's own options reach the resource from one declaration each (ServeConfig,
engine/settings/serve_config.py): the CRD's fields of spec and spec.tools, their defaults, the
spec's mapping and the pod's flags, which serve parses back to the same options."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvledger.engine.cli import build_parser
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.declare import Crd, setting, settings_of, values_from_args
from kvledger.engine.settings.kinds import COUNT
from kvledger.engine.settings.serve_config import ServeConfig
from kvledger.engine.settings.serve_values import SERVER
from kvledger.operator.api.crd_schema import SPEC_SCHEMA
from kvledger.operator.api.resource import TENANTS_FILE
from kvledger.operator.api.setting_schema import setting_properties
from kvledger.operator.api.spec import parse_spec, spec_settings
from kvledger.operator.api.spec_rules import ruled

MODEL = {"path": "/models/m"}


def test_the_crd_holds_serves_fields_as_declared() -> None:
    spec = SPEC_SCHEMA["properties"]
    for name, schema in setting_properties("", ServeConfig).items():
        assert spec[name] == ruled(schema, name)  # with the field's own rules, if any
    assert spec["tools"]["properties"] == setting_properties("tools", ServeConfig)
    # The CRD's defaults are serve's, and a description may show serve's default.
    assert spec["port"]["default"] == ServeConfig.port == 8000
    assert spec["shutdownGraceSeconds"]["default"] == ServeConfig.shutdown_grace_s
    assert "not set: 256)" in spec["maxQueueLength"]["description"]
    assert "(default true;" in spec["tenantFairness"]["description"]
    assert "default" not in spec["maxQueueLength"]  # not set: serve's own, not the CRD's


def test_only_what_a_resource_may_set_is_a_crd_field() -> None:
    """Keys and local paths stay on the command line: the operator passes a Secret's key as
    env (apiKeySecretRef) and mounts the tenants file (tenantsSecretRef)."""
    exposed = {f.name for f, declared in settings_of(ServeConfig) if declared.crd is not None}
    assert exposed == {"port", "shutdown_grace_s", "max_queue_wait_s", "max_queue_len",
                       "max_queue_len_per_tenant", "tenant_fairness", "tool_call_parser",
                       "enable_auto_tool_choice", "allow_runtime_lora_updating",
                       "reasoning_parser", "structured_outputs_config"}


@pytest.mark.parametrize("raw", [
    {},
    {"port": 9000, "shutdownGraceSeconds": 0, "maxQueueWaitSeconds": 0, "maxQueueLength": 0},
    {"maxQueueLength": 256, "tenantFairness": True, "tools": {"toolCallParser": "hermes"}},
    {"maxQueueLengthPerTenant": 3, "tenantFairness": False,
     "tenantsSecretRef": {"name": "t", "key": "k"}, "allowRuntimeLoraUpdating": True,
     "tools": {"toolCallParser": "mistral", "enableAutoToolChoice": True}},
    {"reasoningParser": "qwen3", "structuredOutputs": {
        "backend": "guidance", "disableAnyWhitespace": True,
        "disableAdditionalProperties": True, "enableInReasoning": True}},
    {"structuredOutputs": {}},
])
def test_the_pods_serve_flags_parse_back_to_the_specs_options(raw) -> None:
    spec = parse_spec({"model": MODEL, **raw})
    flags = spec.serving_flags()
    assert flags[:4] == ["--port", str(raw.get("port", 8000)),
                         "--shutdown-grace", str(raw.get("shutdownGraceSeconds", 30))]
    args = build_parser("serve").parse_args(["--model", "/m", *flags])
    assert ServeConfig(**values_from_args(args, ServeConfig)) == spec.serve
    if "tenantsSecretRef" in raw:
        assert spec.serve.tenants_file == TENANTS_FILE
    # What the resource gives is passed on even at serve's default (a switch only off).
    assert ("--max-queue-len" in flags) == ("maxQueueLength" in raw)
    assert "--tenant-fairness" not in flags


@dataclass(frozen=True)
class WithNewField(ServeConfig):
    """ServeConfig plus an option declared the one way a real one is."""

    max_waiters_per_model: int | None = setting(
        None, "--max-waiters-per-model", COUNT, group=SERVER,
        help="requests one model may hold in line",
        crd=Crd("", "requests one model may hold in line (--max-waiters-per-model)"))


def test_a_new_option_is_one_declaration() -> None:
    assert setting_properties("", WithNewField)["maxWaitersPerModel"] == {
        "type": "integer", "minimum": 0,
        "description": "requests one model may hold in line (--max-waiters-per-model)"}
    values = spec_settings({"model": MODEL, "maxWaitersPerModel": 4}, WithNewField)
    assert values == {"port": 8000, "shutdown_grace_s": 30, "max_waiters_per_model": 4}
    assert WithNewField(**values).to_flags(given=values) == [
        "--port", "8000", "--shutdown-grace", "30", "--max-waiters-per-model", "4"]


def test_spec_structured_outputs_are_vllms_config_and_its_flag() -> None:
    """spec.structuredOutputs is --structured-outputs-config with vLLM's keys; a field the
    CRD lacks (kvledger run has no API server to prune it) is refused by name."""
    raw = {"model": MODEL, "structuredOutputs": {"backend": "xgrammar",
                                                 "disableAnyWhitespace": True}}
    spec = parse_spec(raw)
    config = spec.serve.structured_outputs_config
    assert (config.backend, config.disable_any_whitespace) == ("xgrammar", True)
    flags = spec.serving_flags()
    at = flags.index("--structured-outputs-config")
    assert flags[at + 1] == '{"backend":"xgrammar","disable_any_whitespace":true}'
    with pytest.raises(BadInput, match=r"^spec\.structuredOutputs has no field 'whitespace'"):
        parse_spec({"model": MODEL, "structuredOutputs": {"whitespace": False}})
