"""The pure renderers: spec in, Deployment and Service out, no server."""

from __future__ import annotations

import argparse
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvledger.engine.config import add_engine_flags, config_from_args
from kvledger.engine.errors import BadInput
from kvledger.operator.render import (
    LABEL,
    PLAN_PATH,
    engine_flags,
    render_deployment,
    render_service,
)
from kvledger.operator.spec import engine_config

SPEC = {
    "model": {"path": "/models/llama", "name": "llama",
              "volume": {"persistentVolumeClaim": {"claimName": "weights"},
                         "mountPath": "/models"}},
    "engine": {"maxModelLen": 8192, "maxNumSeqs": 32, "maxNumBatchedTokens": 8192,
               "blockSize": 32, "dtype": "bfloat16", "kvCacheDtype": "fp8",
               "enforceEager": True},
    "memory": {"limit": "40Gi", "gpuMemoryUtilization": 0.9, "numGpuBlocksOverride": 4000,
               "kvCacheMemoryBytes": 8589934592},
    "gpus": 1, "replicas": 3, "port": 9000,
    "resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "32Gi"}},
}


def pod_spec(spec: dict) -> dict:
    return render_deployment("llama", "ml", spec)["spec"]["template"]["spec"]


def test_every_spec_field_becomes_its_flag_and_parses_back():
    flags = engine_flags(SPEC)
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    parsed = config_from_args(parser.parse_args(flags))
    assert parsed == engine_config(SPEC, device="cuda")
    assert (parsed.max_model_len, parsed.max_num_seqs, parsed.max_num_batched_tokens) == (
        8192, 32, 8192)
    assert (parsed.block_size, parsed.dtype, parsed.kv_cache_dtype) == (32, "bfloat16", "fp8")
    assert parsed.enforce_eager and parsed.gpu_memory_utilization == 0.9
    assert parsed.memory_limit_bytes == 40 * 2**30
    assert parsed.num_gpu_blocks_override == 4000 and parsed.kv_cache_memory_bytes == 8 * 2**30
    assert (parsed.model, parsed.served_model_name, parsed.device) == (
        "/models/llama", "llama", "cuda")


def test_preflight_and_engine_get_the_same_flags():
    spec = pod_spec(SPEC)
    [preflight], [engine] = spec["initContainers"], spec["containers"]
    flags = engine_flags(SPEC)
    assert preflight["command"] == ["kvledger", "preflight"]
    assert preflight["args"] == [*flags, "--plan-out", PLAN_PATH,
                                 "--termination-log", "/dev/termination-log"]
    assert engine["command"] == ["kvledger", "serve"]
    assert engine["args"] == [*flags, "--host", "0.0.0.0", "--port", "9000"]
    assert preflight["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert preflight["image"] == engine["image"]


def test_pod_mounts_plan_and_model_read_only_and_requests_gpus():
    spec = pod_spec(SPEC)
    [preflight], [engine] = spec["initContainers"], spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["plan"] == {"name": "plan", "emptyDir": {}}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights",
                                                         "readOnly": True}
    for container in (preflight, engine):
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
        assert PLAN_PATH.startswith(mounts["plan"]["mountPath"] + "/")
    assert engine["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"},
                                   "limits": {"memory": "32Gi", "nvidia.com/gpu": 1}}
    assert preflight["resources"] == engine["resources"]
    assert SPEC["resources"]["limits"] == {"memory": "32Gi"}  # the spec is not mutated


def test_hostpath_volume_and_cpu_only_pods():
    spec = {"model": {"path": "/models/tiny", "volume": {"hostPath": {"path": "/srv/m"}}},
            "gpus": 0}
    rendered = pod_spec(spec)
    volumes = {v["name"]: v for v in rendered["volumes"]}
    assert volumes["model"]["hostPath"] == {"path": "/srv/m", "type": "Directory"}
    [engine] = rendered["containers"]
    assert "nvidia.com/gpu" not in str(rendered)
    assert engine["args"][engine["args"].index("--device") + 1] == "cpu"


def test_probes_and_security_context():
    spec = pod_spec(SPEC)
    [engine] = spec["containers"]
    assert engine["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert engine["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert engine["startupProbe"]["httpGet"]["path"] == "/health"
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["automountServiceAccountToken"] is False
    assert spec["terminationGracePeriodSeconds"] > 30  # serve's default drain
    for container in (*spec["initContainers"], *spec["containers"]):
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_deployment_and_service_select_the_pods_by_label():
    deployment = render_deployment("llama", "ml", SPEC, default_image="img:1")
    service = render_service("llama", "ml", SPEC)
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["selector"]["matchLabels"] == {LABEL: "llama"}
    assert deployment["spec"]["template"]["metadata"]["labels"][LABEL] == "llama"
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "img:1"
    assert service["spec"]["selector"] == {LABEL: "llama"}
    assert service["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": "http",
                                         "protocol": "TCP"}]
    assert render_deployment("llama", "ml", {**SPEC, "image": "mine:2"})[
        "spec"]["template"]["spec"]["containers"][0]["image"] == "mine:2"


def test_a_spec_that_can_never_work_raises_bad_input():
    with pytest.raises(BadInput, match=r"memory\.limit must be more than 0 bytes"):
        render_deployment("x", "ns", {"model": {"path": "/m"}, "memory": {"limit": "0Gi"}})
    with pytest.raises(BadInput, match="maxNumBatchedTokens must be at least maxNumSeqs"):
        engine_flags({"model": {"path": "/m"},
                      "engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}})


EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_rendered_children_of_every_example_pass_kubernetes_schema(example):
    """What the operator would apply, checked against Kubernetes' own schemas (strict)."""
    doc = yaml.safe_load(example.read_text())
    name = doc["metadata"]["name"]
    for child in (render_deployment(name, "default", doc["spec"]),
                  render_service(name, "default", doc["spec"])):
        kubernetes_validate.validate(child, kubernetes_validate.latest_version(), strict=True)
