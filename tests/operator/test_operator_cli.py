"""``kvledger operator`` as a real process against the emulator: namespace scope, JSON logs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest
from operator_harness import emulated_cluster, eventually, service_manifest

from kvledger.operator.api.resource import API_VERSION, PLURAL

pytestmark = [pytest.mark.timeout(90),
              pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")]


async def test_operator_process_watches_only_its_namespace_and_logs_json():
    async with emulated_cluster() as cluster:
        env = {**os.environ, "KUBECONFIG": cluster.kubeconfig,
               "KVLEDGER_ENGINE_IMAGE": "registry.local/kvledger:7"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvledger.engine.cli", "operator",
            "--namespace", "team-a", "--log-format", "json",
            env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            await cluster.create(API_VERSION, PLURAL, service_manifest("mine", "team-a"))
            await cluster.create(API_VERSION, PLURAL, service_manifest("theirs", "team-b"))
            deployment = await eventually(
                lambda: cluster.stored("apps/v1", "deployments", "team-a", "mine"),
                timeout_s=30, what="deployment in the watched namespace")
            image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
            assert image == "registry.local/kvledger:7"
            await asyncio.sleep(1.0)  # time enough for a wrongly cluster-wide operator to act
            assert cluster.stored("apps/v1", "deployments", "team-b", "theirs") is None
        finally:
            proc.send_signal(signal.SIGTERM)
            output, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
        assert proc.returncode == 0, output.decode()[-2000:]
        records = [json.loads(line) for line in output.decode().splitlines() if line.strip()]
        assert records, "the operator logged nothing"
        assert all("message" in r for r in records)
        assert any(r.get("object", {}).get("name") == "mine" for r in records)


@pytest.mark.parametrize(("kubeconfig", "expected"), [
    (None, "error: no Kubernetes credentials: not in a pod, and no $KUBECONFIG or ~/.kube/config"),
    ("missing", "error: cannot read the Kubernetes credentials: [Errno 2] No such file"),
    ("garbage", "error: cannot read the Kubernetes credentials: "),
    ("no-context", "error: cannot read the Kubernetes credentials: Current context is not set"),
])
def test_no_cluster_is_one_line_and_exit_2(kubeconfig, expected, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env["HOME"] = str(tmp_path)  # no ~/.kube/config there
    if kubeconfig == "missing":
        env["KUBECONFIG"] = str(tmp_path / "absent")
    elif kubeconfig == "garbage":
        (tmp_path / "kubeconfig").write_text("clusters: [")
        env["KUBECONFIG"] = str(tmp_path / "kubeconfig")
    elif kubeconfig == "no-context":  # valid YAML, but no current-context to log in with
        (tmp_path / "kubeconfig").write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
        env["KUBECONFIG"] = str(tmp_path / "kubeconfig")
    done = subprocess.run([sys.executable, "-m", "kvledger.engine.cli", "operator"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.startswith(expected) and done.stderr.count("\n") == 1, done.stderr


def test_a_bad_policy_stops_the_operator_with_one_line(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "KVLEDGER_POLICY": '{"hostPaths": ["srv"]}'}
    result = subprocess.run([sys.executable, "-m", "kvledger.engine.cli", "operator"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: KVLEDGER_POLICY: hostPaths must be absolute "
                                     "folders")


@pytest.mark.parametrize("log_format", ["text", "full", "json"])
def test_text_log_lines_name_their_resource(log_format, monkeypatch):
    """kopf's own choice of prefix, as `kopf run` makes it: a text line begins with
    "[NS/NAME]", a JSON line carries the resource as fields."""
    import argparse
    import logging

    import kopf

    from kvledger.operator import main as operator_main

    asked: dict = {}

    class Stop(Exception):
        pass

    def configure(**kw):
        asked.update(kw)
        raise Stop

    monkeypatch.setattr(kopf, "configure", configure)
    parser = argparse.ArgumentParser()
    operator_main.add_arguments(parser)
    with pytest.raises(Stop):
        operator_main.main(parser.parse_args(["--log-format", log_format]))
    formatter = kopf._core.actions.loggers.make_formatter(
        log_format=asked["log_format"], log_prefix=asked["log_prefix"], log_refkey=None)
    record = logging.LogRecord("kopf.objects", logging.INFO, __file__, 1, "applied", None, None)
    record.k8s_ref = {"namespace": "team-a", "name": "llama"}  # what kopf's object logger sets
    record.k8s_skip = False
    line = formatter.format(record)
    if log_format == "json":
        assert json.loads(line)["message"] == "applied"
    else:
        assert "[team-a/llama] applied" in line
