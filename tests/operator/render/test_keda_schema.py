"""KEDA's side of scaling: every ScaledObject the operator renders is valid against KEDA's
own CRD, and with ``autoscaling.httpAddOn`` the HTTP add-on's InterceptorRoute against the
add-on's (both vendored under tests/data/keda, strict: a field the schema does not name is
an error here). Scale to zero wakes through the add-on: the route sends the hosts' requests
to the Service, the ScaledObject carries the add-on's trigger beside the Prometheus one, and
a cluster without the add-on is told what to install, with nothing applied."""

from __future__ import annotations

import jsonschema
import pytest
from operator_harness import eventually, ready_for, running_operator, service_manifest
from spec_helpers import spec_of
from vendored_crds import DATA, check_release, strict_version_schema

from kvledger.engine.errors import BadInput
from kvledger.operator.api.crd import validate_manifest
from kvledger.operator.api.resource import API_VERSION, PLURAL
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.render.autoscaling import (
    DEFAULT_HTTP_SCALER,
    HTTP_ADD_ON_RELEASE,
    INTERCEPTOR_ROUTES,
    render_scaling,
)

SCALED_OBJECTS = DATA / "keda" / "keda.sh_scaledobjects.yaml"
INTERCEPTOR_ROUTE_CRD = DATA / "keda" / "http.keda.sh_interceptorroutes.yaml"
SCALED_OBJECT = ("keda.sh/v1alpha1", "scaledobjects")
MODEL = {"path": "/models/m"}
ZERO = {"minReplicas": 0, "maxReplicas": 4, "provider": "keda"}
ADD_ON = {"hosts": ["llama.example.com"]}
OWN = {"hosts": ["chat.default.svc.cluster.local"]}  # the service's own cluster name
SPECS = {
    "keda": {"model": MODEL, "autoscaling": {"maxReplicas": 3, "provider": "keda"}},
    "keda, a group, its own Prometheus": {
        "model": MODEL, "nodes": 2, "gpus": 2, "autoscaling": {
            "maxReplicas": 2, "provider": "keda", "metric": "requestsWaiting",
            "prometheus": {"serverAddress": "http://prom.monitoring:9090"}}},
    "to zero behind the add-on": {"model": MODEL, "autoscaling": {**ZERO, "httpAddOn": ADD_ON}},
    "the add-on, every field, its own port": {
        "model": MODEL, "port": 9000, "autoscaling": {**ZERO, "httpAddOn": {
            "hosts": ["llama.example.com", "*.models.example.com"], "concurrency": 16,
            "readinessTimeout": "5m"}}},
    "the add-on answering a cold start at once": {
        "model": MODEL, "autoscaling": {**ZERO, "httpAddOn": {**ADD_ON, "coldStart": "retryAfter"}}},
}


@pytest.fixture(scope="module")
def schemas() -> dict:
    return {"ScaledObject": strict_version_schema(SCALED_OBJECTS, "v1alpha1"),
            "InterceptorRoute": strict_version_schema(INTERCEPTOR_ROUTE_CRD, "v1beta1")}


def test_the_vendored_crds_are_the_release_files_their_headers_name():
    check_release(SCALED_OBJECTS, "v2.20.2")
    check_release(INTERCEPTOR_ROUTE_CRD, HTTP_ADD_ON_RELEASE)


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_rendered_keda_children_are_valid_against_keda_and_the_add_on(spec, schemas):
    validate_manifest({"apiVersion": API_VERSION, "kind": "InferenceService",
                       "metadata": {"name": "llama"}, "spec": spec})
    children = render_scaling("llama", "team-a", spec_of(spec))
    rendered = [body for body in (children[SCALED_OBJECT], children[INTERCEPTOR_ROUTES])
                if body is not None]
    assert rendered
    for body in rendered:
        errors = list(jsonschema.Draft4Validator(schemas[body["kind"]]).iter_errors(body))
        assert not errors, [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                            for e in errors[:5]]


