"""The container end-to-end run: podman, the project's image, the measurements it prints.

Run by ``.ci/run`` as its own step (``pytest -m container tests/e2e``); the plain test
run deselects it. Without a working podman it fails with one clear message, unless
``KVLEDGER_SKIP_CONTAINER_E2E=1`` says to skip it (for a laptop without podman).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from container_harness import (
    BASE_IMAGE,
    CONTAINERS_CONF,
    MEASURED,
    REPO,
    SESSION_START,
    TEST_IMAGE,
    local_build_flags,
    podman,
    require_podman,
)

from kvledger.engine.model.builtin import write_model


@pytest.fixture(scope="session")
def image() -> Iterator[str]:
    """The project's image, built with ``make image`` from a Debian base made locally."""
    require_podman()
    started = time.monotonic()
    subprocess.run(["bash", str(REPO / "scripts" / "container_base.sh"), BASE_IMAGE],
                   check=True, env={**os.environ, "CONTAINERS_CONF": CONTAINERS_CONF},
                   timeout=600)
    MEASURED["base image ready (s)"] = time.monotonic() - started
    started = time.monotonic()
    build = subprocess.run(
        ["make", "-C", str(REPO), "image", f"IMAGE={TEST_IMAGE}", f"BASE={BASE_IMAGE}",
         "CONTAINER_ENGINE=podman", "IMAGE_BUILD_FLAGS=" + " ".join(local_build_flags())],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "CONTAINERS_CONF": CONTAINERS_CONF})
    if build.returncode != 0:
        pytest.fail(f"make image failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}",
                    pytrace=False)
    MEASURED["image build (s)"] = time.monotonic() - started
    size = podman("image", "inspect", TEST_IMAGE, "--format", "{{.Size}}").stdout.strip()
    MEASURED["image size (MB)"] = int(size) / 1e6
    yield TEST_IMAGE


@pytest.fixture(scope="module")
def models() -> Iterator[Path]:
    """A hostPath folder the pod's uid 1000 can read (pytest's own tmp is 0700)."""
    root = Path(tempfile.mkdtemp(prefix="kvledger-e2e-"))
    root.chmod(0o755)
    write_model("tiny-llama", root / "tiny-llama")
    yield root
    for path in sorted(root.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    root.rmdir()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if MEASURED:
        MEASURED["whole e2e run (s)"] = time.monotonic() - SESSION_START
        terminalreporter.section("container end-to-end: measured")
        for name, value in MEASURED.items():
            terminalreporter.write_line(f"{name:<36} {value:9.1f}")
