"""spec.nodes above 1, the real operator against kmock's emulator over HTTP: the
LeaderWorkerSet and what goes with it applied, the status read from the LeaderWorkerSet and
every pod of its groups, and nodes changed both ways."""

from __future__ import annotations

import base64
import re

import pytest
import pytest_asyncio
from operator_harness import condition, eventually, running_operator, service_manifest
from test_kmock import FITS, REFUSED, REPORT, plan_line, preflight_done

from kvledger.operator.api.resource import API_VERSION, PLURAL
from kvledger.operator.render.render import LABEL
from kvledger.operator.render.render_group import (
    GROUP_INDEX_LABEL,
    LWS_API_VERSION,
    LWS_NAME_LABEL,
    LWS_PLURAL,
    WORKER_INDEX_LABEL,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")]

NS = "default"
LWS = (LWS_API_VERSION, LWS_PLURAL)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster():
    async with running_operator(default_image="kvledger:test") as running:
        yield running


def group_pod(service: str, group: int, worker: int, status: dict) -> dict:
    name = f"{service}-{group}" + (f"-{worker}" if worker else "")
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {
                LABEL: service, LWS_NAME_LABEL: service, GROUP_INDEX_LABEL: str(group),
                WORKER_INDEX_LABEL: str(worker)}},
            "spec": {"containers": [{"name": "engine", "image": "kvledger:test"}]},
            "status": status}


def running(ready: bool, **extra) -> dict:
    return {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}],
            "containerStatuses": [{"name": "engine", "ready": ready, "restartCount": 0,
                                   "state": {"running": {}}}], **extra}


def key_secret_of(lws: dict) -> str:
    """The Secret every engine of a LeaderWorkerSet reads its group key from."""
    names = {var["valueFrom"]["secretKeyRef"]["name"]
             for template in ("leaderTemplate", "workerTemplate")
             for var in lws["spec"]["leaderWorkerTemplate"][template]["spec"]["containers"][0][
                 "env"] if var["name"] == "KVLEDGER_NODE_KEY"}
    [name] = names
    return name


def status_of(cluster, name: str) -> dict:
    return (cluster.stored(API_VERSION, PLURAL, NS, name) or {}).get("status") or {}


