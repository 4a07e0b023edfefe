"""The Helm chart (charts/kvledger) rendered with ``helm template``, for tests/operator/
(the chart's own tests, and those of what it installs). ``HELM`` is None where no helm is
installed (scripts/helm_check.sh installs it into .tools/): a test module skips then."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvledger"
HELM = next((str(p) for p in (ROOT / ".tools" / "bin" / "helm", shutil.which("helm"))
             if p and Path(p).is_file()), None)


def helm_template(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([HELM, "template", "kvledger", str(CHART), "--namespace",
                           "kvledger-system", *flags], capture_output=True, text=True,
                          timeout=60)


def by_kind(done: subprocess.CompletedProcess) -> dict[str, list[dict]]:
    """A successful ``helm template``'s objects by kind."""
    assert done.returncode == 0, done.stderr
    by_kind: dict[str, list[dict]] = {}
    for doc in yaml.safe_load_all(done.stdout):
        if doc:
            by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind
