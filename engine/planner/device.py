"""The platform seam: how much memory the device the engine will run on has.

Three sources, in this order: the what-if flags (``--device-memory`` [``--device-free``]
[``--unified-memory``]) so anyone can plan for a card they do not have; NVML for an
NVIDIA GPU (``--device cuda``, or ``auto`` when one is there); host memory for
``--device cpu`` (or ``auto`` without a GPU), capped by the container's cgroup limit.

``--container-memory-limit`` applies a container's limit where there is no such cgroup
(``kvledger run`` on a laptop), so host memory reads as it would in the pod.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config import EngineConfig

# cgroup v1 reports "no limit" as a page-rounded 2**63 - 1.
_UNLIMITED_V1 = 2**62


@dataclass(frozen=True)
class DeviceMemory:
    kind: str  # "cuda" | "cpu" | "what-if"
    name: str
    total_bytes: int
    free_bytes: int
    unified: bool  # one pool shared with the host (GB10, GH200 ...)
    # Whether it computes in bfloat16 (a GPU of compute capability 8.0 or later, as torch's
    # is_bf16_supported); a what-if card is taken to. Decides --dtype auto's half precision.
    bfloat16: bool = True


def probe_device(config: EngineConfig) -> DeviceMemory:
    """What-if flags win; else NVML for cuda/auto; else host memory (cgroup-aware).

    ``--unified-memory`` without ``--device-memory`` marks a probed device as unified.
    """
    if config.device_memory_bytes is not None:
        total = config.device_memory_bytes
        free = total if config.device_free_bytes is None else config.device_free_bytes
        return DeviceMemory("what-if", "what-if device", total, free, config.unified_memory)
    container_limit = config.container_memory_limit_bytes
    if config.device in ("cuda", "auto"):
        gpu = probe_nvml(container_limit_bytes=container_limit)
        if gpu is not None:
            return _mark_unified(gpu, config.unified_memory)
        if config.device == "cuda":
            raise BadInput("--device cuda, but NVML finds no NVIDIA GPU here; use --device cpu "
                           "or plan for a card with --device-memory SIZE")
    return _mark_unified(probe_host(container_limit_bytes=container_limit),
                         config.unified_memory)


def _mark_unified(device: DeviceMemory, unified_flag: bool) -> DeviceMemory:
    if unified_flag and not device.unified:
        return replace(device, unified=True)
    return device


def probe_nvml(index: int | None = None, *,
               container_limit_bytes: int | None = None) -> DeviceMemory | None:
    """The engine's GPU through NVML, or None when there is no NVML or no GPU.

    The device is the first of ``CUDA_VISIBLE_DEVICES`` (index or UUID) or GPU 0. The
    pool is unified when NVML reports no dedicated memory (GB10 answers "not supported"
    for memory info; host memory, read by ``probe_host``, is then the pool) or an ATS
    addressing mode (GH200).
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded ...: no GPU here
        return None
    try:
        handle = _nvml_handle(pynvml, index)
        if handle is None:
            return None
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            total, free = int(info.total), int(info.free)
        except pynvml.NVMLError:
            total = free = 0
        unified = total == 0 or _addressing_mode(pynvml, handle) == "ATS"
        if total == 0:
            host = probe_host(container_limit_bytes=container_limit_bytes)
            total, free = host.total_bytes, host.free_bytes
        return DeviceMemory("cuda", name, total, free, unified, _computes_bfloat16(pynvml, handle))
    except pynvml.NVMLError:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _nvml_handle(pynvml, index: int | None):
    if pynvml.nvmlDeviceGetCount() == 0:
        return None
    if index is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        if visible.startswith(("GPU-", "MIG-")):
            return pynvml.nvmlDeviceGetHandleByUUID(visible)
        index = int(visible) if visible.isdigit() else 0
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def _computes_bfloat16(pynvml, handle) -> bool:
    """Compute capability 8.0 or later (Ampere on). A driver or pynvml that cannot say is
    taken to, as a what-if card is; ``--dtype float16`` plans and runs a card that does not."""
    try:
        major, _minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    except Exception:  # NVMLError, or no such query in this pynvml
        return True
    return int(major) >= 8


def _addressing_mode(pynvml, handle) -> str:
    """"ATS", "HMM" or "NONE"; "NONE" when the driver cannot say.

    HMM alone does not make a pool unified: discrete cards report it too with the open
    kernel modules, while their memory stays dedicated.
    """
    try:
        mode = pynvml.nvmlDeviceGetAddressingMode(handle)
    except Exception:  # older driver or pynvml: no such query
        return "NONE"
    return {getattr(pynvml, "NVML_DEVICE_ADDRESSING_MODE_ATS", 2): "ATS",
            getattr(pynvml, "NVML_DEVICE_ADDRESSING_MODE_HMM", 1): "HMM"}.get(mode, "NONE")


