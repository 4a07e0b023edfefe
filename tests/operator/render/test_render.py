"""The pure renderers: spec in, Deployment and Service out, no server."""

from __future__ import annotations

import argparse
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from operator_harness import PLACEMENT
from spec_helpers import spec_of

from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config_flags import add_engine_flags, config_from_args
from kvledger.operator.api.crd import validate_manifest
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.cluster.kube import typed
from kvledger.operator.render.pod import CACHE_DIR, GPU_TOLERATION, cache_size_limit
from kvledger.operator.render.render import (
    LABEL,
    PLAN_PATH,
    engine_flags,
    render_deployment,
    render_service,
)

SPEC = {
    "model": {"path": "/models/llama", "name": "llama",
              "volume": {"persistentVolumeClaim": {"claimName": "weights"},
                         "mountPath": "/models"}},
    "engine": {"maxModelLen": 8192, "maxNumSeqs": 32, "maxNumBatchedTokens": 8192,
               "blockSize": 32, "dtype": "bfloat16", "kvCacheDtype": "fp8",
               "enforceEager": True, "enablePrefixCaching": False, "admission": "safe",
               "quantization": "fp8"},
    "memory": {"limit": "40Gi", "gpuMemoryUtilization": 0.9, "numGpuBlocksOverride": 4000,
               "kvCacheMemoryBytes": 8589934592},
    "gpus": 1, "replicas": 3, "port": 9000,
    "resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "32Gi"}},
}


def pod_spec(spec: dict) -> dict:
    return render_deployment("llama", "ml", spec_of(spec))["spec"]["template"]["spec"]


def test_every_spec_field_becomes_its_flag_and_parses_back():
    flags = engine_flags(spec_of(SPEC))
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    parsed = config_from_args(parser.parse_args(flags))
    assert parsed == parse_spec(SPEC).engine  # the device is the pod's: a GPU
    assert (parsed.max_model_len, parsed.max_num_seqs, parsed.max_num_batched_tokens) == (
        8192, 32, 8192)
    assert (parsed.block_size, parsed.dtype, parsed.kv_cache_dtype) == (32, "bfloat16", "fp8")
    assert parsed.enforce_eager and parsed.gpu_memory_utilization == 0.9
    assert not parsed.enable_prefix_caching and "--no-enable-prefix-caching" in flags
    assert parsed.admission == "safe" and parsed.quantization == "fp8"
    assert parsed.memory_limit_bytes == 40 * 2**30
    assert parsed.num_gpu_blocks_override == 4000 and parsed.kv_cache_memory_bytes == 8 * 2**30
    assert (parsed.model, parsed.served_model_name, parsed.device) == (
        "/models/llama", "llama", "cuda")


def test_preflight_and_engine_get_the_same_flags():
    spec = pod_spec(SPEC)
    [preflight], [engine] = spec["initContainers"], spec["containers"]
    flags = engine_flags(spec_of(SPEC))
    assert preflight["command"] == ["kvledger", "preflight"]
    assert preflight["args"] == [*flags, "--plan-out", PLAN_PATH,
                                 "--termination-log", "/dev/termination-log"]
    assert engine["command"] == ["kvledger", "serve"]
    assert engine["args"] == [*flags, "--host", "0.0.0.0", "--port", "9000",
                              "--shutdown-grace", "30"]
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
                                   "limits": {"memory": "32Gi", "nvidia.com/gpu": "1"}}
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
    for container in (*spec["initContainers"], *spec["containers"]):
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


