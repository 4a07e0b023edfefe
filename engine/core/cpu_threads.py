"""How many threads torch's CPU kernels may use: the CPUs this process may really run on.

torch sizes its OpenMP pool from the CPUs it can see (its affinity), but a Kubernetes CPU
limit is a CFS quota, not an affinity: a pod limited to 2 CPUs on a 64-core node would
start 64 threads that the quota then throttles in turn, and each kernel's threads wait at
their barriers for the throttled ones. Threads that lose their CPU are what makes
kvledger's decode collapse (on a 2-core machine with no quota, one busy process at nice 19
beside it cut the decode from 182 to 6 tokens/s: a case this cap does not change, see
docs/serving.md). So the pool is capped at
the quota, rounded up, when the cgroup sets one (v2 ``cpu.max``, v1
``cpu.cfs_quota_us``/``cpu.cfs_period_us``). ``OMP_NUM_THREADS``, when set, is the user's
choice and is kept.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

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


def cap_torch_threads(torch_module, environ=os.environ, root: Path = CGROUP) -> int:
    """Cap torch's intra-op threads at the CPUs the quota allows; returns the count in
    use. Does nothing when ``OMP_NUM_THREADS`` is set."""
    current = torch_module.get_num_threads()
    if environ.get("OMP_NUM_THREADS"):
        return current
    wanted = min(current, cpu_threads(len(os.sched_getaffinity(0)), cgroup_cpu_limit(root)))
    if wanted != current:
        torch_module.set_num_threads(wanted)
    return wanted
