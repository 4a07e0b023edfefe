"""A hostile tenant against the operator, through kmock's emulator: an author who may create
InferenceServices (and not Services, NetworkPolicies, PodDisruptionBudgets or Deployments)
names one after another team's objects, and the operator must neither take those over nor
delete them (``cluster/ownership.py``); nor may its pods carry a label of another
Service's selector (``render/pod_metadata_policy.py``)."""

from __future__ import annotations

import pytest
import pytest_asyncio
from operator_harness import condition, eventually, running_operator, service_manifest

from kvledger.operator.api.resource import API_VERSION, PLURAL
from kvledger.operator.cluster.ownership import ChildTaken
from kvledger.operator.controller.handlers import RETRY_DELAY_S

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")]
NS = "default"
NETPOL = ("networking.k8s.io/v1", "networkpolicies")
PDB = ("policy/v1", "poddisruptionbudgets")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster():
    async with running_operator(default_image="kvledger:test") as running:
        yield running


async def others_objects(cluster, name: str) -> None:
    """Another team's Service, NetworkPolicy and PodDisruptionBudget named ``name``."""
    await cluster.create("v1", "services", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NS},
        "spec": {"selector": {"app": name}, "ports": [{"port": 443}]}})
    await cluster.create(*NETPOL, {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}})
    await cluster.create(*PDB, {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": name}}}})


async def test_a_service_named_as_anothers_service_neither_takes_it_over_nor_deletes_anything(
        cluster):
    """The author's InferenceService `payments`: the operator made payments' Service select
    the author's pods only (port 443 replaced by 8000, owned by the author's resource) and
    deleted payments' NetworkPolicy and PDB."""
    await others_objects(cluster, "payments")
    await cluster.create(API_VERSION, PLURAL, service_manifest("payments", NS))
    ready = await eventually(lambda: condition(cluster.stored(API_VERSION, PLURAL, NS,
                                                              "payments"), "Ready")
                             .get("reason") == ChildTaken.reason
                             and condition(cluster.stored(API_VERSION, PLURAL, NS, "payments"),
                                           "Ready"), what="ChildNotOwned")
    assert "Service payments exists and is not this InferenceService's" in ready["message"]
    service = cluster.stored("v1", "services", NS, "payments")
    assert service["spec"]["selector"] == {"app": "payments"}
    assert service["spec"]["ports"] == [{"port": 443}]
    assert "ownerReferences" not in service["metadata"]
    assert cluster.stored(*NETPOL, NS, "payments") is not None
    assert cluster.stored(*PDB, NS, "payments") is not None
    # Deleted, the resource takes none of them with it (its own Deployment, yes).
    assert cluster.stored("apps/v1", "deployments", NS, "payments") is not None
    assert await cluster.delete(API_VERSION, PLURAL, NS, "payments")
    await eventually(lambda: cluster.stored("apps/v1", "deployments", NS, "payments") is None,
                     what="its own Deployment deleted")
    assert cluster.stored("v1", "services", NS, "payments")["spec"]["ports"] == [{"port": 443}]
    assert cluster.stored(*NETPOL, NS, "payments") is not None
    assert cluster.stored(*PDB, NS, "payments") is not None


async def test_anothers_deployment_of_the_name_is_neither_patched_nor_deleted(cluster):
    """nodes 1 applies a Deployment and deletes a LeaderWorkerSet of the resource's name:
    another team's of either kind stays as it was."""
    await cluster.create("leaderworkerset.x-k8s.io/v1", "leaderworkersets", {
        "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
        "metadata": {"name": "ledger", "namespace": NS}, "spec": {"replicas": 3}})
    await cluster.create("apps/v1", "deployments", {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "ledger", "namespace": NS},
        "spec": {"selector": {"matchLabels": {"app": "ledger"}}, "template": {
            "metadata": {"labels": {"app": "ledger"}},
            "spec": {"containers": [{"name": "db", "image": "postgres"}]}}}})
    await cluster.create(API_VERSION, PLURAL, service_manifest("ledger", NS))
    await eventually(lambda: condition(cluster.stored(API_VERSION, PLURAL, NS, "ledger"),
                                       "Ready").get("reason") == ChildTaken.reason,
                     what="ChildNotOwned")
    deployment = cluster.stored("apps/v1", "deployments", NS, "ledger")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "postgres"
    assert "ownerReferences" not in deployment["metadata"]
    assert cluster.stored("leaderworkerset.x-k8s.io/v1", "leaderworkersets", NS,
                          "ledger")["spec"] == {"replicas": 3}
    assert await cluster.delete(API_VERSION, PLURAL, NS, "ledger")
    await eventually(lambda: cluster.stored(API_VERSION, PLURAL, NS, "ledger") is None,
                     what="resource gone")
    assert cluster.stored("apps/v1", "deployments", NS, "ledger") is not None
    assert cluster.stored("leaderworkerset.x-k8s.io/v1", "leaderworkersets", NS,
                          "ledger") is not None


async def test_once_the_other_object_is_gone_the_service_comes_up(cluster):
    """Not a permanent refusal: the other team removes its Service, the next reconcile
    applies the resource's own."""
    await cluster.create("v1", "services", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "later", "namespace": NS},
        "spec": {"selector": {"app": "later"}, "ports": [{"port": 80}]}})
    await cluster.create(API_VERSION, PLURAL, service_manifest("later", NS))
    await eventually(lambda: condition(cluster.stored(API_VERSION, PLURAL, NS, "later"),
                                       "Ready").get("reason") == ChildTaken.reason,
                     what="ChildNotOwned")
    assert await cluster.delete("v1", "services", NS, "later")
    await cluster.patch(API_VERSION, PLURAL, NS, "later", {"spec": {"replicas": 2}},
                        bump_generation=True)
    service = await eventually(lambda: (cluster.stored("v1", "services", NS, "later") or {})
                               .get("metadata", {}).get("ownerReferences") and
                               cluster.stored("v1", "services", NS, "later"),
                               what="its own Service",
                               timeout_s=3 * RETRY_DELAY_S)  # at the latest, the retry's
    assert service["spec"]["ports"][0]["port"] == 8000


async def test_a_label_of_another_services_selector_reaches_no_pod(cluster):
    """spec.podLabels ``app: payments`` made the author's pods endpoints of payments'
    Service: refused (PolicyDenied, nothing rendered); the same label on the resource's own
    metadata stays there."""
    await cluster.create(API_VERSION, PLURAL,
                         service_manifest("thief", NS, podLabels={"app": "payments"}))
    ready = await eventually(lambda: condition(cluster.stored(API_VERSION, PLURAL, NS, "thief"),
                                               "Ready").get("reason") == "PolicyDenied"
                             and condition(cluster.stored(API_VERSION, PLURAL, NS, "thief"),
                                           "Ready"), what="PolicyDenied")
    assert ready["message"].startswith("spec.podLabels app is not allowed")
    assert cluster.stored("apps/v1", "deployments", NS, "thief") is None
    manifest = service_manifest("quiet-thief", NS)
    manifest["metadata"]["labels"] = {"app": "payments"}
    await cluster.create(API_VERSION, PLURAL, manifest)
    deployment = await eventually(lambda: cluster.stored("apps/v1", "deployments", NS,
                                                         "quiet-thief"), what="deployment")
    assert "app" not in deployment["spec"]["template"]["metadata"]["labels"]
    assert "app" not in deployment["metadata"]["labels"]  # kopf.adopt copied it there