async def test_nodes_two_applies_a_leader_worker_set_its_key_service_and_policy(cluster):
    await cluster.create(API_VERSION, PLURAL, service_manifest("group", NS, gpus=2, nodes=2))
    lws = await eventually(lambda: cluster.stored(*LWS, NS, "group"), what="leaderworkerset")
    owner = cluster.stored(API_VERSION, PLURAL, NS, "group")
    [ref] = lws["metadata"]["ownerReferences"]
    assert ref["uid"] == owner["metadata"]["uid"] and ref["controller"] is True
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and lws["spec"]["replicas"] == 1
    args = template["workerTemplate"]["spec"]["containers"][0]["args"]
    assert args[-9:] == ["--nnodes", "2", "--node-rank", "$(LWS_WORKER_INDEX)", "--master-addr",
                         "$(LWS_LEADER_ADDRESS)", "--master-port", "29500", "--headless"]
    assert cluster.stored("apps/v1", "deployments", NS, "group") is None
    key_name = owner["status"]["nodeKeySecret"]
    assert key_name.startswith("group-nodes-") and key_secret_of(lws) == key_name
    secret = cluster.stored("v1", "secrets", NS, key_name)
    assert re.fullmatch(r"[0-9a-f]{64}", base64.b64decode(secret["data"]["key"]).decode())
    assert secret["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    service = await eventually(lambda: cluster.stored("v1", "services", NS, "group"))
    assert service["spec"]["selector"] == {LABEL: "group", WORKER_INDEX_LABEL: "0"}
    policy = await eventually(lambda: cluster.stored(
        "networking.k8s.io/v1", "networkpolicies", NS, "group"), what="networkpolicy")
    assert policy["spec"]["ingress"][0] == {"from": [{"podSelector": {"matchLabels": {
        LABEL: "group", LWS_NAME_LABEL: "group"}}}]}
    # A change re-renders the group; the key stays the one first written.
    await cluster.patch(API_VERSION, PLURAL, NS, "group", {"spec": {"replicas": 2}},
                        bump_generation=True)
    await eventually(lambda: cluster.stored(*LWS, NS, "group")["spec"]["replicas"] == 2,
                     what="two groups")
    assert len(cluster.history("v1", "secrets", NS, key_name)) == 1
    assert cluster.stored("v1", "secrets", NS, key_name)["data"] == secret["data"]
    assert len(cluster.all_stored("secrets")) == 1  # one key, made once


async def test_a_key_secret_made_beforehand_never_keys_the_group(cluster):
    """Someone who may create Secrets makes the group's key first, under the name the
    operator used to give it (NAME-nodes). The operator cannot read a Secret's owner, so
    it never takes one it did not create: the group's key is a Secret the API server
    named in the operator's own create, owned by the resource, and the attacker's is
    never referred to. Nothing is read from any Secret."""
    attacker = "f" * 64
    await cluster.create("v1", "secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "preset-nodes",
                                                           "namespace": NS},
        "data": {"key": base64.b64encode(attacker.encode()).decode()}})
    await cluster.create(API_VERSION, PLURAL, service_manifest("preset", NS, nodes=2))
    lws = await eventually(lambda: cluster.stored(*LWS, NS, "preset"), what="leaderworkerset")
    owner = cluster.stored(API_VERSION, PLURAL, NS, "preset")
    key_name = key_secret_of(lws)
    assert key_name != "preset-nodes" and key_name == owner["status"]["nodeKeySecret"]
    secret = cluster.stored("v1", "secrets", NS, key_name)
    assert base64.b64decode(secret["data"]["key"]).decode() != attacker
    assert secret["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    assert not [asked for asked in cluster.emulator.asked
                if asked[1] == "secrets" and asked[0] != "POST"]


async def test_a_key_secret_deleted_is_made_again_under_its_name(cluster):
    await cluster.create(API_VERSION, PLURAL, service_manifest("rekeyed", NS, nodes=2))
    await eventually(lambda: cluster.stored(*LWS, NS, "rekeyed"), what="leaderworkerset")
    key_name = status_of(cluster, "rekeyed")["nodeKeySecret"]
    first = cluster.stored("v1", "secrets", NS, key_name)["data"]
    await cluster.delete("v1", "secrets", NS, key_name)
    await cluster.patch(API_VERSION, PLURAL, NS, "rekeyed", {"spec": {"replicas": 2}},
                        bump_generation=True)
    again = await eventually(lambda: cluster.stored("v1", "secrets", NS, key_name),
                             what="the key made again")
    assert again["data"] != first and status_of(cluster, "rekeyed")["nodeKeySecret"] == key_name
    assert key_secret_of(cluster.stored(*LWS, NS, "rekeyed")) == key_name


