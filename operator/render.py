"""Pure renderers: an InferenceService in, the Deployment and Service it owns out.

The pod runs the init container ``preflight`` (``kvledger preflight``) and the container
``engine`` (``kvledger serve``) with the same flag list, so a pod that passes its
pre-flight starts the engine the plan approved, and one that does not fit stops before
loading a byte, with the refusal in its termination message.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from kvledger.operator.crd import DEFAULT_MOUNT_PATH, DEFAULT_PORT
from kvledger.operator.spec import cluster_device, engine_config

LABEL = "kvledger.dev/inferenceservice"
GPU_RESOURCE = "nvidia.com/gpu"
PLAN_DIR = "/var/run/kvledger"
PLAN_PATH = f"{PLAN_DIR}/plan.json"
TERMINATION_LOG = "/dev/termination-log"
# The image `make image` builds and the chart deploys (its appVersion is this version).
IMAGE_REPOSITORY = "ghcr.io/kvledger/kvledger"
DEFAULT_IMAGE = f"{IMAGE_REPOSITORY}:{version('kvledger')}"
RUN_AS_USER = 1000
TERMINATION_GRACE_S = 45


def engine_flags(spec: dict[str, Any]) -> list[str]:
    """The flags both containers get (raises BadInput for a spec that can never work)."""
    return engine_config(spec, device=cluster_device(spec)).to_flags()


def labels(name: str) -> dict[str, str]:
    return {
        LABEL: name,
        "app.kubernetes.io/name": "kvledger",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": "kvledger-operator",
    }


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _gpu_limits(spec: dict[str, Any]) -> dict[str, Any]:
    gpus = spec.get("gpus", 1)
    return {GPU_RESOURCE: gpus} if gpus > 0 else {}


def _volumes(spec: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, mounts shared by both containers): the plan hand-over, scratch, model."""
    volumes: list[dict[str, Any]] = [
        {"name": "plan", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "plan", "mountPath": PLAN_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    model_volume = spec["model"].get("volume")
    if model_volume:
        if "persistentVolumeClaim" in model_volume:
            source = {"persistentVolumeClaim": {
                "claimName": model_volume["persistentVolumeClaim"]["claimName"],
                "readOnly": True}}
        else:
            source = {"hostPath": {"path": model_volume["hostPath"]["path"],
                                   "type": "Directory"}}
        volumes.append({"name": "model", **source})
        mounts.append({"name": "model", "readOnly": True,
                       "mountPath": model_volume.get("mountPath", DEFAULT_MOUNT_PATH)})
    return volumes, mounts


def render_pod_spec(spec: dict[str, Any], *, default_image: str = DEFAULT_IMAGE) -> dict[str, Any]:
    flags = engine_flags(spec)
    port = spec.get("port", DEFAULT_PORT)
    image = spec.get("image") or default_image
    volumes, mounts = _volumes(spec)
    gpu_limits = _gpu_limits(spec)
    engine_resources = {key: dict(value) for key, value in (spec.get("resources") or {}).items()}
    if gpu_limits:
        engine_resources.setdefault("limits", {}).update(gpu_limits)
    preflight = {
        "name": "preflight",
        "image": image,
        "command": ["kvledger", "preflight"],
        "args": [*flags, "--plan-out", PLAN_PATH, "--termination-log", TERMINATION_LOG],
        "terminationMessagePath": TERMINATION_LOG,
        # The report is written to the termination log; a crash (traceback) falls back
        # to the log tail, so the operator always has something to show.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # The same resources as the engine: the pre-flight must see the same device, and a
        # pod's request is the larger of its init and app containers', so nothing doubles
        # (and namespaces whose quota demands requests/limits admit the pod).
        "resources": {key: dict(value) for key, value in engine_resources.items()},
        "volumeMounts": mounts,
        "securityContext": _container_security(),
    }
    engine = {
        "name": "engine",
        "image": image,
        "command": ["kvledger", "serve"],
        "args": [*flags, "--host", "0.0.0.0", "--port", str(port)],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": engine_resources,
        "volumeMounts": mounts,
        "securityContext": _container_security(),
        # Loading a large checkpoint takes minutes: the startup probe holds off liveness.
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"},
                         "periodSeconds": 5, "failureThreshold": 120},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"},
                          "periodSeconds": 10, "failureThreshold": 3},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"},
                           "periodSeconds": 5, "failureThreshold": 2},
    }
    return {
        # The engine drains for up to --shutdown-grace (30 s) on SIGTERM; leave it that long.
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        # Neither container talks to the API server.
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": [preflight],
        "containers": [engine],
        "volumes": volumes,
    }


def render_deployment(name: str, namespace: str, spec: dict[str, Any], *,
                      default_image: str = DEFAULT_IMAGE) -> dict[str, Any]:
    """The Deployment named as the resource (owner references are added by the caller)."""
    # With GPUs, a surge pod would wait for a GPU the old pod holds: replace in place.
    strategy = ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
                if spec.get("gpus", 1) > 0 else {"type": "RollingUpdate"})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {
            "replicas": spec.get("replicas", 1),
            "selector": {"matchLabels": {LABEL: name}},
            "strategy": strategy,
            "template": {
                "metadata": {"labels": labels(name)},
                "spec": render_pod_spec(spec, default_image=default_image),
            },
        },
    }


def render_service(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    port = spec.get("port", DEFAULT_PORT)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": {LABEL: name},
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def endpoint(name: str, namespace: str, spec: dict[str, Any]) -> str:
    return f"http://{name}.{namespace}.svc.cluster.local:{spec.get('port', DEFAULT_PORT)}"
