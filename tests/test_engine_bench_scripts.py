"""The benchmark scripts run unchanged where they cannot measure: one-line exit 2."""

from __future__ import annotations

import json
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


def test_scale_sim_runs_every_policy_on_one_trace():
    """bench/scale_sim.py on a tiny overloaded trace: the counts add up, the fixed policies
    cost exactly their replicas, and both autoscalers scale up."""
    command = [sys.executable, str(ROOT / "bench" / "scale_sim.py"), "--minutes", "3",
               "--rate", "3", "--replicas", "1", "--max-replicas", "3", "--startup-s", "20",
               "--used-target", "0.3", "--seed", "1"]
    result = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    rows = {row["policy"]: row for row in report["policies"]}
    assert len(rows) == 4
    for row in rows.values():
        assert row["arrived"] == report["requests"] > 0
        assert row["completed"] + row["gave_up"] + row["unfinished"] == row["arrived"]
        assert row["completed"] > 0 and row["rejected_429"] > 0 and row["unfinished"] >= 0
        assert 0 < row["p50_latency_s"] <= row["p99_latency_s"]
        assert 0 <= row["mean_used_ratio"] <= row["mean_reserved_ratio"] <= 1
    for name in ("fixed, round-robin", "fixed, least-reserved"):
        assert rows[name]["replica_minutes"] == pytest.approx(3.0)
        assert rows[name]["first_scale_up_s"] is None
    for name in ("HPA on reserved ratio", "HPA on KV used ratio"):
        assert rows[name]["peak_replicas"] > 1 and rows[name]["first_scale_up_s"] is not None
        assert rows[name]["completed"] > rows["fixed, least-reserved"]["completed"]
    table = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr[-3000:]
    assert "| policy | completed |" in table.stdout
    assert all(f"| {name} |" in table.stdout for name in rows)


def test_prefix_bench_runs_every_system_on_a_tiny_workload():
    """bench/prefix.py with tiny parameters: each workload on each of its systems, the cache
    skipping at least the shared system prompt's blocks, and the table from the report."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import prefix
    finally:
        sys.path.remove(str(ROOT / "bench"))
    command = [sys.executable, str(ROOT / "bench" / "prefix.py"), "--model", "tiny-llama",
               "--requests", "3", "--concurrency", "2", "--output-tokens", "4",
               "--system-prompt-tokens", "32", "--turns", "2", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    rows = {(r["workload"], r["system"]): r for r in report["rows"]}
    everyone = (prefix.CACHE_ON, prefix.CACHE_OFF, prefix.TRANSFORMERS)
    assert set(rows) == ({(w, s) for w in (prefix.SHARED, prefix.MULTI_TURN) for s in everyone}
                         | {(prefix.NO_SHARED, s) for s in everyone[:2]})
    for r in rows.values():
        assert r["requests"] > 0 and 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert r["output_tokens_per_cpu_s"] > 0 and r["admitted_at_once"] >= 1
    for workload in (prefix.SHARED, prefix.MULTI_TURN, prefix.NO_SHARED):
        off = rows[workload, prefix.CACHE_OFF]
        assert off["prefill_tokens_computed"] == off["prompt_tokens"]
    on = rows[prefix.SHARED, prefix.CACHE_ON]
    assert on["prefill_tokens_computed"] <= on["prompt_tokens"] - 3 * 32
    turns = rows[prefix.MULTI_TURN, prefix.CACHE_ON]
    assert turns["prefill_tokens_computed"] < turns["prompt_tokens"]
    assert rows[prefix.SHARED, prefix.TRANSFORMERS]["prefill_tokens_computed"] is None
    assert report["transformers_prefix_sharing"] is True
    assert len(report["targets"]) == 3 and report["targets"][1]["met"] is True
    table = prefix.markdown(report["rows"], report["targets"])
    assert f"| {prefix.SHARED} | {prefix.TRANSFORMERS} | 3 |" in table and "not exposed" in table
