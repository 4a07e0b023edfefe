"""Helpers of the container end-to-end run: podman calls, the build flags for this
machine's pip, and the figures the run measures (printed by conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASE_IMAGE = "localhost/kvledger-base:bookworm"
TEST_IMAGE = "localhost/kvledger:e2e"
# Replaces the system's containers.conf for every podman call made here.
CONTAINERS_CONF = os.environ.get("CONTAINERS_CONF", str(REPO / "scripts" / "containers.conf"))

# name -> seconds or bytes, printed at the end of the run (docs/operator.md's figures).
MEASURED: dict[str, float] = {}
SESSION_START = time.monotonic()


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check,
                          timeout=timeout, env={**os.environ, "CONTAINERS_CONF": CONTAINERS_CONF})


def require_podman() -> None:
    skip = os.environ.get("KVLEDGER_SKIP_CONTAINER_E2E") == "1"
    problem = None
    if shutil.which("podman") is None:
        problem = "podman is not installed (scripts/install_podman.sh installs it)"
    else:
        info = podman("info", check=False)
        if info.returncode != 0:
            problem = f"podman cannot run: {(info.stderr.strip().splitlines() or ['?'])[-1]}"
    if problem:
        if skip:
            pytest.skip(f"{problem}; KVLEDGER_SKIP_CONTAINER_E2E=1")
        pytest.fail(f"container end-to-end: {problem} (set KVLEDGER_SKIP_CONTAINER_E2E=1 to "
                    "skip it locally)", pytrace=False)


def _pip_setting(key: str) -> list[str]:
    """Values of a pip setting (``cert``, ``find-links``) from this machine's pip config."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                         capture_output=True, text=True, check=False).stdout
    values: list[str] = []
    for line in out.splitlines():
        name, _, value = line.partition("=")
        if name.endswith("." + key):
            values += [v for v in value.strip("'\"").split() if v not in values]
    return values


def local_build_flags() -> list[str]:
    """Engine flags that let the build's pip use this machine's CA bundle and wheel folder
    (a registry's TLS may be signed by a local CA; the pinned CPU torch lies on disk)."""
    flags: list[str] = []
    certs = _pip_setting("cert") or ["/etc/ssl/certs/ca-certificates.crt"]
    if Path(certs[0]).is_file():
        flags += ["--volume", f"{certs[0]}:/run/host-ca.crt:ro",
                  "--build-arg", "PIP_CERT=/run/host-ca.crt"]
    links = [d for d in _pip_setting("find-links") if Path(d).is_dir()]
    for folder in links:
        flags += ["--volume", f"{folder}:{folder}:ro"]
    if links:
        flags += ["--build-arg", "PIP_FIND_LINKS=" + " ".join(links)]
    return flags


