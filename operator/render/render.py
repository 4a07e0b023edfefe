"""Pure renderers: an InferenceService in, the Deployment and Service it owns out.

The pod runs the init container ``preflight`` (``kvledger preflight``) and the container
``engine`` (``kvledger serve``) with the same flag list, so a pod that passes its
pre-flight starts the engine the plan approved, and one that does not fit stops before
loading a byte, with the refusal in its termination message. A hub model
(``spec.model.uri``) adds the init container ``fetch`` between them: the pre-flight plans
from headers read over HTTP, and only a plan that fits is downloaded.

Nothing here does I/O: a hub model's download size (it sizes an emptyDir cache) is a
parameter. The spec is the parsed one (``spec.parse_spec``, a ``ServiceSpec``): a manifest is
parsed once by its caller, never here.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from kvledger.operator.api.adapters_spec import hub_adapters
from kvledger.operator.api.parallel import shm_mount, shm_volume
from kvledger.operator.api.resource import DEFAULT_HUB_ENDPOINT
from kvledger.operator.api.spec import ServiceSpec
from kvledger.operator.render import pod as parts
from kvledger.operator.render.gateway_wiring import (
    NO_GATEWAY,
    GatewayWiring,
    gateway_env,
    gateway_flags,
    objectives_wired,
)
from kvledger.operator.render.pod import CACHE_DIR, GPU_RESOURCE, PLAN_DIR

LABEL = "kvledger.dev/inferenceservice"
PLAN_PATH = f"{PLAN_DIR}/plan.json"
TERMINATION_LOG = "/dev/termination-log"
# The image `make image` builds and the chart deploys (its appVersion is this version).
IMAGE_REPOSITORY = "ghcr.io/kvledger/kvledger"
DEFAULT_IMAGE = f"{IMAGE_REPOSITORY}:{version('kvledger')}"
RUN_AS_USER = 1000
# Scale-down and rollouts must not cut a request short. The kubelet runs the preStop sleep
# first, while the endpoints controller takes the terminating pod out of the Service (a
# request routed in that window is still served); then SIGTERM: the engine answers 503 to
# new requests and on /ready, lets in-flight ones finish for up to spec.shutdownGraceSeconds
# (--shutdown-grace), and exits 0. The pod's grace covers all of it plus a margin (the
# engine ends aborted streams for up to 5 s, then closes), so the kubelet never SIGKILLs a
# draining engine.
PRESTOP_SLEEP_S = 5
TERMINATION_MARGIN_S = 15


def engine_flags(spec: ServiceSpec) -> list[str]:
    """The flags both containers get."""
    return spec.engine.to_flags()


def termination_grace_s(spec: ServiceSpec) -> int:
    """The pod's ``terminationGracePeriodSeconds``: preStop sleep + drain + margin."""
    return PRESTOP_SLEEP_S + spec.serve.shutdown_grace_s + TERMINATION_MARGIN_S


def selector_labels(name: str) -> dict[str, str]:
    """The labels the Deployment, the Service and the PodDisruptionBudget select pods by."""
    return {LABEL: name}