def host_available_bytes() -> int | None:
    """The host memory free now (``probe_host``: the cgroup's limit counted), what a read
    ahead of the checkpoint may fill; None where it cannot be told."""
    try:
        return probe_host().free_bytes
    except BadInput:
        return None


def probe_host(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup"), *,
               container_limit_bytes: int | None = None) -> DeviceMemory:
    """Host memory (MemTotal/MemAvailable) capped by this process's cgroup memory limit
    (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) less what the cgroup already uses.

    ``container_limit_bytes`` caps it the same way, as the limit of a container holding
    only this process: less this process's resident memory (``VmRSS``).
    """
    meminfo = _meminfo(proc / "meminfo")
    total = meminfo.get("MemTotal", 0)
    free = meminfo.get("MemAvailable", meminfo.get("MemFree"))  # None: unreadable
    name = "host memory"
    caps = [(cgroup_memory(proc, cgroup), "cgroup limit")]
    if container_limit_bytes is not None:
        rss = _meminfo(proc / "self" / "status").get("VmRSS", 0)
        caps.append(((container_limit_bytes, rss), "container limit"))
    for limit_usage, what in caps:
        if limit_usage is None:
            continue
        limit, usage = limit_usage
        if limit < total or total == 0:
            total = limit
            room = max(0, limit - usage)
            free = room if free is None else min(free, room)
            name = f"host memory ({what})"
    if total <= 0:
        raise BadInput("cannot tell how much host memory there is (/proc/meminfo unreadable); "
                       "plan with --device-memory SIZE")
    return DeviceMemory("cpu", name, total, min(free or 0, total), False)


def _meminfo(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def cgroup_memory(proc: Path, cgroup: Path) -> tuple[int, int] | None:
    """``(limit_bytes, usage_bytes)`` of this process's cgroup, or None without a limit."""
    v2_path, v1_path = "", ""
    try:
        for line in (proc / "self" / "cgroup").read_text().splitlines():
            hierarchy, controllers, rel = ([*line.split(":", 2), "", ""])[:3]
            if hierarchy == "0" and controllers == "":
                v2_path = rel
            elif "memory" in controllers.split(","):
                v1_path = rel
    except OSError:
        pass
    candidates = [
        (cgroup / v2_path.lstrip("/") / "memory.max", cgroup / v2_path.lstrip("/") / "memory.current"),
        (cgroup / "memory.max", cgroup / "memory.current"),
        (cgroup / "memory" / v1_path.lstrip("/") / "memory.limit_in_bytes",
         cgroup / "memory" / v1_path.lstrip("/") / "memory.usage_in_bytes"),
        (cgroup / "memory" / "memory.limit_in_bytes", cgroup / "memory" / "memory.usage_in_bytes"),
    ]
    for limit_file, usage_file in candidates:
        limit = _read_int(limit_file)
        if limit is None or limit >= _UNLIMITED_V1:
            continue
        return limit, _read_int(usage_file) or 0
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2, unlimited) -> None


# -- the CPUs torch's kernels run on (core/cpu_threads.py caps torch's pool so) -----------

CGROUP = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP) -> float | None:
    """The CPUs the cgroup's CFS quota allows (quota / period), or None when unlimited or
    unreadable."""
    try:
        quota, _, period = (root / "cpu.max").read_text().strip().partition(" ")
        if quota == "max":
            return None
        return int(quota) / int(period or 100_000)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def cpu_threads(affinity: int, limit: float | None) -> int:
    """Threads for ``affinity`` usable CPUs under a quota of ``limit`` CPUs (None: none)."""
    if limit is None:
        return max(1, affinity)
    return max(1, min(affinity, math.ceil(limit)))


def host_threads(environ: dict[str, str] | os._Environ = os.environ, root: Path = CGROUP) -> int:
    """The threads torch's CPU kernels will use here: ``OMP_NUM_THREADS`` when set, else
    the CPUs this process may run on under the cgroup's quota (``cpu_threads``)."""
    with contextlib.suppress(ValueError):
        if int(environ.get("OMP_NUM_THREADS", "")) > 0:
            return int(environ["OMP_NUM_THREADS"])
    return cpu_threads(len(os.sched_getaffinity(0)), cgroup_cpu_limit(root))
