"""An InferenceService spec, parsed once into a frozen value: the seam between operator and pod.

``parse_spec`` checks the CRD's rules (``spec_rules``), takes the CRD's defaults
(``resource``) and builds the engine's flags, so the handlers parse a resource once per
read and hand the value to the pure renderers and the status logic. The init container
(``kvledger preflight``), the engine container (``kvledger serve``) and ``kvledger run``
all get their flags from ``ServiceSpec.engine``, so the plan the pre-flight approves is
the plan the engine runs.
"""

from __future__ import annotations

import copy
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvledger.engine.errors import BadInput, shown
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.declare import default_of, settings_of
from kvledger.engine.settings.kinds import parse_size
from kvledger.engine.settings.serve_config import ServeConfig
from kvledger.operator.api.adapters_spec import parse_adapters
from kvledger.operator.api.model_sources import check_kserve_shape
from kvledger.operator.api.parallel import tensor_parallel_size
from kvledger.operator.api.quantity import quantity_bytes
from kvledger.operator.api.resource import (
    DEFAULT_GPUS,
    DEFAULT_MOUNT_PATH,
    DEFAULT_NODES,
    DEFAULT_PICKER_FAILURE_MODE,
    DEFAULT_REPLICAS,
    SLEEP_LEVEL_FILE,
    TENANTS_FILE,
)
from kvledger.operator.api.scaling_spec import Autoscaling, parse_autoscaling
from kvledger.operator.api.spec_rules import check_rules
from kvledger.operator.api.spec_size import check_size

# The pod's fields the spec passes through as Kubernetes writes them.
POD_FIELDS = ("nodeSelector", "affinity", "priorityClassName", "runtimeClassName",
              "imagePullSecrets", "serviceAccountName")


@dataclass(frozen=True)
class ModelVolume:
    """``spec.model.volume``: exactly one of a claim and a host folder, and its mount."""

    claim_name: str | None
    host_path: str | None
    mount_path: str


@dataclass(frozen=True)
class Model:
    """``spec.model``: a checkpoint directory as the pod sees it (``path``) or a hub
    model (``uri``, with its token's Secret key, its mirror and its cache's claim)."""

    path: str | None
    uri: str | None
    name: str | None
    volume: ModelVolume | None
    token_secret: tuple[str, str] | None  # (Secret name, key)
    endpoint: str | None
    cache_claim: str | None  # None: an emptyDir sized from the download

    @property
    def needs_download_size(self) -> bool:
        """Whether rendering the pod needs the hub model's download size: an emptyDir
        cache is sized from it; a claim has its own size."""
        return self.uri is not None and self.cache_claim is None


@dataclass(frozen=True)
class InferencePool:
    """``spec.inferencePool``: serve behind the Gateway API Inference Extension. The
    operator renders an InferencePool of the serving pods, whose picker (a Service of the
    same namespace) is ``picker`` on ``picker_port``, else the admin's default."""

    picker: str | None = None  # the Endpoint Picker's Service; None: the chart's default
    picker_port: int | None = None  # its ext-proc port; None: the chart's default (9002)
    failure_mode: str = DEFAULT_PICKER_FAILURE_MODE


