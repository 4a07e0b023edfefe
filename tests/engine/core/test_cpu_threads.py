"""torch's CPU threads are capped at a pod's CPU limit (a CFS quota torch does not see)."""

from __future__ import annotations

import os

import pytest

from kvledger.engine.core.cpu_threads import (
    ThreadGovernor,
    cap_torch_threads,
    idle_seconds,
    next_threads,
)
from kvledger.engine.planner.device import cgroup_cpu_limit, cpu_threads, host_threads


def _cgroup(tmp_path, v2=None, v1=None):
    if v2 is not None:
        (tmp_path / "cpu.max").write_text(v2)
    if v1 is not None:
        (tmp_path / "cpu").mkdir()
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(v1[0])
        (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(v1[1])
    return tmp_path


@pytest.mark.parametrize(("v2", "v1", "limit"), [
    ("200000 100000\n", None, 2.0),
    ("150000 100000\n", None, 1.5),
    ("max 100000\n", None, None),
    (None, ("250000\n", "100000\n"), 2.5),
    (None, ("-1\n", "100000\n"), None),
    (None, None, None),
    ("garbage\n", None, None),
])
def test_the_cgroup_quota_in_cpus(tmp_path, v2, v1, limit):
    assert cgroup_cpu_limit(_cgroup(tmp_path, v2, v1)) == limit


def test_threads_are_the_quota_rounded_up_within_the_affinity():
    assert cpu_threads(64, 2.0) == 2
    assert cpu_threads(64, 1.5) == 2
    assert cpu_threads(64, 0.25) == 1
    assert cpu_threads(4, 16.0) == 4
    assert cpu_threads(8, None) == 8


def test_the_planner_counts_the_threads_torch_will_use(tmp_path):
    """The plan's timed read faults in as many threads as the engine's torch will copy
    with: OMP_NUM_THREADS when set, else the affinity under the quota."""
    affinity = len(os.sched_getaffinity(0))
    assert host_threads({}, _cgroup(tmp_path / "none")) == affinity
    (tmp_path / "one").mkdir()
    assert host_threads({}, _cgroup(tmp_path / "one", "100000 100000\n")) == 1
    assert host_threads({"OMP_NUM_THREADS": "3"}, _cgroup(tmp_path / "one")) == 3
    assert host_threads({"OMP_NUM_THREADS": "many"}, _cgroup(tmp_path / "one")) == 1


class _Torch:
    def __init__(self, threads):
        self.threads = threads

    def get_num_threads(self):
        return self.threads

    def set_num_threads(self, n):
        self.threads = n


def test_torch_is_capped_at_the_quota_unless_omp_num_threads_is_set(tmp_path):
    root = _cgroup(tmp_path, v2="100000 100000\n")
    affinity = len(os.sched_getaffinity(0))
    fake = _Torch(max(2, affinity))
    assert cap_torch_threads(fake, environ={}, root=root) == 1 and fake.threads == 1
    fake = _Torch(max(2, affinity))
    assert cap_torch_threads(fake, environ={"OMP_NUM_THREADS": "2"}, root=root) == fake.threads
    (tmp_path / "none").mkdir()
    unlimited = _cgroup(tmp_path / "none", v2="max 100000\n")
    fake = _Torch(affinity)
    assert cap_torch_threads(fake, environ={}, root=unlimited) == affinity


def test_a_core_taken_by_another_process_costs_a_thread_and_an_idle_core_gives_it_back():
    # two threads that busy-wait use two cores alone: nothing changes
    assert next_threads(2, 2, used_cores=1.97, idle_cores=0.02) == 2
    # a neighbour at nice 0 holds a core: ours get 1.33 of the 2, none idles
    assert next_threads(2, 2, used_cores=1.33, idle_cores=0.01) == 1
    # one thread beside it: stays
    assert next_threads(1, 2, used_cores=1.0, idle_cores=0.02) == 1
    # the neighbour is gone: a core idles, the thread comes back, up to the cap only
    assert next_threads(1, 2, used_cores=1.0, idle_cores=0.95) == 2
    assert next_threads(2, 2, used_cores=1.0, idle_cores=0.95) == 2
    # our own threads idle (Python between kernels) while a core idles too: not taken
    assert next_threads(2, 2, used_cores=1.2, idle_cores=0.8) == 2


def test_the_governor_reads_only_busy_intervals_and_sets_torch_on_its_own_thread():
    fake, now, cpu, idle = _Torch(2), [0.0], [0.0], [0.0]
    governor = ThreadGovernor(fake, 2, clock=lambda: now[0], cpu_clock=lambda: cpu[0],
                              idle=lambda: idle[0])

    def interval(busy_s: float, used: float, idle_cores: float) -> None:
        now[0] += 0.6
        cpu[0] += used * 0.6
        idle[0] += idle_cores * 0.6
        governor.after_step(busy_s)

    interval(0.1, 1.3, 0.0)  # mostly idle engine: its readings say nothing
    assert fake.threads == 2
    interval(0.55, 1.3, 0.0)
    assert (governor.threads, fake.threads) == (1, 1)
    interval(0.55, 1.0, 0.9)
    assert (governor.threads, fake.threads) == (2, 2)


def test_no_governor_off_the_cpu_with_omp_num_threads_or_under_ranks():
    class Config:
        tensor_parallel_size, pipeline_parallel_size = 1, 1

    assert ThreadGovernor.for_engine(_Torch(2), "cuda", Config(), environ={}) is None
    assert ThreadGovernor.for_engine(_Torch(2), "cpu", Config(),
                                     environ={"OMP_NUM_THREADS": "2"}) is None
    assert ThreadGovernor.for_engine(_Torch(1), "cpu", Config(), environ={}) is None
    Config.pipeline_parallel_size = 2
    assert ThreadGovernor.for_engine(_Torch(2), "cpu", Config(), environ={}) is None
    Config.pipeline_parallel_size = 1
    assert ThreadGovernor.for_engine(_Torch(2), "cpu", Config(), environ={}).threads == 2


def test_idle_seconds_sums_the_affinitys_cpus(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 900 100 0 0 0 0 0\n"
                    "cpu0 5 0 5 400 50 0 0 0 0 0\n"
                    "cpu1 5 0 5 500 50 0 0 0 0 0\n")
    from kvledger.engine.core.cpu_threads import TICKS_PER_S

    assert idle_seconds({1}, stat) == 550 / TICKS_PER_S
    assert idle_seconds({0, 1}, stat) == 1000 / TICKS_PER_S
    assert idle_seconds({0}, tmp_path / "missing") is None
