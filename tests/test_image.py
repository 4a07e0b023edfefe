"""The image's name and shape agree everywhere they are written down.

The image itself is built and run by the container end-to-end (tests/e2e); these checks
are static and fast: the chart, the operator's default engine image and ``make image``
name the same image, and the Dockerfile runs as the rendered pods' uid.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from importlib.metadata import version
from pathlib import Path

import yaml
from spec_helpers import spec_of

from kvledger.operator.render import render

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "kvledger"


def _project_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_chart_operator_and_make_name_the_same_image() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == _project_version() == version("kvledger")
    assert values["image"]["repository"] == render.IMAGE_REPOSITORY
    assert values["image"]["tag"] == ""  # the chart's appVersion
    assert f"{render.IMAGE_REPOSITORY}:{chart['appVersion']}" == render.DEFAULT_IMAGE
    dry_run = subprocess.run(["make", "-n", "-C", str(REPO), "image", "CONTAINER_ENGINE=podman"],
                             capture_output=True, text=True, check=True).stdout
    assert f"-t {render.DEFAULT_IMAGE} " in dry_run
    assert f"--build-arg VERSION={_project_version()}" in dry_run


def test_dockerfile_runs_kvledger_as_the_pods_uid() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    instructions = [line.split(None, 1) for line in dockerfile.splitlines()
                    if line and not line[0].isspace() and not line.startswith("#")]
    final_stage = instructions[max(i for i, ins in enumerate(instructions) if ins[0] == "FROM"):]
    keys = {ins[0]: ins[1] for ins in final_stage}
    assert keys["USER"] == f"{render.RUN_AS_USER}:{render.RUN_AS_USER}"
    assert keys["ENTRYPOINT"] == '["kvledger"]'
    assert re.search(r"^ARG BASE=\S+", dockerfile, re.M)
    # Homes and caches live under /tmp, the writable emptyDir of a read-only root.
    tmp_mounts = [m["mountPath"] for m in render.render_pod_spec(
        spec_of({"model": {"path": "/m"}, "gpus": 0}))["containers"][0]["volumeMounts"]]
    assert "/tmp" in tmp_mounts
    for env in ("HOME=/tmp", "XDG_CACHE_HOME=/tmp/", "HF_HOME=/tmp/"):
        assert env in dockerfile


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".tools", "tests", "bench"} <= ignored
    copied = re.findall(r"^COPY (?!--from)(.+) /src/", (REPO / "Dockerfile").read_text(), re.M)
    for sources in copied:
        for source in sources.split():
            assert (REPO / source).exists() and source not in ignored