@dataclass(frozen=True)
class ServiceSpec:
    """A spec that can work, its defaults taken. The pod's own objects (resources,
    placement, env) are Kubernetes', copied as written; renderers copy them again."""

    model: Model
    engine: EngineConfig  # both containers' flags, for the pod's device
    # serve's own options (port, drain, line, tools, ...), and the fields the resource (or
    # the operator: the tenants file) gives, passed on even at serve's default
    serve: ServeConfig = field(default_factory=ServeConfig)
    serve_given: frozenset[str] = frozenset()
    gpus: int = DEFAULT_GPUS  # per pod: with nodes > 1, each pod of a group has as many
    nodes: int = DEFAULT_NODES  # pods per replica: more than 1 is a LeaderWorkerSet group
    replicas: int = DEFAULT_REPLICAS
    image: str | None = None
    autoscaling: Autoscaling | None = None
    # spec.resources.limits.memory in bytes: the engine container's cgroup limit.
    container_memory_limit_bytes: int | None = None
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    pod_fields: dict[str, Any] = field(default_factory=dict)  # POD_FIELDS that are set
    tolerations: list[dict[str, Any]] | None = None  # None: not given (a GPU default)
    env: list[dict[str, Any]] = field(default_factory=list)
    pod_annotations: dict[str, str] = field(default_factory=dict)
    pod_labels: dict[str, str] = field(default_factory=dict)
    # The resource's own metadata.labels and metadata.annotations, filtered, for its pods
    # (``propagation.with_metadata``; the spec alone has none).
    resource_labels: dict[str, str] = field(default_factory=dict)
    resource_annotations: dict[str, str] = field(default_factory=dict)
    api_key_secret: tuple[str, str] | None = None  # (Secret name, key): KVLEDGER_API_KEY
    tenants_secret: tuple[str, str] | None = None  # (Secret name, key): --tenants-file
    inference_pool: InferencePool | None = None  # None: a plain Service only
    sleep: int | None = None  # spec.sleep: the level the pods should be at (None: awake)

    def serving_flags(self) -> list[str]:
        """``serve``'s own flags (the pod's and ``kvledger run``'s), generated from
        ``ServeConfig``'s declarations: the port, the SIGTERM drain, the line a request may
        wait in for its reservation, the tenants file and tool calling, as the resource
        gives them."""
        return self.serve.to_flags(self.serve_given)


def cluster_device(gpus: int) -> str:
    """In a pod the device is explicit: CUDA when GPUs are requested, else the CPU."""
    return "cuda" if gpus > 0 else "cpu"


def parse_spec(raw: Mapping[str, Any]) -> ServiceSpec:
    """The spec as a frozen value. Raises BadInput (one line) for a spec that can never
    work: what the CRD's schema or rules refuse, flags the engine refuses, and a spec
    deeper or larger than a pod's fields take (``spec_size``)."""
    check_size(raw)
    check_kserve_shape(raw)  # before the rules: its model is under predictor
    scaling = parse_autoscaling(raw.get("autoscaling"))  # its field checks come before its rules
    check_rules(raw)
    model = _model(raw.get("model") or {})
    gpus = raw.get("gpus", DEFAULT_GPUS)
    nodes = raw.get("nodes", DEFAULT_NODES)
    limits = (raw.get("resources") or {}).get("limits") or {}
    serving = spec_settings(raw, ServeConfig)
    if "tenantsSecretRef" in raw:  # its key, mounted where serve reads it
        serving["tenants_file"] = TENANTS_FILE
    if (raw.get("engine") or {}).get("enableSleepMode"):  # spec.sleep, mounted likewise
        serving["sleep_level_file"] = SLEEP_LEVEL_FILE
    return ServiceSpec(
        model=model,
        engine=_engine_config(raw, model, cluster_device(gpus), tensor_parallel_size(gpus), nodes),
        gpus=gpus,
        nodes=nodes,
        replicas=raw.get("replicas", DEFAULT_REPLICAS),
        serve=ServeConfig(**serving),
        serve_given=frozenset(serving),
        image=raw.get("image") or None,
        autoscaling=scaling,
        container_memory_limit_bytes=(quantity_bytes("spec.resources.limits.memory",
                                                     limits["memory"])
                                      if "memory" in limits else None),
        resources=_quantities(raw.get("resources") or {}),
        pod_fields={name: copy.deepcopy(raw[name]) for name in POD_FIELDS if name in raw},
        tolerations=copy.deepcopy(raw["tolerations"]) if "tolerations" in raw else None,
        env=copy.deepcopy(list(raw.get("env") or [])),
        pod_annotations=dict(raw.get("podAnnotations") or {}),
        pod_labels=dict(raw.get("podLabels") or {}),
        api_key_secret=_secret_ref(raw.get("apiKeySecretRef")),
        tenants_secret=_secret_ref(raw.get("tenantsSecretRef")),
        inference_pool=_inference_pool(raw.get("inferencePool")),
        sleep=raw.get("sleep"),
    )