async def test_status_comes_from_the_leader_worker_set_and_every_pod_of_its_groups(cluster):
    await cluster.create(API_VERSION, PLURAL, service_manifest("shown", NS, nodes=2))
    await eventually(lambda: cluster.stored(*LWS, NS, "shown"), what="leaderworkerset")
    fits = "fits: engine requires 1.2 GiB, limit is 40.0 GiB\n" + plan_line(FITS)
    await cluster.create("v1", "pods", group_pod("shown", 0, 0, running(
        True, initContainerStatuses=[preflight_done(0, fits)])))
    await cluster.create("v1", "pods", group_pod("shown", 0, 1, running(False)))
    await cluster.patch(*LWS, NS, "shown", {"status": {"replicas": 1, "readyReplicas": 0}},
                        subresource="status")
    starting = await eventually(lambda: status_of(cluster, "shown").get("pods") and len(
        status_of(cluster, "shown")["pods"]) == 2 and status_of(cluster, "shown"))
    assert starting["pods"] == [
        {"name": "shown-0", "group": 0, "role": "leader", "phase": "Running", "ready": True},
        {"name": "shown-0-1", "group": 0, "role": "worker", "phase": "Running", "ready": False}]
    assert starting["readyReplicas"] == 0 and starting["replicas"] == 1
    assert condition({"status": starting}, "Ready")["reason"] == "Starting"
    assert condition({"status": starting}, "MemoryBudget")["reason"] == "Fits"
    assert starting["selector"] == f"{LABEL}=shown,{WORKER_INDEX_LABEL}=0"
    await cluster.patch("v1", "pods", NS, "shown-0-1", {"status": running(True)},
                        subresource="status")
    await cluster.patch(*LWS, NS, "shown", {"status": {"readyReplicas": 1}},
                        subresource="status")
    await eventually(lambda: condition(cluster.stored(API_VERSION, PLURAL, NS, "shown"),
                                       "Ready").get("reason") == "Ready", what="Ready")
    assert status_of(cluster, "shown")["readyReplicas"] == 1
    assert condition(cluster.stored(API_VERSION, PLURAL, NS, "shown"),
                     "Ready")["message"] == "1/1 replicas ready"


async def test_the_leaders_preflight_refusal_is_the_resources(cluster):
    await cluster.create(API_VERSION, PLURAL, service_manifest("toobig", NS, nodes=2))
    await eventually(lambda: cluster.stored(*LWS, NS, "toobig"), what="leaderworkerset")
    await cluster.create("v1", "pods", group_pod("toobig", 0, 0, {
        "phase": "Pending", "initContainerStatuses": [{
            "name": "preflight", "restartCount": 1,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 3, "reason": "Error",
                                         "message": REPORT + plan_line(REFUSED)}}}]}))
    obj = await eventually(lambda: condition(cluster.stored(API_VERSION, PLURAL, NS, "toobig"),
                                             "MemoryBudget").get("reason") == "DoesNotFit"
                           and cluster.stored(API_VERSION, PLURAL, NS, "toobig"))
    assert condition(obj, "MemoryBudget")["message"] == REPORT.strip()
    assert condition(obj, "Ready")["reason"] == "DoesNotFit"
    assert obj["status"]["pods"][0]["role"] == "leader"


async def test_changing_nodes_swaps_the_deployment_and_the_leader_worker_set(cluster):
    await cluster.create(API_VERSION, PLURAL, service_manifest("grow", NS, gpus=1))
    await eventually(lambda: cluster.stored("apps/v1", "deployments", NS, "grow"),
                     what="deployment")
    await cluster.patch(API_VERSION, PLURAL, NS, "grow", {"spec": {"nodes": 2}},
                        bump_generation=True)
    await eventually(lambda: cluster.stored(*LWS, NS, "grow"), what="leaderworkerset")
    await eventually(lambda: cluster.stored("apps/v1", "deployments", NS, "grow") is None,
                     what="deployment deleted")
    await eventually(lambda: "pods" in status_of(cluster, "grow"), what="status.pods")
    await cluster.patch(API_VERSION, PLURAL, NS, "grow", {"spec": {"nodes": 1}},
                        bump_generation=True)
    await eventually(lambda: cluster.stored("apps/v1", "deployments", NS, "grow"),
                     what="deployment again")
    await eventually(lambda: cluster.stored(*LWS, NS, "grow") is None,
                     what="leaderworkerset deleted")
    await eventually(lambda: "pods" not in status_of(cluster, "grow"), what="no status.pods")
    await eventually(lambda: cluster.stored("v1", "services", NS, "grow")["spec"]["selector"]
                     == {LABEL: "grow"}, what="the Service selecting every pod again")
    assert cluster.stored("networking.k8s.io/v1", "networkpolicies", NS, "grow") is None
