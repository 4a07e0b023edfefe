"""Helpers for the hub tests: run kvledger as a pod would (its own HF_HOME and
HF_ENDPOINT, no token of this machine), and point this process's huggingface_hub at
tests/hub_server.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def hub_env(endpoint: str, home: Path, **extra: str) -> dict[str, str]:
    """The environment of a pod's container: no token or hub setting of this machine."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HF_") and k != "TRANSFORMERS_OFFLINE"}
    return env | {"HF_ENDPOINT": endpoint, "HF_HOME": str(home)} | extra


def point_hub_at(monkeypatch, endpoint: str, tmp_path: Path) -> None:
    """In this process: huggingface_hub talks to ``endpoint`` (it read HF_ENDPOINT at
    import), online, with no token of this machine."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)


def kvledger(env: dict[str, str], *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvledger.engine.cli", *argv], env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert not result.stdout and "Traceback" not in result.stderr
    return lines[0]


def run_with_peak(argv: list[str], env: dict[str, str], timeout: float = 120,
                  ) -> tuple[subprocess.CompletedProcess, float]:
    """``argv`` run to its end, and its peak resident memory in MiB: VmHWM of its own
    image, read from /proc until it exits (``wait4``'s ru_maxrss would count the memory
    of the process that started it, which a child holds until it execs)."""
    import threading
    import time

    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    peak = [0.0]

    def sample() -> None:
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            peak[0] = max(peak[0], int(line.split()[1]) / 1024)
            except OSError:
                return
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate(timeout=timeout)
    sampler.join()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), peak[0]
