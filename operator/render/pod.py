"""The engine pod's parts, pure: its volumes and mounts (the plan hand-over, scratch, the
model's volume, a hub model's cache, the tenants file), its containers' env (the user's,
then ours, so theirs cannot expand ours), their security context and GPU limits, and the
pod's placement. ``render.render_pod_spec`` assembles them."""

from __future__ import annotations

import copy
from typing import Any

from kvledger.operator.api.resource import (
    OBJECTIVES_DIR,
    OBJECTIVES_KEY,
    SLEEP_DIR,
    SLEEP_KEY,
    TENANTS_DIR,
    objectives_config_map,
    sleep_config_map,
)
from kvledger.operator.api.spec import ServiceSpec

GPU_RESOURCE = "nvidia.com/gpu"
PLAN_DIR = "/var/run/kvledger"
# Where fetch downloads a hub model and the engine reads it (read-only, offline).
CACHE_DIR = "/var/cache/kvledger"
# The emptyDir cache's sizeLimit over the download size: 5% (files the listing rounds or
# omits, the hub cache's refs and links) plus 1 GiB (tokenizer and configuration files, a
# resumed download's partial file). Past it the kubelet evicts the pod: it errs large.
CACHE_MARGIN_PERCENT = 5
CACHE_MARGIN_BYTES = 2**30
# With GPUs and no tolerations of the user's: GPU nodes are commonly tainted so.
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


def container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def gpu_limits(spec: ServiceSpec) -> dict[str, Any]:
    return {GPU_RESOURCE: str(spec.gpus)} if spec.gpus > 0 else {}  # a quantity: a string


