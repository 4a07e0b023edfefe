"""The platform seam: what-if flags, NVML (a fake pynvml), host memory and cgroup limits."""

from __future__ import annotations

import sys
import types

import pytest

from kvledger.engine.errors import BadInput
from kvledger.engine.planner import device as device_mod
from kvledger.engine.planner.device import probe_device, probe_host, probe_nvml
from kvledger.engine.settings.config import EngineConfig

GiB = 2**30


def config(**flags) -> EngineConfig:
    return EngineConfig(model="/unused", **flags)


def test_what_if_flags_win() -> None:
    d = probe_device(config(device_memory_bytes=80 * GiB, device_free_bytes=70 * GiB,
                            unified_memory=True, device="cuda"))
    assert (d.kind, d.total_bytes, d.free_bytes, d.unified) == ("what-if", 80 * GiB, 70 * GiB, True)
    assert probe_device(config(device_memory_bytes=GiB)).free_bytes == GiB


def fake_fs(tmp_path, meminfo_kb=(16 * 2**20, 12 * 2**20), cgroup_line="0::/pod",
            files: dict[str, str] | None = None):
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {meminfo_kb[0]} kB\nMemFree: 1 kB\n"
                                  f"MemAvailable: {meminfo_kb[1]} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    for rel, text in (files or {}).items():
        path = cgroup / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc, cgroup


def test_host_memory_without_cgroup_limit(tmp_path) -> None:
    proc, cgroup = fake_fs(tmp_path, files={"pod/memory.max": "max\n"})
    d = probe_host(proc, cgroup)
    assert (d.kind, d.total_bytes, d.free_bytes, d.unified) == ("cpu", 16 * GiB, 12 * GiB, False)


def test_cgroup_v2_limit_caps_host_memory(tmp_path) -> None:
    proc, cgroup = fake_fs(tmp_path, files={"pod/memory.max": str(4 * GiB),
                                            "pod/memory.current": str(GiB)})
    d = probe_host(proc, cgroup)
    assert (d.total_bytes, d.free_bytes) == (4 * GiB, 3 * GiB)
    assert "cgroup" in d.name


