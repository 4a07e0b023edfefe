"""The benchmark scripts run unchanged where they cannot measure: one-line exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check runs")
def test_gpu_memory_check_without_a_gpu_exits_2_with_one_line():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_memory_check.py")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: gpu_memory_check needs a CUDA device")
    assert len(result.stderr.strip().splitlines()) == 1 and not result.stdout


def test_throughput_workload_is_the_same_every_run():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from throughput import workload
    finally:
        sys.path.remove(str(ROOT / "bench"))
    prompts, output_lens = workload(64, 1024)
    assert (prompts, output_lens) == workload(64, 1024)
    assert set(output_lens) == {16, 32, 64, 128, 256}
    assert all(16 <= len(p) <= 128 for p in prompts)


def test_a_short_soak_passes_against_a_real_server():
    """bench/soak.py for a few seconds: injected faults fail only their own requests (500 or
    an SSE error event + [DONE]), nothing leaks, /health answers throughout."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--duration", "8",
                             "--clients", "6"], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "soak passed" in result.stdout
    assert "| fault | 500 |" in result.stdout or "| fault | stream-error |" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check runs")
def test_gpu_oom_check_without_a_gpu_exits_2_with_one_line():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_oom_check.py")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: gpu_oom_check needs a CUDA device")
    assert len(result.stderr.strip().splitlines()) == 1 and not result.stdout