def _quantities(resources: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``spec.resources`` for the pod, every quantity a string (an integer as its digits)."""
    # The CRD takes ``cpu: 4`` as Kubernetes does (int-or-string), but the client's model of
    # a container's resources takes strings alone: an integer failed every apply of the pod.
    return {kind: {name: str(quantity) if isinstance(quantity, int)
                   and not isinstance(quantity, bool) else copy.deepcopy(quantity)
                   for name, quantity in (quantities or {}).items()}
            for kind, quantities in resources.items()}


def _secret_ref(ref: Mapping[str, Any] | None) -> tuple[str, str] | None:
    return None if ref is None else (ref["name"], ref["key"])


def _model(model: Mapping[str, Any]) -> Model:
    volume = model.get("volume")
    return Model(
        path=model.get("path"), uri=model.get("uri"), name=model.get("name"),
        volume=None if volume is None else ModelVolume(
            claim_name=(volume.get("persistentVolumeClaim") or {}).get("claimName"),
            host_path=(volume.get("hostPath") or {}).get("path"),
            mount_path=volume.get("mountPath", DEFAULT_MOUNT_PATH)),
        token_secret=_secret_ref(model.get("tokenSecretRef")),
        endpoint=model.get("endpoint"),
        cache_claim=((model.get("cache") or {}).get("persistentVolumeClaim") or {})
        .get("claimName"))


def _engine_config(raw: Mapping[str, Any], model: Model, device: str,
                   tensor_parallel_size: int, nodes: int = DEFAULT_NODES) -> EngineConfig:
    values: dict[str, Any] = {
        "model": posixpath.normpath(model.path) if model.path else (model.uri or ""),
        "served_model_name": model.name,
        "device": device,
        "tensor_parallel_size": tensor_parallel_size,  # one rank per GPU
    }
    values.update(spec_settings(raw))
    if nodes > 1:  # a group: P stages over gpus * nodes GPUs, nodes of them at least
        values.setdefault("pipeline_parallel_size", nodes)
    # engine.pipelineParallelSize P: the group's gpus * nodes GPUs (one pod's with nodes 1)
    # are P stages of gpus * nodes / P ranks each.
    values["tensor_parallel_size"] = max(1, tensor_parallel_size * nodes
                                         // values.get("pipeline_parallel_size", 1))
    adapters = parse_adapters(raw.get("adapters") or [], model.uri is not None,
                              model.volume.mount_path if model.volume is not None else None)
    if adapters:  # spec.adapters: --enable-lora --lora-modules NAME=URI ...
        values.update(enable_lora=True, lora_modules=adapters)
    if raw.get("allowRuntimeLoraUpdating"):  # adapters loaded at run time need LoRA on
        values["enable_lora"] = True
    try:
        return EngineConfig(**values)
    except TypeError as exc:  # a wrongly typed value the schema would have caught
        raise BadInput(f"invalid spec: {exc}") from None


def spec_settings(raw: Mapping[str, Any], config_type: type = EngineConfig
                  ) -> dict[str, Any]:
    """The config's values the spec sets (``spec.engine``, ``spec.memory``, ``spec.tools``
    or ``spec`` itself): each setting of ``config_type`` declared in the CRD
    (``engine/settings/declare.py``), by its spec name; one the CRD defaults is set to that default
    when the spec lacks it, as the API server fills it in (``kvledger run`` has none); a
    SIZE is read as bytes, more than 0."""
    values: dict[str, Any] = {}
    for f, declared in settings_of(config_type):
        crd, name = declared.crd, declared.spec_name
        if crd is None:
            continue
        section = raw if crd.section == "" else (raw.get(crd.section) or {})
        if name not in section:
            if crd.defaulted:
                values[f.name] = default_of(f)
            continue
        value = section[name]
        if declared.kind.domain in ("size", "bytes"):
            value = _positive_size(".".join(filter(None, (crd.section, name))), value)
        elif declared.kind.from_spec is not None:  # an object of the spec's own names
            value = declared.kind.from_spec(value)
        values[f.name] = value
    return values


def _positive_size(field_name: str, value: Any) -> int:
    size = parse_size(value)
    if size <= 0:
        raise BadInput(f"{field_name} must be more than 0 bytes, got {shown(value)}")
    return size


def _inference_pool(pool: Mapping[str, Any] | None) -> InferencePool | None:
    """``spec.inferencePool`` with the CRD's defaults, or None without it."""
    if pool is None:
        return None
    picker = pool.get("endpointPicker") or {}
    return InferencePool(picker=picker.get("name"), picker_port=picker.get("port"),
                         failure_mode=picker.get("failureMode", DEFAULT_PICKER_FAILURE_MODE))