def test_cgroup_v1_limit_caps_host_memory(tmp_path) -> None:
    proc, cgroup = fake_fs(tmp_path, cgroup_line="4:memory:/kubepods/pod1",
                           files={"memory/kubepods/pod1/memory.limit_in_bytes": str(2 * GiB),
                                  "memory/kubepods/pod1/memory.usage_in_bytes": str(GiB // 2)})
    d = probe_host(proc, cgroup)
    assert (d.total_bytes, d.free_bytes) == (2 * GiB, GiB + GiB // 2)


def test_cgroup_v1_unlimited_is_ignored(tmp_path) -> None:
    proc, cgroup = fake_fs(tmp_path, cgroup_line="4:memory:/",
                           files={"memory/memory.limit_in_bytes": "9223372036854771712"})
    assert probe_host(proc, cgroup).total_bytes == 16 * GiB


def test_unreadable_meminfo_without_limit_is_bad_input(tmp_path) -> None:
    with pytest.raises(BadInput, match="--device-memory"):
        probe_host(tmp_path / "none", tmp_path / "none")


def test_a_container_limit_reads_host_memory_as_the_pods_cgroup_would(tmp_path) -> None:
    """`kvledger run` has no pod cgroup: --container-memory-limit gives the same numbers
    as a cgroup whose only process is this one (usage = its resident memory)."""
    pod_proc, pod_cgroup = fake_fs(tmp_path / "pod", files={
        "pod/memory.max": str(4 * GiB), "pod/memory.current": str(300 * 2**20)})
    in_pod = probe_host(pod_proc, pod_cgroup)
    proc, cgroup = fake_fs(tmp_path / "laptop", files={"pod/memory.max": "max\n"})
    (proc / "self" / "status").write_text(f"Name:\tkvledger\nVmRSS:\t{300 * 1024} kB\n")
    local = probe_host(proc, cgroup, container_limit_bytes=4 * GiB)
    assert (local.total_bytes, local.free_bytes) == (in_pod.total_bytes, in_pod.free_bytes)
    assert (local.total_bytes, local.free_bytes) == (4 * GiB, 4 * GiB - 300 * 2**20)
    assert local.name == "host memory (container limit)" and local.kind == "cpu"
    # Above the host's memory it changes nothing; the smaller of two limits wins.
    assert probe_host(proc, cgroup, container_limit_bytes=64 * GiB).total_bytes == 16 * GiB
    both = probe_host(pod_proc, pod_cgroup, container_limit_bytes=2 * GiB)
    assert (both.total_bytes, both.free_bytes) == (2 * GiB, 2 * GiB)  # no VmRSS in that fake
    smaller_cgroup = probe_host(pod_proc, pod_cgroup, container_limit_bytes=8 * GiB)
    assert smaller_cgroup == in_pod


def test_the_container_limit_flag_reaches_the_probe() -> None:
    d = probe_device(config(device="cpu", container_memory_limit_bytes=64 * 2**20))
    assert d.total_bytes == 64 * 2**20 and d.free_bytes < 64 * 2**20  # less our own memory
    assert d.name == "host memory (container limit)"
    # The what-if flags still win: they describe another device entirely.
    assert probe_device(config(device_memory_bytes=GiB,
                               container_memory_limit_bytes=2**20)).total_bytes == GiB


def test_this_machine_has_host_memory() -> None:
    d = probe_device(config(device="cpu"))
    assert d.kind == "cpu" and 0 < d.free_bytes <= d.total_bytes
    assert probe_device(config(device="cpu", unified_memory=True)).unified


class FakeNVMLError(Exception):
    pass


def fake_pynvml(monkeypatch, *, count=1, memory=(80 * GiB, 75 * GiB), mode=0, init_fails=False,
                capability=None):
    calls: dict[str, object] = {}
    m = types.ModuleType("pynvml")
    m.NVMLError = FakeNVMLError
    m.NVML_DEVICE_ADDRESSING_MODE_HMM = 1
    m.NVML_DEVICE_ADDRESSING_MODE_ATS = 2

    def init():
        if init_fails:
            raise FakeNVMLError("driver not loaded")

    def memory_info(handle):
        if memory is None:
            raise FakeNVMLError("not supported")
        return types.SimpleNamespace(total=memory[0], free=memory[1], used=0)

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: count
    m.nvmlDeviceGetHandleByIndex = lambda i: calls.setdefault("index", i)
    m.nvmlDeviceGetHandleByUUID = lambda u: calls.setdefault("uuid", u)
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    m.nvmlDeviceGetMemoryInfo = memory_info
    m.nvmlDeviceGetAddressingMode = lambda h: mode
    if capability is not None:
        m.nvmlDeviceGetCudaComputeCapability = lambda h: capability
    monkeypatch.setitem(sys.modules, "pynvml", m)
    return calls


def test_nvml_discrete_gpu(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    calls = fake_pynvml(monkeypatch, mode=1)  # HMM on a discrete card: still dedicated memory
    d = probe_device(config(device="cuda"))
    assert (d.kind, d.name, d.total_bytes, d.free_bytes, d.unified) == (
        "cuda", "NVIDIA H100 80GB HBM3", 80 * GiB, 75 * GiB, False)
    assert calls["index"] == 0


def test_nvml_ats_addressing_is_unified(monkeypatch) -> None:
    fake_pynvml(monkeypatch, mode=2)
    assert probe_nvml().unified


def test_nvml_without_dedicated_memory_uses_host_memory_as_unified_pool(monkeypatch) -> None:
    fake_pynvml(monkeypatch, memory=None)
    host = device_mod.probe_host()
    d = probe_nvml()
    assert d.unified and d.total_bytes == host.total_bytes and d.kind == "cuda"


def test_a_unified_pool_read_from_host_memory_honours_the_container_limit(monkeypatch) -> None:
    fake_pynvml(monkeypatch, memory=None)
    d = probe_device(config(device="cuda", container_memory_limit_bytes=GiB))
    assert d.unified and d.kind == "cuda" and d.total_bytes == GiB


def test_cuda_visible_devices_picks_the_handle(monkeypatch) -> None:
    calls = fake_pynvml(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234,GPU-5678")
    probe_nvml()
    assert calls["uuid"] == "GPU-1234"
    calls = fake_pynvml(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    probe_nvml()
    assert calls["index"] == 3


def test_no_gpu_auto_falls_back_to_host_and_cuda_is_bad_input(monkeypatch) -> None:
    fake_pynvml(monkeypatch, init_fails=True)
    assert probe_device(config(device="auto")).kind == "cpu"
    with pytest.raises(BadInput, match="no NVIDIA GPU"):
        probe_device(config(device="cuda"))
    fake_pynvml(monkeypatch, count=0)
    assert probe_nvml() is None


@pytest.mark.parametrize(("capability", "bfloat16"), [((9, 0), True), ((8, 0), True),
                                                      ((7, 5), False), ((7, 0), False),
                                                      (None, True)])
def test_nvml_says_whether_the_card_computes_in_bfloat16(monkeypatch, capability,
                                                         bfloat16) -> None:
    """Compute capability 8.0 on (torch's is_bf16_supported); a pynvml that cannot say is
    taken to, as a what-if card is. It decides --dtype auto's half precision."""
    fake_pynvml(monkeypatch, capability=capability)
    assert probe_nvml().bfloat16 is bfloat16
    assert probe_device(config(device="cuda", unified_memory=True)).bfloat16 is bfloat16
    assert probe_device(config(device_memory_bytes=GiB)).bfloat16
