"""Play the kubelet for one pod: run the rendered ``preflight`` container for real.

The operator renders the Deployment on the emulator; this test takes the init container's
command and arguments from it, maps its volume mounts to local folders the way a kubelet
would (hostPath -> the host folder, emptyDir -> a scratch folder, the termination
message path -> a file), runs it as a local process against a built-in model with a limit
that does not fit, and writes the exit code and termination message into the pod's status.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import pytest_asyncio
from operator_harness import (
    NS,
    deploy_and_run_preflight,
    describe,
    eventually,
    running_operator,
)

from kvledger.engine.errors import EXIT_DOES_NOT_FIT
from kvledger.engine.planner.plan_line import PLAN_LINE_PREFIX, TERMINATION_LOG_MAX_BYTES
from kvledger.operator.api.resource import API_VERSION, PLURAL
from kvledger.operator.render.policy import Policy

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")]



@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster():
    # The models are written under the temporary folder, mounted as hostPath volumes: a
    # folder the admin allows (the operator's Helm value policy.hostPaths).
    policy = Policy(host_paths=(tempfile.gettempdir(),))
    async with running_operator(policy=policy) as running:
        yield running


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    subprocess.run([sys.executable, "-m", "kvledger.engine.cli", "make-model", "tiny-llama",
                    str(root / "tiny-llama")], check=True, capture_output=True)
    return root


async def test_kubelet_runs_the_rendered_preflight_and_describe_shows_why(cluster, model_root,
                                                                           tmp_path):
    _, terminated = await deploy_and_run_preflight(
        cluster, "kubelet-demo", model_root, tmp_path, memory={"limit": "64Mi"},
        engine={"maxModelLen": 1024})
    assert terminated["exitCode"] == EXIT_DOES_NOT_FIT, terminated["message"]
    assert terminated["message"].startswith("error: engine requires")
    assert len(terminated["message"].encode()) <= TERMINATION_LOG_MAX_BYTES
    # The report for people, then the plan's figures on one line for the operator.
    report, line = terminated["message"].rsplit(PLAN_LINE_PREFIX, 1)
    handed_over = json.loads((tmp_path / "plan" / "plan.json").read_text())  # the emptyDir's

    def refused():
        obj = cluster.stored(API_VERSION, PLURAL, NS, "kubelet-demo")
        reasons = {c["type"]: c.get("reason") for c in (obj.get("status") or {})
                   .get("conditions", [])}
        warned = [e for e in cluster.events_for("kubelet-demo") if e.get("type") == "Warning"]
        return (obj, warned) if reasons.get("MemoryBudget") == "DoesNotFit" and warned else None

    obj, [warning] = await eventually(refused, what="DoesNotFit condition and Warning event")
    assert warning["reason"] == "DoesNotFit"
    budget = next(c for c in obj["status"]["conditions"] if c["type"] == "MemoryBudget")
    assert budget["message"] == report.strip()
    plan = obj["status"]["plan"]
    assert plan["fits"] is False and plan["limit"] == "64.0 MiB"
    assert json.loads(line)["required_bytes"] == plan["requiredBytes"] \
        == handed_over["required_bytes"]
    assert (plan["limitBytes"], plan["shortByBytes"]) == (64 * 2**20,
                                                          handed_over["short_by_bytes"])
    assert plan["classes"]["kvCache"] == handed_over["classes"]["kv_cache"]
    assert plan["kv"]["numBlocks"] == handed_over["kv"]["num_blocks"]

    text = describe(obj, cluster.events_for("kubelet-demo"))
    first_line = terminated["message"].splitlines()[0]
    lines = text.splitlines()
    assert any(line.split()[:3] == ["MemoryBudget", "False", "DoesNotFit"] for line in lines)
    assert any(line.split()[:3] == ["Ready", "False", "DoesNotFit"] for line in lines)
    assert f"    {first_line}" in lines  # the breakdown, indented under the condition
    assert any(line.split()[:2] == ["Warning", "DoesNotFit"] and line.endswith(first_line)
               for line in lines)


async def test_kubelet_preflight_that_fits_fills_status_plan_with_exact_bytes(cluster, model_root,
                                                                               tmp_path):
    _, terminated = await deploy_and_run_preflight(
        cluster, "kubelet-fits", model_root, tmp_path, engine={"maxModelLen": 256})
    assert terminated["exitCode"] == 0, terminated["message"]
    handed_over = json.loads((tmp_path / "plan" / "plan.json").read_text())

    def approved():
        obj = cluster.stored(API_VERSION, PLURAL, NS, "kubelet-fits")
        plan = (obj.get("status") or {}).get("plan") or {}
        return plan if "requiredBytes" in plan else None

    plan = await eventually(approved, what="status.plan from the pre-flight's plan JSON")
    assert plan["fits"] is True
    assert plan["requiredBytes"] == handed_over["required_bytes"]
    assert plan["classes"]["kvCache"] == handed_over["classes"]["kv_cache"]
    assert plan["kv"]["numBlocks"] == handed_over["kv"]["num_blocks"]
