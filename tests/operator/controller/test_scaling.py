"""Scaling, with the real operator against kmock's Kubernetes emulator over HTTP: the scale
subresource drives the Deployment (and the resync timer leaves it alone), the status feeds
the scale subresource, and the HPA / ScaledObject / PodDisruptionBudget are owned children
that follow the spec.

One operator run is shared by the module; each test uses its own resource name.
"""

from __future__ import annotations

import kopf
import pytest
import pytest_asyncio
from operator_harness import eventually, running_operator, service_manifest

from kvledger.operator.api.resource import API_VERSION, PLURAL
from kvledger.operator.controller import handlers
from kvledger.operator.main import operator_memo
from kvledger.operator.render.render import LABEL

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")]

NS = "default"
HPA = ("autoscaling/v2", "horizontalpodautoscalers")
SCALED_OBJECT = ("keda.sh/v1alpha1", "scaledobjects")
PDB = ("policy/v1", "poddisruptionbudgets")
DEPLOYMENT = ("apps/v1", "deployments")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster():
    async with running_operator(default_image="kvledger:test") as running:
        yield running


def replicas(cluster, name: str) -> int | None:
    deployment = cluster.stored(*DEPLOYMENT, NS, name)
    return deployment["spec"]["replicas"] if deployment else None


async def scale(cluster, name: str, count: int) -> None:
    """What `kubectl scale` and an autoscaler do: write the scale subresource (the API
    server bumps the generation, as for any change of the spec)."""
    await cluster.patch(API_VERSION, PLURAL, NS, name, {"spec": {"replicas": count}},
                        bump_generation=True, subresource="scale")


async def run_timer(cluster, name: str, stale_body: dict) -> None:
    """What the 60 s resync timer runs, run now, handed a body older than the resource."""
    await handlers.resync(name=name, namespace=NS, spec=kopf.Spec(kopf.Body(stale_body)),
                          body=kopf.Body(stale_body),
                          memo=operator_memo("kvledger:test", cluster.api),
                          pods_by_service={}, deployments_by_service={})


def owned_by(child: dict, owner: dict) -> bool:
    [ref] = child["metadata"]["ownerReferences"]
    return (ref["uid"] == owner["metadata"]["uid"] and ref["kind"] == "InferenceService"
            and ref["apiVersion"] == API_VERSION and ref["controller"] is True)


async def test_kubectl_scale_reaches_the_deployment_and_the_timer_leaves_it_alone(cluster):
    await cluster.create(API_VERSION, PLURAL, service_manifest("scaled", NS))
    await eventually(lambda: replicas(cluster, "scaled") == 1, what="deployment of 1")
    before = cluster.stored(API_VERSION, PLURAL, NS, "scaled")

    await scale(cluster, "scaled", 3)
    await eventually(lambda: replicas(cluster, "scaled") == 3, what="deployment of 3")
    # More than one pod: a PodDisruptionBudget, owned, evicting one at a time.
    pdb = await eventually(lambda: cluster.stored(*PDB, NS, "scaled"), what="PDB")
    assert owned_by(pdb, before)
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == {"matchLabels": {LABEL: "scaled"}}

    # The timer, even handed the body from before the scale, applies the resource as it is.
    await run_timer(cluster, "scaled", before)
    assert replicas(cluster, "scaled") == 3
    counts = [v["spec"]["replicas"] for v in cluster.history(*DEPLOYMENT, NS, "scaled")]
    assert counts[counts.index(3):] == [3] * len(counts[counts.index(3):]), counts

    await scale(cluster, "scaled", 1)
    await eventually(lambda: replicas(cluster, "scaled") == 1, what="deployment of 1 again")
    await eventually(lambda: cluster.stored(*PDB, NS, "scaled") is None, what="PDB removed")