def pod_selector(name: str) -> str:
    """``selector_labels`` as a label-selector string (``status.selector``, which the scale
    subresource hands to the HPA to find the pods whose metrics it averages)."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(name).items()))


def labels(name: str) -> dict[str, str]:
    return {
        LABEL: name,
        "app.kubernetes.io/name": "kvledger",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": "kvledger-operator",
    }


def render_pod_spec(spec: ServiceSpec, *, default_image: str = DEFAULT_IMAGE,
                    download_bytes: int | None = None, hub_endpoint: str | None = None,
                    gateway: GatewayWiring = NO_GATEWAY, name: str = "") -> dict[str, Any]:
    """The pod: init containers ``preflight`` (and ``fetch`` for a hub model), then
    ``engine``. ``download_bytes`` is the hub model's download size, which sizes its
    emptyDir cache (None: not known, no limit); ``hub_endpoint`` where the pods talk to the
    hub (the admin's choice, ``policy.Policy.hub_endpoint``; None: the spec's
    ``model.endpoint``, else the public hub); ``gateway`` what the admin's Helm values
    ``gateway`` give a service behind an InferencePool (``gateway_flags``)."""
    flags = spec.engine.to_flags()
    uri = spec.model.uri
    port = spec.serve.port
    image = spec.image or default_image
    volumes, mounts = parts.volumes(spec, download_bytes)
    volumes += shm_volume(spec.gpus)  # the engine's ranks: NCCL's shared memory
    tenant_volumes, tenant_mounts = parts.tenants_volume(spec)
    # The engine's own ConfigMaps, named after the resource: spec.sleep's, the objectives'.
    config_volumes, config_mounts = parts.sleep_volume(name, spec)
    if objectives_wired(spec, gateway):
        objective_volumes, objective_mounts = parts.objectives_volume(name)
        config_volumes, config_mounts = (config_volumes + objective_volumes,
                                         config_mounts + objective_mounts)
    gpu_limits = parts.gpu_limits(spec)
    engine_resources = {key: dict(value) for key, value in spec.resources.items()}
    if gpu_limits:
        engine_resources.setdefault("limits", {}).update(gpu_limits)
    hub_endpoint = hub_endpoint or spec.model.endpoint or DEFAULT_HUB_ENDPOINT
    hub_env = parts.hub_env(spec, hub_endpoint) if uri is not None else []
    preflight = parts.with_env({
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
        "securityContext": parts.container_security(),
    }, spec, hub_env)
    init_containers = [preflight]
    download = ["--download-dir", CACHE_DIR] if uri is not None else []
    if uri is not None:
        adapters = hub_adapters(spec.engine.lora_modules)
        init_containers.append(parts.with_env({
            "name": "fetch",
            "image": image,
            "command": ["kvledger", "fetch"],
            "args": ["--model", uri, *download,
                     *(["--lora-modules", *adapters] if adapters else [])],
            # A failure's one-line error is the log's tail: the operator shows it.
            "terminationMessagePolicy": "FallbackToLogsOnError",
            # CPU and host memory as the others (for quotas); a download needs no GPU.
            "resources": {key: {k: v for k, v in value.items() if k != GPU_RESOURCE}
                          for key, value in spec.resources.items()},
            "volumeMounts": [parts.tmp_mount(), parts.cache_mount(read_only=False)],
            "securityContext": parts.container_security(),
        }, spec, hub_env))
    engine = parts.with_env({
        "name": "engine",
        "image": image,
        "command": ["kvledger", "serve"],
        "args": [*flags, *download, "--host", "0.0.0.0", *spec.serving_flags(),
                 *gateway_flags(spec, gateway)],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": engine_resources,
        "volumeMounts": mounts + ([parts.cache_mount(read_only=True)] if uri is not None else [])
        + shm_mount(spec.gpus) + tenant_mounts + config_mounts,
        "securityContext": parts.container_security(),
        # Loading a large checkpoint takes minutes: the startup probe holds off liveness.
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"},
                         "periodSeconds": 5, "failureThreshold": 120},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"},
                          "periodSeconds": 10, "failureThreshold": 3},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"},
                           "periodSeconds": 5, "failureThreshold": 2},
        # The image is Debian's or Ubuntu's: coreutils' sleep is there (see PRESTOP_SLEEP_S).
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}},
    }, spec, parts.engine_env(spec, hub_endpoint) + gateway_env(spec, gateway))
    return {
        "terminationGracePeriodSeconds": termination_grace_s(spec),
        # Neither container talks to the API server.
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        **parts.placement(spec),
        "initContainers": init_containers,
        "containers": [engine],
        "volumes": volumes + tenant_volumes + config_volumes,
    }


def render_deployment(name: str, namespace: str, spec: ServiceSpec, *,
                      default_image: str = DEFAULT_IMAGE, download_bytes: int | None = None,
                      hub_endpoint: str | None = None,
                      gateway: GatewayWiring = NO_GATEWAY) -> dict[str, Any]:
    """The Deployment named as the resource (owner references are added by the caller).
    ``download_bytes``, ``hub_endpoint`` and ``gateway``: see ``render_pod_spec``."""
    # With GPUs, a surge pod would wait for a GPU the old pod holds: replace in place.
    strategy = ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
                if spec.gpus > 0 else {"type": "RollingUpdate"})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": workload_labels(name, spec)},
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": strategy,
            "template": {
                "metadata": pod_template_metadata(name, spec),
                "spec": render_pod_spec(spec, default_image=default_image,
                                        download_bytes=download_bytes,
                                        hub_endpoint=hub_endpoint,
                                        gateway=gateway, name=name),
            },
        },
    }


# The label llm-d's charts and tools select model-server pods by (with spec.inferencePool).
INFERENCE_SERVING_LABEL = "llm-d.ai/inference-serving"
# The label the router's metrics extractor picks a pod's metric names by: vLLM's are ours.
ENGINE_TYPE_LABEL = "llm-d.ai/engine-type"
ENGINE_TYPE = "vllm"
def workload_labels(name: str, spec: ServiceSpec) -> dict[str, str]:
    """The Deployment's (or LeaderWorkerSet's) labels: the resource's own
    (``propagation``) under the operator's, which win."""
    return {**spec.resource_labels, **labels(name)}


def pod_template_metadata(name: str, spec: ServiceSpec, *, serving: bool = True) -> dict[str, Any]:
    """A pod template's labels and annotations, lowest first: the resource's own
    (``propagation``: its metadata's labels and filtered annotations), ``podLabels`` and
    ``podAnnotations``, then the operator's labels, which win (the selector and the Service
    depend on them). A ``serving`` pod (one that answers HTTP) behind an InferencePool also
    carries ``INFERENCE_SERVING_LABEL``."""
    meta: dict[str, Any] = {"labels": {**spec.resource_labels, **spec.pod_labels,
                                       **labels(name)}}
    if serving and spec.inference_pool is not None:
        meta["labels"][INFERENCE_SERVING_LABEL] = "true"
        meta["labels"][ENGINE_TYPE_LABEL] = ENGINE_TYPE
    annotations = {**spec.resource_annotations, **spec.pod_annotations}
    if annotations:
        meta["annotations"] = annotations
    return meta


def render_service(name: str, namespace: str,
                   spec: ServiceSpec) -> dict[str, Any]:
    port = spec.serve.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def endpoint(name: str, namespace: str, port: int) -> str:
    return f"http://{name}.{namespace}.svc.cluster.local:{port}"