def test_to_zero_the_add_on_routes_to_the_service_and_its_trigger_wakes_it():
    spec = SPECS["the add-on, every field, its own port"]
    children = render_scaling("llama", "team-a", spec_of(spec), http_scaler="scaler.keda:9090")
    route = children[INTERCEPTOR_ROUTES]
    assert route["metadata"]["name"] == "llama" and route["metadata"]["namespace"] == "team-a"
    assert route["spec"] == {
        "target": {"service": "llama", "port": 9000},
        "rules": [{"hosts": ["llama.example.com", "*.models.example.com"]}],
        "scalingMetric": {"concurrency": {"targetValue": 16}},
        "timeouts": {"readiness": "5m"}}
    scaled = children[SCALED_OBJECT]["spec"]
    assert scaled["minReplicaCount"] == 0
    prometheus, add_on = scaled["triggers"]
    assert prometheus["type"] == "prometheus"
    assert add_on == {"type": "external-push", "metadata": {
        "scalerAddress": "scaler.keda:9090", "interceptorRoute": "llama"}}
    plain = render_scaling("llama", "team-a", spec_of(SPECS["to zero behind the add-on"]))
    assert plain[SCALED_OBJECT]["spec"]["triggers"][1]["metadata"]["scalerAddress"] == \
        DEFAULT_HTTP_SCALER
    assert "timeouts" not in plain[INTERCEPTOR_ROUTES]["spec"]  # the add-on's own default
    without = render_scaling("llama", "team-a", spec_of({"model": MODEL, "autoscaling": ZERO}))
    assert without[INTERCEPTOR_ROUTES] is None
    assert [t["type"] for t in without[SCALED_OBJECT]["spec"]["triggers"]] == ["prometheus"]


def test_a_cold_start_answered_at_once_says_when_to_retry_and_still_wakes_the_service():
    """``coldStart: retryAfter``: the interceptor's placeholder answers while no pod is
    ready, in the engine's own 503 shape, Retry-After the last start's seconds (60 before
    one is measured). The add-on counts a placeholder's request (its counting middleware
    wraps the placeholder) but only for microseconds, too short for the concurrency sample:
    the request rate the route also counts makes its trigger active, with a target so high
    it never asks a second replica."""
    import json

    from kvledger.engine.server.api_errors import error_body
    from kvledger.operator.render.autoscaling import WAKE_RATE_TARGET

    spec = spec_of(SPECS["the add-on answering a cold start at once"])
    for measured, seconds in ((None, 60), (137, 137), (0, 60)):
        route = render_scaling("llama", "team-a", spec,
                               start_seconds=measured)[INTERCEPTOR_ROUTES]["spec"]
        answer = route["coldStart"]["placeholder"]["response"]
        assert answer["statusCode"] == 503
        assert answer["headers"] == {"Retry-After": str(seconds),
                                     "Content-Type": "application/json"}
        message = f"llama is starting from zero replicas: retry in {seconds} s"
        assert json.loads(answer["body"]) == error_body(503, message, "scaled_to_zero")
        assert route["scalingMetric"] == {
            "concurrency": {"targetValue": 100},
            "requestRate": {"targetValue": WAKE_RATE_TARGET, "window": "5m"}}
        assert "timeouts" not in route
    held = render_scaling("llama", "team-a", spec_of(SPECS["to zero behind the add-on"]),
                          start_seconds=137)[INTERCEPTOR_ROUTES]["spec"]
    assert "coldStart" not in held and set(held["scalingMetric"]) == {"concurrency"}