def cache_size_limit(download_bytes: int) -> str:
    """The emptyDir cache's ``sizeLimit``: the download plus 5% plus 1 GiB, in whole MiB."""
    limit = download_bytes + -(-download_bytes * CACHE_MARGIN_PERCENT // 100) + CACHE_MARGIN_BYTES
    return f"{-(-limit // 2**20)}Mi"


def volumes(spec: ServiceSpec, download_bytes: int | None,
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, mounts of preflight and engine): the plan hand-over, scratch, model.

    A hub model's cache is a volume too, mounted by fetch and engine only (``cache_mount``).
    """
    volumes: list[dict[str, Any]] = [
        {"name": "plan", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [{"name": "plan", "mountPath": PLAN_DIR}, tmp_mount()]
    model_volume = spec.model.volume
    if model_volume is not None:
        if model_volume.claim_name is not None:
            source = {"persistentVolumeClaim": {"claimName": model_volume.claim_name,
                                                "readOnly": True}}
        else:
            source = {"hostPath": {"path": model_volume.host_path, "type": "Directory"}}
        volumes.append({"name": "model", **source})
        mounts.append({"name": "model", "readOnly": True, "mountPath": model_volume.mount_path})
    if spec.model.uri is not None:
        claim = spec.model.cache_claim
        if claim is not None:  # shared by replicas and restarts: fetch finds it done
            volumes.append({"name": "model-cache", "persistentVolumeClaim": {"claimName": claim}})
        else:  # a model sized in its pod (it needs a token) has no limit
            volumes.append({"name": "model-cache", "emptyDir": {} if download_bytes is None
                            else {"sizeLimit": cache_size_limit(download_bytes)}})
    return volumes, mounts


def tmp_mount() -> dict[str, Any]:
    return {"name": "tmp", "mountPath": "/tmp"}


def cache_mount(read_only: bool) -> dict[str, Any]:
    return {"name": "model-cache", "mountPath": CACHE_DIR, "readOnly": read_only}


def sleep_volume(name: str, spec: ServiceSpec,
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, the engine's mounts) with ``engine.enableSleepMode``: the ConfigMap of
    ``spec.sleep`` (``sleep_config_map``), read-only, for the engine alone. Optional: a pod
    started before the operator wrote it is awake."""
    if not spec.engine.enable_sleep_mode:
        return [], []
    return ([{"name": "sleep", "configMap": {
                "name": sleep_config_map(name), "optional": True, "defaultMode": 0o444,
                "items": [{"key": SLEEP_KEY, "path": SLEEP_KEY}]}}],
            [{"name": "sleep", "mountPath": SLEEP_DIR, "readOnly": True}])


def objectives_volume(name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, the engine's mounts) of the InferencePool's objectives
    (``objectives_config_map``), read-only, for the engine alone. Optional: a pod started
    before the operator wrote it has none, until the kubelet writes the file."""
    return ([{"name": "objectives", "configMap": {
                "name": objectives_config_map(name), "optional": True, "defaultMode": 0o444,
                "items": [{"key": OBJECTIVES_KEY, "path": OBJECTIVES_KEY}]}}],
            [{"name": "objectives", "mountPath": OBJECTIVES_DIR, "readOnly": True}])


def render_sleep_config_map(name: str, namespace: str, spec: ServiceSpec,
                            labels: dict[str, str]) -> dict[str, Any] | None:
    """The ConfigMap the engines read ``spec.sleep`` from (None without sleep mode)."""
    if not spec.engine.enable_sleep_mode:
        return None
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": sleep_config_map(name), "namespace": namespace,
                         "labels": labels},
            "data": {SLEEP_KEY: "" if spec.sleep is None else str(spec.sleep)}}


def tenants_volume(spec: ServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, the engine's mounts) for ``spec.tenantsSecretRef``: its one key as
    ``TENANTS_FILE``, read-only, for the engine alone (the pre-flight never reads it)."""
    if spec.tenants_secret is None:
        return [], []
    name, key = spec.tenants_secret
    return ([{"name": "tenants", "secret": {"secretName": name, "defaultMode": 0o440,
                                            "items": [{"key": key, "path": "tenants.yaml"}]}}],
            [{"name": "tenants", "mountPath": TENANTS_DIR, "readOnly": True}])


def secret_env(name: str, ref: tuple[str, str]) -> dict[str, Any]:
    """An env var from a Secret key: never a value in the pod spec or the args."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref[0], "key": ref[1]}}}


def hub_env(spec: ServiceSpec, hub_endpoint: str) -> list[dict[str, Any]]:
    """The env of the containers that talk to the hub (preflight, fetch): the endpoint the
    admin allows and the token (``spec.env`` cannot name either: ``env_policy``)."""
    env = [{"name": "HF_ENDPOINT", "value": hub_endpoint}]
    if spec.model.token_secret is not None:
        env.append(secret_env("HF_TOKEN", spec.model.token_secret))
    return env


def engine_env(spec: ServiceSpec, hub_endpoint: str) -> list[dict[str, Any]]:
    """The engine's security settings, from the spec's own fields alone: set here, over
    whatever the image's own environment says, so only the spec turns runtime adapter
    loading on or sends a hub token anywhere."""
    env = [{"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
            "value": "true" if spec.serve.allow_runtime_lora_updating else "false"}]
    if spec.api_key_secret is not None:
        env.append(secret_env("KVLEDGER_API_KEY", spec.api_key_secret))
    if spec.model.uri is not None or spec.serve.allow_runtime_lora_updating:  # it may ask the hub
        env.append({"name": "HF_ENDPOINT", "value": hub_endpoint})
    if spec.model.uri is not None:  # the model is in the cache fetch filled
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    return env


def with_env(container: dict[str, Any], spec: ServiceSpec,
              ours: list[dict[str, Any]]) -> dict[str, Any]:
    """The user's env (names from ``env_policy``'s allow-list), then ours. Ours come last,
    so a user's ``$(VAR)`` in a value cannot expand them (the kubelet expands only names
    defined earlier in the list)."""
    names = {var["name"] for var in ours}
    env = [copy.deepcopy(var) for var in spec.env if var["name"] not in names]
    env += ours
    if env:
        container["env"] = env
    return container


def placement(spec: ServiceSpec) -> dict[str, Any]:
    """The pod's placement fields, as the spec writes them; the GPU toleration by default."""
    out = copy.deepcopy(spec.pod_fields)
    if spec.tolerations is not None:  # given, even empty: the user's choice
        out["tolerations"] = copy.deepcopy(spec.tolerations)
    elif spec.gpus > 0:
        out["tolerations"] = [dict(GPU_TOLERATION)]
    return out
