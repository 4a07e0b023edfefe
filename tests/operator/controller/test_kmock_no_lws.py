"""spec.nodes above 1 on a cluster that does not serve LeaderWorkerSet: refused clearly,
once, and what already serves is left alone."""

from __future__ import annotations

import pytest
import pytest_asyncio
from operator_harness import condition, eventually, running_operator, service_manifest

from kvledger.operator.api.resource import API_VERSION, PLURAL
from kvledger.operator.render.render_group import LWS_API_VERSION, LWS_PLURAL, LWS_RELEASE

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")]

NS = "default"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster():
    async with running_operator(default_image="kvledger:test", lws=False) as running:
        yield running


def missing(cluster, name: str) -> dict | None:
    ready = condition(cluster.stored(API_VERSION, PLURAL, NS, name), "Ready")
    return ready if ready.get("reason") == "LeaderWorkerSetMissing" else None


async def test_nodes_above_one_without_lws_says_to_install_it_and_applies_nothing(cluster):
    await cluster.create(API_VERSION, PLURAL, service_manifest("lonely", NS, nodes=2))
    ready = await eventually(lambda: missing(cluster, "lonely"), what="LeaderWorkerSetMissing")
    assert ready["status"] == "False"
    assert ready["message"].startswith(
        f"nodes 2 needs LeaderWorkerSet ({LWS_API_VERSION}), which this cluster does not "
        f"serve: install it (kubernetes-sigs/lws, release {LWS_RELEASE}: kubectl apply ")
    [event] = await eventually(lambda: [e for e in cluster.events_for("lonely")
                                        if e.get("type") == "Warning"], what="warning event")
    assert event["reason"] == "LeaderWorkerSetMissing"
    assert event["message"] == ready["message"]
    for api_version, plural in (("apps/v1", "deployments"), ("v1", "services"),
                                (LWS_API_VERSION, LWS_PLURAL)):
        assert cluster.stored(api_version, plural, NS, "lonely") is None, plural
    assert not cluster.all_stored("secrets")
    # Nothing was written but the resource's own status and annotations, and the event.
    assert not [(method, plural) for method, plural in cluster.emulator.asked
                if method in ("POST", "PATCH", "PUT", "DELETE")
                and plural not in (PLURAL, "events")]


async def test_a_serving_deployment_stays_until_lws_is_there(cluster):
    await cluster.create(API_VERSION, PLURAL, service_manifest("single", NS))
    await eventually(lambda: cluster.stored("apps/v1", "deployments", NS, "single"),
                     what="deployment")
    await cluster.patch(API_VERSION, PLURAL, NS, "single", {"spec": {"nodes": 2}},
                        bump_generation=True)
    await eventually(lambda: missing(cluster, "single"), what="LeaderWorkerSetMissing")
    assert cluster.stored("apps/v1", "deployments", NS, "single") is not None
    assert cluster.stored("v1", "services", NS, "single")["spec"]["selector"] == {
        "kvledger.dev/inferenceservice": "single"}
