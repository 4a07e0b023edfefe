"""``spec.adapters`` (LoRA adapters beside the model): the pod's preflight and engine get
``--enable-lora --lora-modules NAME=URI`` (and ``spec.engine``'s LoRA limits), a hub
adapter is downloaded by the fetch init container with a hub model, the pre-flight plans
the adapter slots, and what can never work is refused by name."""

from __future__ import annotations

import json

import pytest
from spec_helpers import spec_of

from kvledger.engine.cli import main
from kvledger.engine.errors import BadInput
from kvledger.operator.api.crd import validate_manifest
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.local_run import local_config
from kvledger.operator.render.render import render_pod_spec

ON_VOLUME = {
    "model": {"path": "/models/llama", "name": "llama",
              "volume": {"hostPath": {"path": "/srv/models"}, "mountPath": "/models"}},
    "engine": {"maxLoras": 2, "maxLoraRank": 32, "maxCpuLoras": 4},
    "adapters": [{"name": "sql", "uri": "/models/adapters/sql/"},
                 {"name": "chat", "uri": "/models/adapters/chat"}],
}
ON_HUB = {
    "model": {"uri": "hf://org/base", "cache": {"persistentVolumeClaim": {"claimName": "c"}}},
    "adapters": [{"name": "sql", "uri": "hf://org/sql-lora@v2"},
                 {"name": "local", "uri": "/var/cache/kvledger/mine"}],
}


def _manifest(spec: dict) -> dict:
    return {"apiVersion": "kvledger.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "m"}, "spec": spec}


def _containers(spec: dict) -> dict[str, dict]:
    pod = render_pod_spec(spec_of(spec))
    return {c["name"]: c for c in pod["initContainers"] + pod["containers"]}


def test_adapters_render_vllms_flags_for_preflight_and_engine():
    validate_manifest(_manifest(ON_VOLUME))
    containers = _containers(ON_VOLUME)
    lora = ["--enable-lora", "--lora-modules", "sql=/models/adapters/sql",
            "chat=/models/adapters/chat", "--max-loras", "2", "--max-lora-rank", "32",
            "--max-cpu-loras", "4"]
    for name in ("preflight", "engine"):
        args = containers[name]["args"]
        at = args.index("--enable-lora")
        assert args[at:at + len(lora)] == lora, name
    assert "fetch" not in containers


def test_hub_adapters_are_fetched_with_the_hub_model():
    validate_manifest(_manifest(ON_HUB))
    containers = _containers(ON_HUB)
    assert containers["fetch"]["args"] == ["--model", "hf://org/base", "--download-dir",
                                           "/var/cache/kvledger", "--lora-modules",
                                           "sql=hf://org/sql-lora@v2"]
    engine = containers["engine"]["args"]
    assert engine[engine.index("--lora-modules") + 1:][:2] == [
        "sql=hf://org/sql-lora@v2", "local=/var/cache/kvledger/mine"]
    assert "--enable-lora" in containers["preflight"]["args"]


@pytest.mark.parametrize(("adapters", "message"), [
    ([{"name": "sql", "uri": "hf://org/sql-lora"}],
     r"spec.adapters sql: a hub adapter \(hf://org/sql-lora\) is downloaded into a hub model"),
    ([{"name": "sql", "uri": "/models/../etc"}], r"spec.adapters sql: uri must be"),
    ([{"name": "a", "uri": "/models/x"}, {"name": "a", "uri": "/models/y"}],
     r"names 'a' twice"),
    # the pod mounts the model's volume only: `kvledger run` mapped such a path to nothing
    ([{"name": "a", "uri": "/srv/adapters/a"}],
     r"spec.adapters a: the directory /srv/adapters/a is not on the model's volume"),
])
def test_adapters_that_can_never_work_are_refused_by_name(adapters, message):
    with pytest.raises(BadInput, match=message):
        parse_spec({**ON_VOLUME, "adapters": adapters})


@pytest.mark.parametrize("adapter", [{"name": "sql", "uri": "relative/dir"},
                                     {"name": "bad name", "uri": "/x"},
                                     {"name": "sql"}])
def test_the_crd_schema_refuses_malformed_adapters(adapter):
    with pytest.raises(BadInput, match="adapters"):
        validate_manifest(_manifest({**ON_VOLUME, "adapters": [adapter]}))


def test_run_maps_adapter_directories_through_the_hostpath_volume():
    config = local_config(spec_of(ON_VOLUME))
    assert [(m.name, m.path) for m in config.lora_modules] == [
        ("sql", "/srv/models/adapters/sql"), ("chat", "/srv/models/adapters/chat")]


def test_the_preflight_plans_the_adapter_slots(tiny_llama_dir, capsys):
    """The pod's pre-flight flags, planned: the LoRA class is max_loras x max_lora_rank
    x (in + out) x the model dtype's bytes for the 7 projections of tiny-llama's 4 layers."""
    spec = {"model": {"path": str(tiny_llama_dir)}, "gpus": 0,
            "engine": {"maxModelLen": 128, "maxLoras": 2, "maxLoraRank": 8},
            "adapters": [{"name": "sql", "uri": "/adapters/sql"}]}
    flags = parse_spec(spec).engine.to_flags()
    assert main(["plan", *flags, "--device-memory", "8GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # hidden 128, 4 heads x 32, 2 KV heads, intermediate 352
    per_layer = (128 + 128) * 2 + (128 + 64) * 2 + (128 + 352) * 2 + (352 + 128)
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[plan["model_dtype"]]
    assert plan["classes"]["lora"] == per_layer * 8 * 2 * 4 * dtype_bytes
