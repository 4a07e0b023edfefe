"""torch's CPU threads are capped at a pod's CPU limit (a CFS quota torch does not see)."""

from __future__ import annotations

import os

import pytest

from kvledger.engine.core.cpu_threads import cap_torch_threads, cgroup_cpu_limit, cpu_threads


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
