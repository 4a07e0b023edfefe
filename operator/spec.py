"""From an InferenceService spec to the engine's flags: the seam between operator and pod.

The init container (``kvledger preflight``), the engine container (``kvledger serve``)
and ``kvledger run`` all get their flags from ``engine_config`` here, so the plan the
pre-flight approves is the plan the engine runs.
"""

from __future__ import annotations

import math
import posixpath
import re
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

from kvledger.engine.config import EngineConfig, parse_size
from kvledger.engine.errors import BadInput
from kvledger.operator.crd import (
    AUTOSCALING_METRICS,
    AUTOSCALING_PROVIDERS,
    DEFAULT_MOUNT_PATH,
    DEFAULT_SHUTDOWN_GRACE_S,
    GPUS_MESSAGE,
    MIN_MAX_MESSAGE,
    MIN_REPLICAS_MESSAGE,
    PROMETHEUS_MESSAGE,
    RATIO_MESSAGE,
    TARGET_PATTERN,
    TARGET_POSITIVE_MESSAGE,
)

# spec.engine / spec.memory field -> EngineConfig field
_ENGINE_FIELDS = {
    "maxModelLen": "max_model_len",
    "maxNumSeqs": "max_num_seqs",
    "maxNumBatchedTokens": "max_num_batched_tokens",
    "blockSize": "block_size",
    "dtype": "dtype",
    "kvCacheDtype": "kv_cache_dtype",
    "enforceEager": "enforce_eager",
    "enablePrefixCaching": "enable_prefix_caching",
    "seed": "seed",
}
_MEMORY_FIELDS = {
    "gpuMemoryUtilization": "gpu_memory_utilization",
    "numGpuBlocksOverride": "num_gpu_blocks_override",
}


def shutdown_grace_s(spec: dict[str, Any]) -> int:
    """How long the engine lets in-flight requests run after SIGTERM (``--shutdown-grace``)."""
    return spec.get("shutdownGraceSeconds", DEFAULT_SHUTDOWN_GRACE_S)


def serving_flags(spec: dict[str, Any]) -> list[str]:
    """``serve``'s own flags (the pod's and ``kvledger run``'s): the SIGTERM drain, and how
    long a request may queue for a reservation before its 429 (0: none queue)."""
    return ["--shutdown-grace", str(shutdown_grace_s(spec)),
            "--max-queue-wait", str(spec.get("maxQueueWaitSeconds", 0))]


def check_rules(spec: dict[str, Any]) -> None:
    """The CRD's cross-field (CEL) rules, for API servers and ``kvledger run`` that skip them."""
    if spec.get("gpus", 1) > 1:
        raise BadInput(GPUS_MESSAGE)
    engine = spec.get("engine") or {}
    if "maxNumBatchedTokens" in engine and "maxNumSeqs" in engine \
            and engine["maxNumBatchedTokens"] < engine["maxNumSeqs"]:
        raise BadInput("maxNumBatchedTokens must be at least maxNumSeqs (every running sequence decodes one token per step)")
    model = spec.get("model") or {}
    if ("path" in model) == ("uri" in model):
        raise BadInput("set exactly one of model.path and model.uri")
    if ".." in model.get("path", "").split("/"):
        raise BadInput("model.path must not contain a '..' segment")
    volume = model.get("volume")
    if volume is not None:
        if ("persistentVolumeClaim" in volume) == ("hostPath" in volume):
            raise BadInput("set exactly one of persistentVolumeClaim and hostPath")
        if "uri" in model:
            raise BadInput("model.volume holds a model.path checkpoint; a model.uri is "
                           "downloaded into model.cache")
        mount = volume.get("mountPath", DEFAULT_MOUNT_PATH)
        path = model.get("path", "")
        if path != mount and not path.startswith(mount.rstrip("/") + "/"):
            raise BadInput("model.path must lie under model.volume.mountPath")
    if "uri" not in model and {"tokenSecretRef", "endpoint", "cache"} & model.keys():
        raise BadInput("model.tokenSecretRef, model.endpoint and model.cache apply to a "
                       "model.uri only")
    for toleration in spec.get("tolerations") or []:
        _check_toleration(toleration)
    for var in spec.get("env") or []:
        if "value" in var and "valueFrom" in var:
            raise BadInput("an env var takes value or valueFrom, not both")
    for source in spec.get("envFrom") or []:
        if ("configMapRef" in source) == ("secretRef" in source):
            raise BadInput("an envFrom entry takes exactly one of configMapRef and secretRef")
    autoscaling(spec)