@pytest.mark.parametrize(("scaling", "message"), [
    # A rule (CEL in the CRD; tests/operator/api check each rule's CEL and Python agree).
    ({"maxReplicas": 2, "httpAddOn": ADD_ON}, "applies to provider keda only"),
    # The schema's own fields.
    ({**ZERO, "httpAddOn": {"hosts": []}}, "must list 1 to 16 host names"),
    ({**ZERO, "httpAddOn": {"hosts": ["Bad_Host"]}}, "must list 1 to 16 host names"),
    ({**ZERO, "httpAddOn": {**ADD_ON, "concurrency": 0}}, "concurrency must be at least 1"),
    ({**ZERO, "httpAddOn": {**ADD_ON, "readinessTimeout": "soon"}},
     "readinessTimeout must be a duration"),
    ({**ZERO, "httpAddOn": {**ADD_ON, "coldStart": "wait"}}, "coldStart must be one of"),
    ({**ZERO, "httpAddOn": {**ADD_ON, "coldStart": "retryAfter", "readinessTimeout": "5m"}},
     "set one or the other"),
])
def test_a_bad_add_on_is_refused_by_the_operator_and_the_crd(scaling, message):
    with pytest.raises(BadInput, match=message):
        parse_spec({"model": MODEL, "autoscaling": scaling})
    if scaling.get("provider") != "keda" or message == "set one or the other":
        return  # a rule's CEL, which the schema's validator does not run
    with pytest.raises(BadInput):
        validate_manifest({"apiVersion": API_VERSION, "kind": "InferenceService",
                           "metadata": {"name": "llama"},
                           "spec": {"model": MODEL, "autoscaling": scaling}})


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
async def test_the_operator_applies_the_route_and_removes_it_with_the_field():
    async with running_operator(http_add_on=True) as cluster:
        manifest = service_manifest("chat", autoscaling={**ZERO, "httpAddOn": OWN})
        await cluster.create(API_VERSION, PLURAL, manifest)
        route = await eventually(lambda: cluster.stored(*INTERCEPTOR_ROUTES, "default", "chat"),
                                 what="interceptorroute")
        owner = cluster.stored(API_VERSION, PLURAL, "default", "chat")
        [ref] = route["metadata"]["ownerReferences"]
        assert ref["uid"] == owner["metadata"]["uid"]
        scaled = cluster.stored(*SCALED_OBJECT, "default", "chat")
        assert [t["type"] for t in scaled["spec"]["triggers"]] == ["prometheus", "external-push"]
        await cluster.patch(API_VERSION, PLURAL, "default", "chat",
                            {"spec": {"autoscaling": {"httpAddOn": None}}})
        await eventually(lambda: cluster.stored(*INTERCEPTOR_ROUTES, "default", "chat") is None,
                         what="the route deleted")
        await eventually(lambda: [t["type"] for t in cluster.stored(
            *SCALED_OBJECT, "default", "chat")["spec"]["triggers"]] == ["prometheus"],
            what="the add-on's trigger removed")


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
async def test_the_operator_puts_the_last_start_in_the_cold_start_answer():
    """The Retry-After follows ``status.startup``: a scale-up measured is the next answer's
    wait, written at the next reconcile (``cold_start_seconds``, whose predicted read
    before a measured start is tested below)."""
    async with running_operator(http_add_on=True) as cluster:
        manifest = service_manifest("chat", autoscaling={
            **ZERO, "httpAddOn": {**OWN, "coldStart": "retryAfter"}})
        await cluster.create(API_VERSION, PLURAL, manifest)

        def retry_after():
            route = cluster.stored(*INTERCEPTOR_ROUTES, "default", "chat")
            answer = ((route or {}).get("spec", {}).get("coldStart") or {}).get("placeholder")
            return answer and answer["response"]["headers"]["Retry-After"]

        assert await eventually(retry_after, what="the route") == "60"
        await cluster.patch(API_VERSION, PLURAL, "default", "chat", {"status": {"startup": {
            "readyAt": "2026-12-06T10:00:00Z", "seconds": {"total": 95, "engine": 80}}}},
            subresource="status")
        await cluster.patch(API_VERSION, PLURAL, "default", "chat",
                            {"spec": {"autoscaling": {"maxReplicas": 5}}}, bump_generation=True)
        await eventually(lambda: retry_after() == "95", what="the measured start")


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
async def test_a_cluster_without_the_add_on_is_told_what_to_install():
    async with running_operator(http_add_on=False) as cluster:
        manifest = service_manifest("chat", autoscaling={**ZERO, "httpAddOn": OWN})
        await cluster.create(API_VERSION, PLURAL, manifest)
        ready = await ready_for(cluster, "chat", "KedaHttpAddOnMissing")
        assert ready["status"] == "False" and HTTP_ADD_ON_RELEASE in ready["message"]
        assert "keda-add-ons-http" in ready["message"]
        assert cluster.stored("apps/v1", "deployments", "default", "chat") is None


