"""The chart's values: values.schema.json refuses unknown keys, wrong types and enums with
a message naming the value, the monitors are off by default and never both on, and the
Grafana dashboard's ConfigMap carries dashboards/kvledger.json. Runs ``helm template``
(scripts/helm_check.sh installs helm into .tools/; skipped where there is no helm)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[2]
CHART = ROOT / "charts" / "kvledger"
HELM = next((str(p) for p in (ROOT / ".tools" / "bin" / "helm", shutil.which("helm"))
             if p and Path(p).is_file()), None)
pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed "
                                "(bash scripts/helm_check.sh installs it into .tools/)")


def helm_template(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([HELM, "template", "kvledger", str(CHART), "--namespace",
                           "kvledger-system", *flags], capture_output=True, text=True,
                          timeout=60)


def kinds(*flags: str) -> dict[str, list[dict]]:
    done = helm_template(*flags)
    assert done.returncode == 0, done.stderr
    by_kind: dict[str, list[dict]] = {}
    for doc in yaml.safe_load_all(done.stdout):
        if doc:
            by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def test_the_defaults_render_without_monitors_or_dashboard():
    rendered = kinds()
    assert {"Deployment", "ServiceAccount", "ClusterRole"} <= set(rendered)
    assert not {"PodMonitor", "ServiceMonitor", "ConfigMap"} & set(rendered)


@pytest.mark.parametrize(("flag", "named"), [
    ("imag.repository=ghcr.io/x/y", "additional properties 'imag' not allowed"),
    ("watchNamespace=team-a", "additional properties 'watchNamespace' not allowed"),
    ("watchNamespaces=", "'/watchNamespaces': got string, want array"),
    ("logFormat=yaml", "'/logFormat': value must be one of 'json', 'text', 'full'"),
    ("verbose=yes", "'/verbose': got string, want boolean"),
    ("image.pullPolicy=Sometimes", "'/image/pullPolicy': value must be one of"),
    ("metrics.podMonitor.enabeld=true", "'/metrics/podMonitor': additional properties "
                                        "'enabeld' not allowed"),
    ("metrics.serviceMonitor.interval=15", "'/metrics/serviceMonitor/interval': got number"),
    ("metrics.grafanaDashboard.labels.grafana_dashboard=1",
     "'/metrics/grafanaDashboard/labels/grafana_dashboard': got number, want string"),
    ("policy.controlPlan=true", "'/policy': additional properties 'controlPlan' not allowed"),
])
def test_a_bad_value_fails_naming_it(flag, named):
    done = helm_template("--set", flag)
    assert done.returncode != 0
    assert named in done.stderr, done.stderr


def test_both_monitors_at_once_are_refused():
    done = helm_template("--set", "metrics.podMonitor.enabled=true",
                         "--set", "metrics.serviceMonitor.enabled=true")
    assert done.returncode != 0
    assert "metrics.podMonitor.enabled and metrics.serviceMonitor.enabled are both true" \
        in done.stderr, done.stderr


@pytest.mark.parametrize("monitor", ["PodMonitor", "ServiceMonitor"])
def test_either_monitor_alone_renders(monitor):
    key = monitor[0].lower() + monitor[1:]
    rendered = kinds("--set", f"metrics.{key}.enabled=true")
    assert len(rendered[monitor]) == 1
    assert not {"PodMonitor", "ServiceMonitor"} - {monitor} & set(rendered)


def test_the_dashboard_configmap_carries_the_dashboard():
    rendered = kinds("--set", "metrics.grafanaDashboard.enabled=true",
                     "--set", "metrics.grafanaDashboard.namespace=monitoring",
                     "--set", "metrics.grafanaDashboard.annotations.grafana_folder=LLM")
    [config_map] = rendered["ConfigMap"]
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    shipped = json.loads((CHART / "dashboards" / "kvledger.json").read_text())
    assert json.loads(config_map["data"]["kvledger.json"]) == shipped
