"""Where the engine plans and runs, and the caps on its memory: the settings (vLLM's
names) of ``--memory-limit``, ``--gpu-memory-utilization``, ``--num-gpu-blocks-override``,
``--kv-cache-memory-bytes`` and of the device planned for (``--device``, a what-if
``--device-memory``/``--device-free``, ``--unified-memory``, ``--container-memory-limit``).

``EngineConfig`` (``config.py``) composes them with the workload's settings; the planner
reads them (``planner/device.py``, ``planner/plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config_values import DEVICE, DEVICES, MEMORY
from kvledger.engine.settings.declare import Crd, setting
from kvledger.engine.settings.kinds import (
    BYTES,
    FRACTION,
    FREE_SIZE,
    ON,
    POSITIVE_INT,
    SIZE,
    choice,
)


@dataclass(frozen=True)
class DeviceSettings:
    """The device and the memory caps, each declared once (``setting``)."""

    memory_limit_bytes: int | None = setting(
        None, "--memory-limit", SIZE, group=MEMORY,
        help="hard limit on the engine's device memory, e.g. 40GiB",
        crd=Crd("memory", "hard limit on device memory, e.g. 40Gi (--memory-limit)",
                name="limit"))
    gpu_memory_utilization: float | None = setting(
        None, "--gpu-memory-utilization", FRACTION, aliases=("--device-memory-utilization",),
        group=MEMORY, help="cap as a fraction of the device's TOTAL memory, in (0, 1]",
        crd=Crd("memory", "cap as a fraction of the device's total memory, in (0, 1]"))
    num_gpu_blocks_override: int | None = setting(
        None, "--num-gpu-blocks-override", POSITIVE_INT, group=MEMORY,
        help="exact KV pool size in blocks (wins over --kv-cache-memory-bytes and the caps)",
        crd=Crd("memory", "exact KV pool size in blocks"))
    kv_cache_memory_bytes: int | None = setting(
        None, "--kv-cache-memory-bytes", BYTES, group=MEMORY,
        help="KV pool size, e.g. 4GiB (wins over the caps, which else size the pool)",
        crd=Crd("memory", "KV pool size, e.g. 4Gi"))
    device: str = setting(  # the operator sets it from spec.gpus
        "auto", "--device", choice(DEVICES), group=DEVICE,
        help="where to plan and run (default auto: CUDA when a GPU is visible, else the CPU)")
    device_memory_bytes: int | None = setting(
        None, "--device-memory", SIZE, group=DEVICE,
        help="plan for a device with this much total memory")
    device_free_bytes: int | None = setting(
        None, "--device-free", FREE_SIZE, group=DEVICE,
        help="free memory on that device (default: all of it)")
    unified_memory: bool = setting(
        False, "--unified-memory", ON, group=DEVICE,
        help="the device shares one memory pool with the host (GB10, GH200, ...)")
    container_memory_limit_bytes: int | None = setting(
        None, "--container-memory-limit", SIZE, group=DEVICE,
        help="read host memory (--device cpu, or a unified pool) as a container with this "
             "memory limit sees it: total min(MemTotal, SIZE), free min(MemAvailable, SIZE "
             "less this process's memory). The device's size, not a cap like --memory-limit; "
             "`kvledger run` passes spec.resources.limits.memory")

    def check_device(self) -> None:
        """BadInput, one line, for a what-if device that contradicts itself."""
        if (self.device_free_bytes is not None and self.device_memory_bytes is not None
                and self.device_free_bytes > self.device_memory_bytes):
            raise BadInput("--device-free cannot exceed --device-memory")
        if self.device_free_bytes is not None and self.device_memory_bytes is None:
            raise BadInput("--device-free needs --device-memory")