@pytest.mark.parametrize(("hosts", "allowed"), [
    (["chat.team-a", "chat.team-a.svc", "chat.team-a.svc.cluster.local"], True),
    (["chat.team-b.svc.cluster.local"], False),  # another namespace's service
    (["*"], False),  # every host nobody else claims, at the cluster's one interceptor
    (["llama.example.com"], False),  # a public host: maybe another tenant's
    (["chat.team-a.models.example.com", "x.team-a.example.com"], True),  # the admin's
    (["*.team-a.example.com"], True),
    (["x.team-b.example.com"], False),
    (["*.example.com"], False),  # wider than the admin's pattern
])
def test_the_hosts_a_resource_claims_at_the_interceptor_are_its_own(hosts, allowed):
    """KEDA's interceptor is one for the cluster: a route claiming a host that another
    namespace's clients use would send their requests (prompts, keys) to this service. A
    resource may claim its own Service's cluster names, and what the admin's patterns
    give its namespace; the operator and the webhook refuse the rest (PolicyDenied)."""
    from kvledger.operator.render.policy import Policy, PolicyDenied

    policy = Policy(http_hosts=("{name}.{namespace}.models.example.com",
                                "*.{namespace}.example.com"))
    spec = parse_spec({"model": MODEL, "autoscaling": {**ZERO, "httpAddOn": {"hosts": hosts}}})
    if allowed:
        policy.check(spec, "kvledger:test", name="chat", namespace="team-a")
    else:
        with pytest.raises(PolicyDenied, match=r"policy\.httpAddOnHosts"):
            policy.check(spec, "kvledger:test", name="chat", namespace="team-a")
    with pytest.raises(PolicyDenied):  # the chart's default: the cluster names only
        Policy().check(parse_spec({"model": MODEL, "autoscaling": {
            **ZERO, "httpAddOn": ADD_ON}}), "kvledger:test", name="chat", namespace="team-a")
    assert Policy.from_json('{"httpAddOnHosts": ["*.{namespace}.example.com"]}').http_hosts \
        == ("*.{namespace}.example.com",)


@pytest.mark.parametrize(("status", "seconds"), [
    ({}, None),
    ({"startup": {"seconds": {"total": 95}}, "plan": {"timeToReady": {"predictedS": {"read": 300}}}}, 95),
    ({"plan": {"timeToReady": {"predictedS": {"read": 300.01}}}}, 301),
    ({"plan": {"timeToReady": {"predictedS": {"read": 12.5}}}}, None),  # the default is longer
    ({"plan": {"timeToReady": {"predictedS": {"read": float("nan")}}}}, None),
    ({"plan": {"timeToReady": {"predictedS": {"read": float("inf")}}}}, None),
    ({"plan": {"timeToReady": {"predictedS": {"read": 1e300}}}}, None),
    ({"plan": {"timeToReady": {"predictedS": {"read": True}}}}, None),
    ({"plan": {"timeToReady": {"predictedS": {"read": "600"}}}}, None),
    ({"plan": {"timeToReady": None}}, None),
])
def test_a_cold_starts_wait_is_measured_else_predicted_within_bounds(status, seconds):
    """The pre-flight's figure comes from the tenant's own pod: a number past a day, not a
    number, or not finite leaves the default (and only ever this service's own answer)."""
    from kvledger.operator.controller.startup import cold_start_seconds

    assert cold_start_seconds({"status": status}) == seconds