# The per-pod target each metric holds when spec.autoscaling.target is not given.
DEFAULT_TARGETS = {"kvReservedRatio": "0.8", "requestsWaiting": "4", "rejectionRate": "1"}


@dataclass(frozen=True)
class Autoscaling:
    """``spec.autoscaling`` with its defaults; ``target`` is the exact per-pod value."""

    min_replicas: int
    max_replicas: int
    metric: str
    target: Fraction
    provider: str
    server_address: str | None


def autoscaling(spec: dict[str, Any]) -> Autoscaling | None:
    """``spec.autoscaling`` with the CRD's defaults, or None without it. Raises BadInput for
    what the CRD's rules refuse (the same words), and a target the metric cannot reach."""
    scaling = spec.get("autoscaling")
    if scaling is None:
        return None
    metric = scaling.get("metric", AUTOSCALING_METRICS[0])
    provider = scaling.get("provider", AUTOSCALING_PROVIDERS[0])
    if metric not in AUTOSCALING_METRICS or provider not in AUTOSCALING_PROVIDERS:
        raise BadInput(f"autoscaling: unknown metric {metric!r} or provider {provider!r}")
    low, high = scaling.get("minReplicas", 1), scaling.get("maxReplicas")
    if not isinstance(high, int) or high < 1 or not isinstance(low, int) or low < 0:
        raise BadInput("autoscaling.maxReplicas must be at least 1 and minReplicas at least 0")
    if low > high:
        raise BadInput(MIN_MAX_MESSAGE)
    if low == 0 and provider != "keda":
        raise BadInput(MIN_REPLICAS_MESSAGE)
    if "prometheus" in scaling and provider != "keda":
        raise BadInput(PROMETHEUS_MESSAGE)
    target = target_value(scaling.get("target", DEFAULT_TARGETS[metric]))
    if metric == "kvReservedRatio" and target > 1:
        raise BadInput(RATIO_MESSAGE)
    return Autoscaling(min_replicas=low, max_replicas=high, metric=metric, target=target,
                       provider=provider,
                       server_address=(scaling.get("prometheus") or {}).get("serverAddress"))