@pytest.mark.parametrize(("grace", "expected_grace"), [(None, 30), (0, 0), (600, 600)])
def test_a_terminating_pod_drains_before_the_kubelet_may_kill_it(grace, expected_grace):
    """Scale-down (or a rollout) sends SIGTERM after the preStop sleep; the engine then drains
    for --shutdown-grace, and ends what is left within 5 s more. The pod's grace must cover
    all of it, or the kubelet SIGKILLs a request mid-stream."""
    spec = SPEC if grace is None else {**SPEC, "shutdownGraceSeconds": grace}
    pod = pod_spec(spec)
    [engine] = pod["containers"]
    args = engine["args"]
    shutdown_grace_s = int(args[args.index("--shutdown-grace") + 1])
    assert shutdown_grace_s == expected_grace  # serve's own default is 30 s as well
    sleep, prestop_s = engine["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep == "sleep" and int(prestop_s) == 5
    assert pod["terminationGracePeriodSeconds"] == int(prestop_s) + shutdown_grace_s + 15
    # The flag is serve's: the pre-flight (which does not take it) is not given it.
    assert "--shutdown-grace" not in pod["initContainers"][0]["args"]
    # Draining, /ready answers 503: the readiness probe takes the pod out of the Service.
    assert engine["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_the_shutdown_grace_is_a_flag_serve_takes():
    from kvledger.engine.cli import build_parser

    engine = pod_spec({**SPEC, "shutdownGraceSeconds": 120})["containers"][0]
    assert build_parser("serve").parse_args(engine["args"]).shutdown_grace_s == 120


def test_deployment_and_service_select_the_pods_by_label():
    deployment = render_deployment("llama", "ml", spec_of(SPEC), default_image="img:1")
    service = render_service("llama", "ml", spec_of(SPEC))
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["selector"]["matchLabels"] == {LABEL: "llama"}
    assert deployment["spec"]["template"]["metadata"]["labels"][LABEL] == "llama"
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "img:1"
    assert service["spec"]["selector"] == {LABEL: "llama"}
    assert service["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": "http",
                                         "protocol": "TCP"}]
    assert render_deployment("llama", "ml", spec_of({**SPEC, "image": "mine:2"}))[
        "spec"]["template"]["spec"]["containers"][0]["image"] == "mine:2"


def test_a_spec_that_can_never_work_raises_bad_input():
    with pytest.raises(BadInput, match=r"memory\.limit must be more than 0 bytes"):
        render_deployment("x", "ns", spec_of({"model": {"path": "/m"}, "memory": {"limit": "0Gi"}}))
    with pytest.raises(BadInput, match="maxNumBatchedTokens must be at least maxNumSeqs"):
        engine_flags(spec_of({"model": {"path": "/m"},
                      "engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}}))


def test_gpus_beyond_one_node_are_refused_by_name():
    with pytest.raises(BadInput, match="gpus must be at most 8: kvledger serves a model on "
                                       "the GPUs of one node"):
        render_deployment("x", "ns", spec_of({"model": {"path": "/m"}, "gpus": 9}))


# -- placement and environment ----------------------------------------------------------

# What every engine container sets itself, after the user's env (runtime adapter loading
# off unless the spec's own field turns it on).
ENGINE_ENV = [{"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "false"}]

def test_placement_fields_pass_through_to_the_pod_as_kubernetes_names_them():
    deployment = render_deployment("llama", "ml", spec_of({**SPEC, **PLACEMENT}))
    template = deployment["spec"]["template"]
    pod = template["spec"]
    for field in ("nodeSelector", "tolerations", "affinity", "priorityClassName",
                  "runtimeClassName", "imagePullSecrets", "serviceAccountName"):
        assert pod[field] == PLACEMENT[field], field
    assert pod["automountServiceAccountToken"] is False  # a named account changes nothing
    assert template["metadata"]["annotations"] == PLACEMENT["podAnnotations"]
    assert template["metadata"]["labels"] == {**PLACEMENT["podLabels"], LABEL: "llama",
                                              "app.kubernetes.io/name": "kvledger",
                                              "app.kubernetes.io/instance": "llama",
                                              "app.kubernetes.io/managed-by": "kvledger-operator"}
    for container in pod["initContainers"]:
        assert container["env"] == PLACEMENT["env"], container["name"]
    [engine] = pod["containers"]
    # Its own settings last: a user's value cannot $(expand) them.
    assert engine["env"] == [*PLACEMENT["env"], *ENGINE_ENV]
    assert not any("envFrom" in c for c in (*pod["initContainers"], engine))
    # Copies, not the spec's own objects: the manifest may be mutated by the caller.
    pod["nodeSelector"]["pool"] = "changed"
    assert PLACEMENT["nodeSelector"]["pool"] == "gpu"


def test_the_operators_labels_win_over_pod_labels():
    spec = {**SPEC, "podLabels": {LABEL: "other", "app.kubernetes.io/name": "mine", "team": "a"}}
    deployment = render_deployment("llama", "ml", spec_of(spec))
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels[LABEL] == "llama" and labels["app.kubernetes.io/name"] == "kvledger"
    assert labels["team"] == "a"
    assert deployment["spec"]["selector"]["matchLabels"] == {LABEL: "llama"}


def test_gpu_pods_tolerate_the_gpu_taint_unless_tolerations_are_given():
    assert pod_spec(SPEC)["tolerations"] == [GPU_TOLERATION]
    assert "tolerations" not in pod_spec({**SPEC, "gpus": 0})
    assert pod_spec({**SPEC, "tolerations": []})["tolerations"] == []  # the user's choice
    mine = [{"key": "pool", "operator": "Equal", "value": "h100", "effect": "NoSchedule"}]
    assert pod_spec({**SPEC, "tolerations": mine})["tolerations"] == mine
    assert "nodeSelector" not in pod_spec(SPEC) and "affinity" not in pod_spec(SPEC)
    assert pod_spec(SPEC)["containers"][0]["env"] == ENGINE_ENV
    assert "env" not in pod_spec(SPEC)["initContainers"][0]


# -- hub models -------------------------------------------------------------------------

HUB = {"model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct@main", "name": "llama",
                 "tokenSecretRef": {"name": "hf-token", "key": "token"},
                 "endpoint": "https://hf-mirror.example.com"},
       "engine": {"maxModelLen": 8192}, "memory": {"limit": "22Gi"},
       "resources": {"requests": {"cpu": "4"}, "limits": {"memory": "32Gi"}}}
GIB = 2**30


def _containers(pod: dict) -> dict:
    return {c["name"]: c for c in (*pod["initContainers"], *pod["containers"])}


def _env(container: dict) -> dict:
    return {var["name"]: var.get("value", var.get("valueFrom")) for var in container.get("env", [])}


def test_hub_pod_runs_preflight_then_fetch_then_engine():
    pod = pod_spec_of(HUB, download_bytes=16 * GIB)
    assert [c["name"] for c in pod["initContainers"]] == ["preflight", "fetch"]
    containers = _containers(pod)
    preflight, fetch, engine = containers["preflight"], containers["fetch"], containers["engine"]
    flags = engine_flags(spec_of(HUB))
    assert flags[:2] == ["--model", "hf://meta-llama/Llama-3.1-8B-Instruct@main"]
    assert preflight["args"] == [*flags, "--plan-out", PLAN_PATH,
                                 "--termination-log", "/dev/termination-log"]
    assert fetch["command"] == ["kvledger", "fetch"]
    assert fetch["args"] == ["--model", "hf://meta-llama/Llama-3.1-8B-Instruct@main",
                             "--download-dir", CACHE_DIR]
    assert engine["args"] == [*flags, "--download-dir", CACHE_DIR,
                              "--host", "0.0.0.0", "--port", "8000",
                              "--shutdown-grace", "30"]
    assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert fetch["resources"] == {"requests": {"cpu": "4"}, "limits": {"memory": "32Gi"}}
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_hub_token_and_mirror_reach_only_the_containers_that_talk_to_the_hub():
    containers = _containers(pod_spec_of(HUB, download_bytes=GIB))
    token = {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    for name in ("preflight", "fetch"):
        assert _env(containers[name]) == {"HF_TOKEN": token,
                                          "HF_ENDPOINT": "https://hf-mirror.example.com"}
    assert _env(containers["engine"]) == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "false",
                                          "HF_ENDPOINT": "https://hf-mirror.example.com",
                                          "HF_HUB_OFFLINE": "1"}
    assert "hf-token" not in str([c["args"] for c in containers.values()])
    # The endpoint the admin allows (policy.Policy.hub_endpoint), when the handler gives it.
    pinned = _containers(pod_spec_of(HUB, download_bytes=GIB,
                                     hub_endpoint="https://hf.internal.example"))
    assert {_env(c)["HF_ENDPOINT"] for c in pinned.values()} == {"https://hf.internal.example"}
    # The user's allowed env passes (any other name is refused by the rules).
    spec = {**HUB, "env": [{"name": "HF_HUB_DOWNLOAD_TIMEOUT", "value": "60"}]}
    containers = _containers(pod_spec_of(spec, download_bytes=GIB))
    assert _env(containers["fetch"]) == {"HF_HUB_DOWNLOAD_TIMEOUT": "60", "HF_TOKEN": token,
                                         "HF_ENDPOINT": "https://hf-mirror.example.com"}


def test_the_engines_security_settings_come_from_the_spec():
    """Runtime adapter loading, the API key and the hub endpoint are set from the spec's
    fields, each explicitly (over whatever the image's own environment says)."""
    spec = {**SPEC, "apiKeySecretRef": {"name": "keys", "key": "api"},
            "allowRuntimeLoraUpdating": True}
    [engine] = pod_spec(spec)["containers"]
    assert _env(engine) == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true",
                            "KVLEDGER_API_KEY": {"secretKeyRef": {"name": "keys", "key": "api"}},
                            "HF_ENDPOINT": "https://huggingface.co"}
    assert "--allow-runtime-lora-updating" in engine["args"] and "--enable-lora" in engine["args"]
    assert _env(pod_spec(SPEC)["containers"][0]) == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "false"}


def test_the_tenants_file_is_the_engines_alone_read_only_and_its_flags_follow():
    pod = pod_spec({**SPEC, **TENANTS, "engine": {"schedulingPolicy": "priority",
                                                  "priorityHeadroom": 0.1}})
    containers = _containers(pod)
    engine, preflight = containers["engine"], containers["preflight"]
    assert {"name": "tenants", "mountPath": "/etc/kvledger/tenants", "readOnly": True} \
        in engine["volumeMounts"]
    assert all(m["name"] != "tenants" for m in preflight["volumeMounts"])
    volume = next(v for v in pod["volumes"] if v["name"] == "tenants")
    assert volume["secret"] == {"secretName": "tenants", "defaultMode": 0o440,
                                "items": [{"key": "tenants.yaml", "path": "tenants.yaml"}]}
    args = engine["args"]
    assert args[args.index("--tenants-file") + 1] == "/etc/kvledger/tenants/tenants.yaml"
    assert args[args.index("--max-queue-len-per-tenant") + 1] == "32"
    assert "--no-tenant-fairness" in args
    assert args[args.index("--scheduling-policy") + 1] == "priority"
    assert args[args.index("--priority-headroom") + 1] == "0.1"
    assert "--scheduling-policy" in preflight["args"]  # both read the same engine flags


def test_hub_cache_is_written_by_fetch_and_read_only_for_the_engine():
    pod = pod_spec_of(HUB, download_bytes=16 * GIB)
    containers = _containers(pod)
    mounts = {name: {m["name"]: m for m in c["volumeMounts"]} for name, c in containers.items()}
    assert "model-cache" not in mounts["preflight"]  # it reads headers over HTTP
    assert mounts["fetch"]["model-cache"] == {"name": "model-cache", "mountPath": CACHE_DIR,
                                              "readOnly": False}
    assert mounts["engine"]["model-cache"] == {"name": "model-cache", "mountPath": CACHE_DIR,
                                               "readOnly": True}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"] == {"name": "model-cache",
                                      "emptyDir": {"sizeLimit": cache_size_limit(16 * GIB)}}
    assert "model" not in volumes
    claimed = {**HUB, "model": {**HUB["model"],
                                "cache": {"persistentVolumeClaim": {"claimName": "hf-cache"}}}}
    volumes = {v["name"]: v for v in pod_spec_of(claimed)["volumes"]}  # no size needed
    assert volumes["model-cache"] == {"name": "model-cache",
                                      "persistentVolumeClaim": {"claimName": "hf-cache"}}


def test_an_emptydir_cache_of_a_model_sized_in_its_pod_has_no_limit():
    """A model behind a token is sized in its pod (the operator reads no Secret)."""
    volumes = {v["name"]: v for v in pod_spec_of(HUB)["volumes"]}
    assert volumes["model-cache"] == {"name": "model-cache", "emptyDir": {}}


@pytest.mark.parametrize(("download_bytes", "limit"), [
    (0, "1024Mi"),  # only the fixed 1 GiB
    (1, "1025Mi"),  # a byte over a MiB boundary rounds up
    (10**9, "2026Mi"),  # 1.05 GB + 1 GiB = 2025.4 MiB
    (16 * GIB, f"{16 * 1024 + 820 + 1024}Mi"),  # + 5% (819.2 MiB, rounded up) + 1 GiB
])
def test_cache_size_limit_is_the_download_plus_5_percent_plus_1_gib(download_bytes, limit):
    assert cache_size_limit(download_bytes) == limit
    limit_bytes = int(limit.removesuffix("Mi")) * 2**20
    assert limit_bytes >= download_bytes * 1.05 + GIB


def pod_spec_of(spec: dict, **kw) -> dict:
    return render_deployment("llama", "ml", spec_of(spec), **kw)["spec"]["template"]["spec"]


EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples").glob("*.yaml"))
# Specs beyond the examples: every placement field, a hub model in an emptyDir.
TENANTS = {"tenantsSecretRef": {"name": "tenants", "key": "tenants.yaml"},
           "maxQueueLengthPerTenant": 32, "tenantFairness": False}
EXTRA_SPECS = {"every-field": {**SPEC, **PLACEMENT},
               "tenants": {**SPEC, **TENANTS,
                           "engine": {"schedulingPolicy": "priority", "priorityHeadroom": 0.1}},
               "hub-every-field": {**HUB, **PLACEMENT},
               "hub-claim-cpu": {**HUB, "gpus": 0, "model": {
                   "uri": "hf://Qwen/Qwen2-0.5B", "cache": {
                       "persistentVolumeClaim": {"claimName": "hf-cache"}}}}}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_rendered_children_of_every_example_pass_kubernetes_schema(example):
    """What the operator would apply, checked against Kubernetes' own schemas (strict)."""
    doc = yaml.safe_load(example.read_text())
    name = doc["metadata"]["name"]
    for child in (render_deployment(name, "default", spec_of(doc["spec"])),
                  render_service(name, "default", spec_of(doc["spec"]))):
        kubernetes_validate.validate(child, kubernetes_validate.latest_version(), strict=True)
        typed(child)  # and sent as the client's typed model, unchanged


@pytest.mark.parametrize("name", EXTRA_SPECS)
def test_rendered_children_of_every_field_pass_kubernetes_schema(name):
    spec = EXTRA_SPECS[name]
    validate_manifest({"apiVersion": "kvledger.dev/v1alpha1", "kind": "InferenceService",
                       "metadata": {"name": name}, "spec": spec})
    for child in (render_deployment(name, "default", spec_of(spec), download_bytes=16 * GIB),
                  render_service(name, "default", spec_of(spec))):
        kubernetes_validate.validate(child, kubernetes_validate.latest_version(), strict=True)
        typed(child)  # and sent as the client's typed model, unchanged


def test_spec_tools_become_the_engine_flags_and_auto_needs_a_parser():
    spec = {**SPEC, "tools": {"toolCallParser": "llama3_json", "enableAutoToolChoice": True}}
    [engine] = pod_spec(spec)["containers"]
    assert engine["args"][-3:] == ["--tool-call-parser", "llama3_json",
                                   "--enable-auto-tool-choice"]
    [preflight] = pod_spec(spec)["initContainers"]
    assert "--tool-call-parser" not in preflight["args"]  # the server's, not the plan's
    with pytest.raises(BadInput, match=r"tools\.enableAutoToolChoice needs tools\.toolCallParser"):
        parse_spec({**SPEC, "tools": {"enableAutoToolChoice": True}})
