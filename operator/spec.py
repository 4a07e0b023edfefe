"""From an InferenceService spec to the engine's flags: the seam between operator and pod.

The init container (``kvledger preflight``), the engine container (``kvledger serve``)
and ``kvledger run`` all get their flags from ``engine_config`` here, so the plan the
pre-flight approves is the plan the engine runs.
"""

from __future__ import annotations

import posixpath
from typing import Any

from kvledger.engine.config import EngineConfig, parse_size
from kvledger.engine.errors import BadInput
from kvledger.operator.crd import DEFAULT_MOUNT_PATH

# spec.engine / spec.memory field -> EngineConfig field
_ENGINE_FIELDS = {
    "maxModelLen": "max_model_len",
    "maxNumSeqs": "max_num_seqs",
    "maxNumBatchedTokens": "max_num_batched_tokens",
    "blockSize": "block_size",
    "dtype": "dtype",
    "kvCacheDtype": "kv_cache_dtype",
    "enforceEager": "enforce_eager",
    "seed": "seed",
}
_MEMORY_FIELDS = {
    "gpuMemoryUtilization": "gpu_memory_utilization",
    "numGpuBlocksOverride": "num_gpu_blocks_override",
}


def check_rules(spec: dict[str, Any]) -> None:
    """The CRD's cross-field (CEL) rules, for API servers and ``kvledger run`` that skip them."""
    engine = spec.get("engine") or {}
    if "maxNumBatchedTokens" in engine and "maxNumSeqs" in engine \
            and engine["maxNumBatchedTokens"] < engine["maxNumSeqs"]:
        raise BadInput("maxNumBatchedTokens must be at least maxNumSeqs (every running sequence decodes one token per step)")
    model = spec.get("model") or {}
    volume = model.get("volume")
    if volume is not None:
        if ("persistentVolumeClaim" in volume) == ("hostPath" in volume):
            raise BadInput("set exactly one of persistentVolumeClaim and hostPath")
        mount = volume.get("mountPath", DEFAULT_MOUNT_PATH)
        path = model.get("path", "")
        if path != mount and not path.startswith(mount.rstrip("/") + "/"):
            raise BadInput("model.path must lie under model.volume.mountPath")


def engine_config(spec: dict[str, Any], *, model_path: str | None = None,
                  device: str = "auto") -> EngineConfig:
    """The engine flags a spec declares. Raises BadInput for a spec that can never work."""
    check_rules(spec)
    model = spec.get("model") or {}
    values: dict[str, Any] = {
        "model": model_path or model.get("path", ""),
        "served_model_name": model.get("name"),
        "device": device,
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


def cluster_device(spec: dict[str, Any]) -> str:
    """In a pod the device is explicit: CUDA when GPUs are requested, else the CPU."""
    return "cuda" if spec.get("gpus", 1) > 0 else "cpu"


def local_model_path(spec: dict[str, Any]) -> str:
    """Where ``spec.model.path`` is on this machine, mapped the way the kubelet mounts it.

    With a ``hostPath`` volume, the pod sees ``hostPath.path`` at ``mountPath``, so
    ``mountPath/x`` is ``hostPath.path/x`` here. Without a volume, or with a PVC (which has
    no meaning off the cluster), the path is taken as a local path unchanged.
    """
    model = spec["model"]
    volume = model.get("volume") or {}
    host = (volume.get("hostPath") or {}).get("path")
    if host is None:
        return model["path"]
    mount = volume.get("mountPath", DEFAULT_MOUNT_PATH)
    relative = posixpath.relpath(model["path"], mount)
    return host if relative == "." else posixpath.join(host, relative)