def target_value(value: Any) -> Fraction:
    """The exact number an autoscaling target names: ``4``, ``"0.8"``, ``"800m"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not re.fullmatch(TARGET_PATTERN, value):
        raise BadInput(f"autoscaling.target: {value!r} is not a whole number, a decimal or "
                       "thousandths (4, \"0.8\", \"800m\")")
    number = (Fraction(int(value[:-1]), 1000) if value.endswith("m")
              else Fraction(Decimal(value)))
    if number <= 0:
        raise BadInput(TARGET_POSITIVE_MESSAGE)
    return number


def _check_toleration(toleration: dict[str, Any]) -> None:
    operator = toleration.get("operator")
    if not toleration.get("key") and operator != "Exists":
        raise BadInput("a toleration without a key must have operator Exists")
    if operator == "Exists" and toleration.get("value"):
        raise BadInput("a toleration with operator Exists takes no value")
    if "tolerationSeconds" in toleration and toleration.get("effect") != "NoExecute":
        raise BadInput("tolerationSeconds applies to effect NoExecute only")


def hub_uri(spec: dict[str, Any]) -> str | None:
    """``spec.model.uri`` (``hf://ORG/NAME[@REVISION]``), or None for a checkpoint directory."""
    return (spec.get("model") or {}).get("uri")


def cache_claim(spec: dict[str, Any]) -> str | None:
    """The claim a hub model is downloaded into (``spec.model.cache``), or None: an emptyDir."""
    cache = (spec.get("model") or {}).get("cache") or {}
    return (cache.get("persistentVolumeClaim") or {}).get("claimName")


def needs_download_size(spec: dict[str, Any]) -> bool:
    """Whether rendering the pod needs the hub model's download size: an emptyDir cache is
    sized from it; a claim has its own size."""
    return hub_uri(spec) is not None and cache_claim(spec) is None


def engine_config(spec: dict[str, Any], *, model_path: str | None = None,
                  device: str = "auto",
                  container_memory_limit_bytes: int | None = None) -> EngineConfig:
    """The engine flags a spec declares. Raises BadInput for a spec that can never work."""
    check_rules(spec)
    model = spec.get("model") or {}
    path = model.get("path")
    values: dict[str, Any] = {
        "model": model_path or (posixpath.normpath(path) if path else model.get("uri", "")),
        "served_model_name": model.get("name"),
        "device": device,
        "container_memory_limit_bytes": container_memory_limit_bytes,
    }
    engine = spec.get("engine") or {}
    values.update({ours: engine[theirs] for theirs, ours in _ENGINE_FIELDS.items()
                   if theirs in engine})
    memory = spec.get("memory") or {}
    values.update({ours: memory[theirs] for theirs, ours in _MEMORY_FIELDS.items()
                   if theirs in memory})
    if "limit" in memory:
        values["memory_limit_bytes"] = _positive_size("memory.limit", memory["limit"])
    if "kvCacheMemoryBytes" in memory:
        values["kv_cache_memory_bytes"] = _positive_size("memory.kvCacheMemoryBytes",
                                                         memory["kvCacheMemoryBytes"])
    try:
        return EngineConfig(**values)
    except TypeError as exc:  # a wrongly typed value the schema would have caught
        raise BadInput(f"invalid spec: {exc}") from None


def _positive_size(field: str, value: Any) -> int:
    size = parse_size(value)
    if size <= 0:
        raise BadInput(f"{field} must be more than 0 bytes, got {value!r}")
    return size


# A Kubernetes quantity (k8s.io/apimachinery resource.Quantity): a signed decimal number,
# then a binary (Ki..Ei) or decimal (n, u, m, "", k, M..E) suffix or an exponent (e3, E-2).
_QUANTITY_RE = re.compile(r"([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
                          r"([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?")
_QUANTITY_SCALE = {
    **{unit: 2 ** (10 * (i + 1)) for i, unit in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{unit: Fraction(10) ** exp for unit, exp in (("n", -9), ("u", -6), ("m", -3), ("", 0),
                                                    ("k", 3), ("M", 6), ("G", 9), ("T", 12),
                                                    ("P", 15), ("E", 18))},
}


def quantity_bytes(field: str, value: Any) -> int:
    """Bytes in a Kubernetes memory quantity (``2Gi``, ``2G``, ``2000M``, ``512Mi``,
    ``1e9``, ``1500m``, plain bytes), rounded up to a whole byte as Kubernetes does.
    Raises BadInput naming ``field`` for anything else, or for no bytes at all."""
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    match = _QUANTITY_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise BadInput(f"{field}: {value!r} is not a Kubernetes quantity "
                       "(e.g. 2Gi, 2G, 2000M, 512Mi or plain bytes)")
    sign, number, suffix = match.group(1), match.group(2), match.group(3) or ""
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        exponent = int(suffix[1:])
        if abs(exponent) > 30:  # beyond any machine's memory (and Kubernetes' int64)
            raise BadInput(f"{field}: {value!r} is out of range")
        scale = Fraction(10) ** exponent
    else:
        scale = _QUANTITY_SCALE[suffix]
    size = math.ceil(Fraction(Decimal(number)) * scale)
    if sign == "-" or size <= 0:
        raise BadInput(f"{field} must be more than 0 bytes, got {value!r}")
    return size


def container_memory_limit(spec: dict[str, Any]) -> int | None:
    """The engine container's memory limit in bytes (``spec.resources.limits.memory``), the
    cgroup limit its host memory reads are capped by in a pod; None when unset."""
    limits = (spec.get("resources") or {}).get("limits") or {}
    if "memory" not in limits:
        return None
    return quantity_bytes("spec.resources.limits.memory", limits["memory"])


def cluster_device(spec: dict[str, Any]) -> str:
    """In a pod the device is explicit: CUDA when GPUs are requested, else the CPU."""
    return "cuda" if spec.get("gpus", 1) > 0 else "cpu"


def local_model_path(spec: dict[str, Any]) -> str:
    """Where ``spec.model.path`` is on this machine, mapped the way the kubelet mounts it
    (a ``spec.model.uri`` is returned as it is).

    With a ``hostPath`` volume, the pod sees ``hostPath.path`` at ``mountPath``, so
    ``mountPath/x`` is ``hostPath.path/x`` here. Without a volume, or with a PVC (which has
    no meaning off the cluster), the path is taken as a local path. Paths are normalised
    (``/models/./m/`` is ``/models/m``); ``check_rules`` refuses a ``..`` segment.
    """
    model = spec["model"]
    if "path" not in model:
        return model["uri"]  # the engine downloads it into its own cache
    path = posixpath.normpath(model["path"])
    volume = model.get("volume") or {}
    host = (volume.get("hostPath") or {}).get("path")
    if host is None:
        return path
    mount = posixpath.normpath(volume.get("mountPath", DEFAULT_MOUNT_PATH))
    relative = posixpath.relpath(path, mount)
    return host if relative == "." else posixpath.join(host, relative)
