"""The limit a plan is held to (docs/planner.md, "Precedence"):

- the smallest cap given (``--memory-limit``, ``--gpu-memory-utilization`` x total);
- with none, free device memory less a safety margin (wider on a unified pool);
- a cap above the device's free memory does not fit, whatever the run: the engine could
  not allocate it, and vLLM refuses to start there ("free memory on device ... is less
  than desired GPU memory utilization"). The refusal names the free memory and the
  largest ``--gpu-memory-utilization`` within it.
"""

from __future__ import annotations

from kvledger.engine.planner import estimates
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.settings.config import EngineConfig

FREE_MEMORY = "free-memory"  # the limit's source when no cap is given


def resolve_limit(config: EngineConfig, device: DeviceMemory) -> tuple[int, str, int]:
    """``(limit_bytes, limit_source, margin_bytes)``; the smallest cap wins."""
    caps: list[tuple[int, str]] = []
    if config.memory_limit_bytes is not None:
        caps.append((config.memory_limit_bytes, "--memory-limit"))
    if config.gpu_memory_utilization is not None:
        caps.append((int(device.total_bytes * config.gpu_memory_utilization),
                     "--gpu-memory-utilization"))
    if caps:
        limit, source = min(caps, key=lambda cap: cap[0])
        return limit, source, 0
    margin = estimates.safety_margin_bytes(device.total_bytes, device.unified)
    return max(0, device.free_bytes - margin), FREE_MEMORY, margin


def fits(required_bytes: int, limit_bytes: int, pool_blocks: int, needed_blocks: int,
         cap_too_large: bool) -> bool:
    """THE verdict: the run's bytes within the limit, a pool of at least the blocks the
    declared workload needs, and a cap the device can give (``cap_above_free``)."""
    return required_bytes <= limit_bytes and pool_blocks >= needed_blocks and not cap_too_large


def cap_above_free(limit_bytes: int, limit_source: str, device: DeviceMemory) -> bool:
    """Whether the limit is a cap (not free memory) larger than the device's free memory."""
    return limit_source != FREE_MEMORY and limit_bytes > device.free_bytes


def largest_utilization(device: DeviceMemory) -> float:
    """The largest ``--gpu-memory-utilization`` in hundredths (free / total, rounded down)
    whose cap is within the device's free memory; 0.0 when not even 0.01 is."""
    if device.total_bytes <= 0:
        return 0.0
    hundredths = device.free_bytes * 100 // device.total_bytes
    # The cap is int(total x fraction) in floating point, which may land a byte above free
    # when free / total is exactly the fraction (on pools of petabytes): step down then.
    while hundredths > 0 and int(device.total_bytes * (hundredths / 100)) > device.free_bytes:
        hundredths -= 1
    return hundredths / 100


def limit_warnings(config: EngineConfig, device: DeviceMemory) -> list[str]:
    """What the report warns about the caps: a utilization of a unified pool is a fraction
    of memory the host shares."""
    util = config.gpu_memory_utilization
    if not (device.unified and util is not None):
        return []
    left = device.total_bytes - int(device.total_bytes * util)
    return [f"--gpu-memory-utilization {util} on a unified memory pool is a fraction of the "
            f"WHOLE pool shared with the host ({_gib(device.total_bytes)}), not of dedicated "
            f"GPU memory: it leaves {_gib(left)} to the OS and every other process; prefer "
            "--memory-limit SIZE"]


def host_memory_note(limit_bytes: int, limit_source: str, pool_mode: str, kv_bytes: int,
                     device: DeviceMemory, utilization: float | None) -> str | None:
    """On the CPU, what ``--gpu-memory-utilization`` takes: vLLM's meaning is kept (that
    fraction of the device's total, here the host's RAM, and the KV pool takes what the
    run leaves of it), which on a host is many GiB allocated before the first request.
    vLLM's CPU build sizes its KV space by VLLM_CPU_KVCACHE_SPACE instead; the note says how
    much is taken and the flags that cap it. None elsewhere, and when the pool is not
    sized by the cap (``--kv-cache-memory-bytes``, ``--num-gpu-blocks-override``)."""
    if (device.kind != "cpu" or limit_source != "--gpu-memory-utilization"
            or pool_mode != "cap"):
        return None
    return (f"--gpu-memory-utilization {utilization} on the CPU is {utilization:.0%} of this "
            f"host's memory ({_gib(limit_bytes)} of {_gib(device.total_bytes)}): the KV pool "
            f"takes {_gib(kv_bytes)} of it, allocated now; to take less, cap the pool with "
            "--kv-cache-memory-bytes SIZE (what vLLM's CPU build sets with "
            "VLLM_CPU_KVCACHE_SPACE) or the whole engine with --memory-limit SIZE")


def _gib(n: int) -> str:
    return f"{n / estimates.GiB:.1f} GiB"