async def test_status_carries_what_the_scale_subresource_reads(cluster):
    await cluster.create(API_VERSION, PLURAL, service_manifest("counted", NS, replicas=2))
    await eventually(lambda: replicas(cluster, "counted") == 2, what="deployment of 2")
    # The Deployment controller's report: 2 pods, 1 ready.
    await cluster.patch(*DEPLOYMENT, NS, "counted",
                        {"status": {"replicas": 2, "readyReplicas": 1}}, subresource="status")
    await cluster.create("v1", "pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "counted-abc-1", "namespace": NS, "labels": {LABEL: "counted"}},
        "spec": {"containers": [{"name": "engine", "image": "kvledger:test"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}})

    def reported():
        status = (cluster.stored(API_VERSION, PLURAL, NS, "counted") or {}).get("status") or {}
        return status if (status.get("replicas"), status.get("readyReplicas")) == (2, 1) else None

    status = await eventually(reported, what="status.replicas 2, readyReplicas 1")
    assert status["selector"] == f"{LABEL}=counted"
    deployment = cluster.stored(*DEPLOYMENT, NS, "counted")
    assert deployment["spec"]["selector"]["matchLabels"] == {LABEL: "counted"}


async def test_the_autoscaler_is_owned_and_follows_spec_autoscaling(cluster):
    await cluster.create(API_VERSION, PLURAL, service_manifest(
        "auto", NS, autoscaling={"minReplicas": 2, "maxReplicas": 5}))
    owner = cluster.stored(API_VERSION, PLURAL, NS, "auto")
    hpa = await eventually(lambda: cluster.stored(*HPA, NS, "auto"), what="HPA")
    assert owned_by(hpa, owner)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": API_VERSION,
                                             "kind": "InferenceService", "name": "auto"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "kvledger_kv_reserved_ratio"},
        "target": {"type": "AverageValue", "averageValue": "800m"}}}]
    # Up to 5 pods: a PDB, although spec.replicas is still 1.
    assert owned_by(await eventually(lambda: cluster.stored(*PDB, NS, "auto")), owner)

    # The HPA scales the resource; the operator follows, and its timer does not undo it.
    await scale(cluster, "auto", 4)
    await eventually(lambda: replicas(cluster, "auto") == 4, what="deployment of 4")
    await run_timer(cluster, "auto", owner)
    assert replicas(cluster, "auto") == 4

    await cluster.patch(API_VERSION, PLURAL, NS, "auto", {"spec": {"autoscaling": {
        "metric": "requestsWaiting", "target": 8}}}, bump_generation=True)

    def hpa_metric():
        metrics = (cluster.stored(*HPA, NS, "auto") or {}).get("spec", {}).get("metrics")
        return metrics if metrics and metrics[0]["pods"]["metric"]["name"] \
            == "kvledger_requests_waiting" else None

    [metric] = await eventually(hpa_metric, what="HPA on requestsWaiting")
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "8"}

    # Another provider: the HPA goes before the ScaledObject comes.
    await cluster.patch(API_VERSION, PLURAL, NS, "auto", {"spec": {"autoscaling": {
        "provider": "keda", "minReplicas": 0,
        "prometheus": {"serverAddress": "http://prom.obs.svc:9090"}}}}, bump_generation=True)
    scaled = await eventually(lambda: cluster.stored(*SCALED_OBJECT, NS, "auto"),
                              what="ScaledObject")
    assert cluster.stored(*HPA, NS, "auto") is None
    assert owned_by(scaled, owner)
    assert scaled["spec"]["scaleTargetRef"] == hpa["spec"]["scaleTargetRef"]
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (0, 5)
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["metadata"] == {
        "serverAddress": "http://prom.obs.svc:9090",
        "query": 'sum(kvledger_requests_waiting{namespace="default",'
                 'pod=~"auto-[a-z0-9]{1,10}-[a-z0-9]{5}"})',
        "threshold": "8"}

    # No autoscaling: the ScaledObject goes, the Deployment keeps following spec.replicas.
    await cluster.patch(API_VERSION, PLURAL, NS, "auto", {"spec": {"autoscaling": None}},
                        bump_generation=True)
    await eventually(lambda: cluster.stored(*SCALED_OBJECT, NS, "auto") is None,
                     what="ScaledObject removed")
    assert cluster.stored(*HPA, NS, "auto") is None
    assert replicas(cluster, "auto") == 4
    assert cluster.stored(*PDB, NS, "auto") is not None  # still 4 pods

    # The resource goes: so do all its children (kmock has no garbage collector).
    assert await cluster.delete(API_VERSION, PLURAL, NS, "auto")
    await eventually(lambda: all(cluster.stored(*kind, NS, "auto") is None
                                 for kind in (DEPLOYMENT, PDB, HPA, SCALED_OBJECT)),
                     what="children deleted")


async def test_scale_to_zero_with_an_hpa_is_refused_by_the_operator_too(cluster):
    # The CRD's CEL rule refuses this at `kubectl apply`; an API server that skips CEL
    # (kmock) gets the operator's own check, with the same words.
    await cluster.create(API_VERSION, PLURAL, service_manifest(
        "to-zero", NS, autoscaling={"minReplicas": 0, "maxReplicas": 3}))

    def invalid():
        obj = cluster.stored(API_VERSION, PLURAL, NS, "to-zero") or {}
        ready = [c for c in (obj.get("status") or {}).get("conditions") or []
                 if c["type"] == "Ready"]
        return ready[0] if ready and ready[0]["reason"] == "InvalidSpec" else None

    ready = await eventually(invalid, what="InvalidSpec")
    assert ready["message"] == ("autoscaling.minReplicas 0 (scale to zero) needs provider "
                                "keda: an HPA cannot scale to zero")
    assert cluster.stored(*DEPLOYMENT, NS, "to-zero") is None
    assert cluster.stored(*HPA, NS, "to-zero") is None
