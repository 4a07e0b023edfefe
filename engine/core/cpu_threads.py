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

import logging
import os
import time
from pathlib import Path

from kvledger.engine.planner.device import CGROUP, host_threads

log = logging.getLogger("kvledger.engine")


def cap_torch_threads(torch_module, environ=os.environ, root: Path = CGROUP) -> int:
    """Cap torch's intra-op threads at the CPUs the quota allows; returns the count in
    use. Does nothing when ``OMP_NUM_THREADS`` is set."""
    current = torch_module.get_num_threads()
    if environ.get("OMP_NUM_THREADS"):
        return current
    wanted = min(current, host_threads(environ, root))  # the quota's CPUs: no OMP_NUM_THREADS
    if wanted != current:
        torch_module.set_num_threads(wanted)
    return wanted


# -- sharing the cores with other processes -------------------------------------------------
#
# The cap above fixes the most threads; what other processes take of the cores changes as
# the engine runs. With a thread per core, a busy neighbour at nice 0 takes a core from one
# of them, and every kernel then waits at its barrier for the thread that lost its core:
# the decode drops to a third or less. One thread fewer avoids it (the neighbour has its
# core; the rest of ours are whole), but costs a quarter or more when the engine is alone.
# So the engine decides as it runs (``ThreadGovernor``), from two readings over each
# ``GOVERN_INTERVAL_S`` of busy steps: the cores this process used (its CPU time over the
# wall time: a thread per core that busy-waits uses them all when alone), and the cores of
# its affinity that sat idle (/proc/stat). Used well under its threads while no core is
# idle: another process holds one; one fewer. A core idle: one more, up to the cap.

GOVERN_INTERVAL_S = 0.5
BUSY_SHARE = 0.6  # steps ran this share of an interval: its readings say something
LOST_CORES = 0.4  # used at most threads less this while nothing idles: a core was taken
IDLE_CORES = 0.7  # this much of a core idle: a thread may have it
PROC_STAT = Path("/proc/stat")
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def idle_seconds(cpus: set[int], stat: Path = PROC_STAT) -> float | None:
    """The idle (and iowait) time so far of ``cpus``, summed, in seconds; None when
    /proc/stat cannot be read."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = rest.split()
            total += int(fields[3]) + int(fields[4])
    return total / TICKS_PER_S


def next_threads(threads: int, most: int, used_cores: float, idle_cores: float) -> int:
    """The threads for the next interval, given the cores this process used and the cores
    that sat idle over the last one."""
    if threads > 1 and used_cores < threads - LOST_CORES and idle_cores < IDLE_CORES / 2:
        return threads - 1  # another process holds a core our threads waited for
    if threads < most and idle_cores >= IDLE_CORES:
        return threads + 1
    return threads


class ThreadGovernor:
    """Sets torch's threads on the engine's thread (where the kernels run) between steps,
    from ``next_threads``; ``after_step`` is called after each step with its duration."""

    def __init__(self, torch_module, most: int, clock=time.monotonic,
                 cpu_clock=time.process_time, idle=None) -> None:
        self.torch, self.most, self.threads = torch_module, most, most
        self._clock, self._cpu_clock = clock, cpu_clock
        cpus = os.sched_getaffinity(0)
        self._idle = idle or (lambda: idle_seconds(cpus))
        self._start()

    @classmethod
    def for_engine(cls, torch_module, device_type: str, config, environ=os.environ):
        """A governor for a one-process engine on the CPU with more than one thread; None
        otherwise (``OMP_NUM_THREADS`` set is the user's choice, kept as it is; the ranks of
        ``-tp``/``-pp`` share the cores out at start-up)."""
        ranks = config.tensor_parallel_size * config.pipeline_parallel_size
        if device_type != "cpu" or ranks > 1 or environ.get("OMP_NUM_THREADS"):
            return None
        most = torch_module.get_num_threads()
        return cls(torch_module, most) if most > 1 else None

    def _start(self) -> None:
        self._since, self._cpu_since, self._idle_since = self._clock(), self._cpu_clock(), self._idle()
        self._busy_s = 0.0

    def after_step(self, step_s: float) -> None:
        self._busy_s += step_s
        now = self._clock()
        wall = now - self._since
        if wall < GOVERN_INTERVAL_S:
            return
        idle = self._idle()
        if self._busy_s >= BUSY_SHARE * wall and idle is not None and self._idle_since is not None:
            used = (self._cpu_clock() - self._cpu_since) / wall
            wanted = next_threads(self.threads, self.most, used, (idle - self._idle_since) / wall)
            if wanted != self.threads:
                log.info("CPU threads %d -> %d (this process used %.2f cores, %.2f idle)",
                         self.threads, wanted, used, (idle - self._idle_since) / wall)
                self.threads = wanted
                self.torch.set_num_threads(wanted)
        self._start()
