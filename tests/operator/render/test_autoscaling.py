"""The pure scaling renderers: spec.autoscaling in, HPA / ScaledObject / PDB out, no server."""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from spec_helpers import spec_of

from kvledger.engine.errors import BadInput
from kvledger.operator.api.crd import validate_manifest
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.cluster.kube import typed
from kvledger.operator.render.autoscaling import (
    DEFAULT_PROMETHEUS_URL,
    INTERCEPTOR_ROUTES,
    METRICS,
    decimal,
    pdb_wanted,
    pod_name_pattern,
    promql,
    quantity,
    render_pdb,
    render_scaling,
)
from kvledger.operator.render.render import LABEL, pod_selector, render_deployment

MODEL = {"model": {"path": "/models/m"}}
HPA = ("autoscaling/v2", "horizontalpodautoscalers")
SCALED_OBJECT = ("keda.sh/v1alpha1", "scaledobjects")
PDB = ("policy/v1", "poddisruptionbudgets")
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
# Kubernetes releases the rendered objects must be valid for: the oldest this supports
# (autoscaling/v2 and policy/v1 are GA since 1.23 and 1.21; unhealthyPodEvictionPolicy
# since 1.27) and the newest kubernetes-validate knows.
K8S_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]


def scaling(**fields) -> dict:
    return {**MODEL, "autoscaling": fields}


def rendered(spec: dict, **kw) -> dict:
    return render_scaling("llama", "ml", spec_of(spec), **kw)


@pytest.mark.parametrize(("metric", "pods_metric", "target"), [
    ("kvReservedRatio", "kvledger_kv_reserved_ratio", "800m"),
    ("requestsWaiting", "kvledger_requests_waiting", "4"),
    ("rejectionRate", "kvledger_kv_cache_full_per_second", "1"),
])
def test_hpa_scales_the_resource_on_a_pods_metric_with_the_default_target(metric, pods_metric,
                                                                         target):
    children = rendered(scaling(maxReplicas=6, metric=metric))
    hpa = children[HPA]
    assert children[SCALED_OBJECT] is None
    assert hpa["metadata"] == {"name": "llama", "namespace": "ml", "labels": {
        LABEL: "llama", "app.kubernetes.io/name": "kvledger",
        "app.kubernetes.io/instance": "llama",
        "app.kubernetes.io/managed-by": "kvledger-operator"}}
    assert hpa["spec"] == {
        "scaleTargetRef": {"apiVersion": "kvledger.dev/v1alpha1", "kind": "InferenceService",
                           "name": "llama"},
        "minReplicas": 1, "maxReplicas": 6,
        "metrics": [{"type": "Pods", "pods": {
            "metric": {"name": pods_metric},
            "target": {"type": "AverageValue", "averageValue": target}}}],
    }
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(hpa, version, strict=True)
    typed(hpa)  # and sent as the client's typed model, unchanged


@pytest.mark.parametrize(("target", "averageValue", "threshold"), [
    ("0.8", "800m", "0.8"), ("800m", "800m", "0.8"), (".25", "250m", "0.25"),
    (1, "1", "1"), ("1.0", "1", "1"), ("0.0005", "500u", "0.0005"),
])
def test_a_target_is_written_as_the_api_server_stores_it_and_as_keda_reads_it(
        target, averageValue, threshold):
    hpa = rendered(scaling(maxReplicas=2, target=target))[HPA]
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == averageValue
    keda = rendered(scaling(maxReplicas=2, target=target, provider="keda"))[SCALED_OBJECT]
    assert keda["spec"]["triggers"][0]["metadata"]["threshold"] == threshold


def test_quantities_are_canonical():
    assert [quantity(Fraction(n, d)) for n, d in [(4, 1), (1000, 1), (1500, 1), (3, 2),
                                                  (1, 10**10)]] == [
        "4", "1k", "1500", "1500m", "1n"]
    assert decimal(Fraction(12345, 10**4)) == "1.2345" and decimal(Fraction(20)) == "20"


def test_keda_scaled_object_sums_the_pods_series_against_a_per_pod_threshold():
    scaled = rendered(scaling(minReplicas=0, maxReplicas=4, provider="keda"))[SCALED_OBJECT]
    assert scaled == {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": rendered(scaling(maxReplicas=4))[HPA]["metadata"],
        "spec": {
            "scaleTargetRef": {"apiVersion": "kvledger.dev/v1alpha1",
                               "kind": "InferenceService", "name": "llama"},
            "minReplicaCount": 0, "maxReplicaCount": 4,
            "triggers": [{"type": "prometheus", "metricType": "AverageValue", "metadata": {
                "serverAddress": DEFAULT_PROMETHEUS_URL,
                "query": 'sum(kvledger_kv_reserved_ratio{namespace="ml",'
                         'pod=~"llama-[a-z0-9]{1,10}-[a-z0-9]{5}"})',
                "threshold": "0.8"}}],
        },
    }
    # The operator's --prometheus-url, and the spec's address over it.
    assert rendered(scaling(maxReplicas=4, provider="keda"), prometheus_url="http://p:9090")[
        SCALED_OBJECT]["spec"]["triggers"][0]["metadata"]["serverAddress"] == "http://p:9090"
    spec = scaling(maxReplicas=4, provider="keda", prometheus={"serverAddress": "http://x:1"})
    assert rendered(spec, prometheus_url="http://p:9090")[SCALED_OBJECT][
        "spec"]["triggers"][0]["metadata"]["serverAddress"] == "http://x:1"
    assert rendered(spec)[HPA] is None


def test_the_queries_of_each_metric():
    assert {metric: promql("llama", "ml", metric) for metric in METRICS} == {
        "kvReservedRatio": 'sum(kvledger_kv_reserved_ratio{namespace="ml",'
                           'pod=~"llama-[a-z0-9]{1,10}-[a-z0-9]{5}"})',
        "requestsWaiting": 'sum(kvledger_requests_waiting{namespace="ml",'
                           'pod=~"llama-[a-z0-9]{1,10}-[a-z0-9]{5}"})',
        "rejectionRate": 'sum(rate(kvledger_requests_rejected_total{namespace="ml",'
                         'pod=~"llama-[a-z0-9]{1,10}-[a-z0-9]{5}",reason=~"kv_cache_full|queue_full"}[1m]))',
    }


def _pod_name(deployment: str, template_hash: str = "7d9f8b6c5d", suffix: str = "x2k9q") -> str:
    """A Deployment's pod name as Kubernetes makes it: the ReplicaSet's name and '-',
    truncated to 58 characters, then 5 random characters."""
    return f"{deployment}-{template_hash}-"[:58] + suffix


@pytest.mark.parametrize("name", ["llama", "a", "llama-8b", "x" * 46, "y" * 47, "z" * 57,
                                  "w" * 63])
def test_the_pod_pattern_matches_the_deployments_pods_only(name):
    # PromQL regexes are anchored, as fullmatch is. A template hash has 1 to 10 characters.
    pattern = pod_name_pattern(name)
    for template_hash in ("7d9f8b6c5d", "5bd8c9f47", "b"):
        assert re.fullmatch(pattern, _pod_name(name, template_hash)), template_hash
        assert not re.fullmatch(pattern, f"other-{_pod_name(name, template_hash)}")
        if len(name) <= 46:  # the pods of a resource named NAME-x, however long
            for other in (f"{name}-big", f"{name}-x", f"{name}-{'q' * (62 - len(name))}"):
                assert not re.fullmatch(pattern, _pod_name(other, template_hash)), other
            assert not re.fullmatch(pattern, f"{name}-{template_hash}")  # the ReplicaSet's


@pytest.mark.parametrize(("spec", "wanted"), [
    ({}, False), ({"replicas": 1}, False), ({"replicas": 0}, False), ({"replicas": 2}, True),
    ({"autoscaling": {"maxReplicas": 1}}, False),
    ({"autoscaling": {"maxReplicas": 3}}, True),
    ({"replicas": 3, "autoscaling": {"maxReplicas": 1}}, True),
])
def test_a_pdb_is_wanted_while_there_can_be_more_than_one_pod(spec, wanted):
    spec = {**MODEL, **spec}
    assert pdb_wanted(spec_of(spec)) is wanted
    assert (rendered(spec)[PDB] is not None) is wanted


def test_pdb_evicts_one_pod_at_a_time_and_selects_the_deployments_pods():
    pdb = render_pdb("llama", "ml")
    deployment = render_deployment("llama", "ml", spec_of({**MODEL, "replicas": 3}))
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(pdb, version, strict=True)
    typed(pdb)


def test_status_selector_selects_the_deployments_pods():
    deployment = render_deployment("llama", "ml", spec_of(MODEL))
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = dict(term.split("=") for term in pod_selector("llama").split(","))
    assert selector == deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()


def test_no_autoscaling_no_autoscaler():
    assert rendered(MODEL) == {HPA: None, SCALED_OBJECT: None, INTERCEPTOR_ROUTES: None,
                               PDB: None}
    assert parse_spec(MODEL).autoscaling is None


def test_defaults_are_the_crds():
    settings = parse_spec(scaling(maxReplicas=3)).autoscaling
    assert (settings.min_replicas, settings.metric, settings.target, settings.provider,
            settings.server_address) == (1, "kvReservedRatio", Fraction(4, 5), "hpa", None)
    assert parse_spec(scaling(maxReplicas=3, metric="requestsWaiting")).autoscaling.target == 4
    assert parse_spec(scaling(maxReplicas=3, metric="rejectionRate")).autoscaling.target == 1


@pytest.mark.parametrize(("fields", "message"), [
    ({"maxReplicas": 2, "minReplicas": 3}, "minReplicas must be at most autoscaling.maxReplicas"),
    ({"maxReplicas": 2, "minReplicas": 0}, "needs provider keda"),
    ({"maxReplicas": 2, "prometheus": {"serverAddress": "http://p:9090"}},
     "applies to provider keda only"),
    ({"maxReplicas": 2, "target": "1.2"}, "a share of the KV pool: at most 1"),
    ({"maxReplicas": 2, "target": "0m", "metric": "requestsWaiting"}, "must be more than 0"),
    ({"maxReplicas": 2, "target": 0.8}, "is not a whole number, a decimal or thousandths"),
    ({"maxReplicas": 0}, "maxReplicas must be at least 1"),
])
def test_the_operator_refuses_what_the_crd_refuses(fields, message):
    with pytest.raises(BadInput, match=re.escape(message)):
        rendered(scaling(**fields))
    with pytest.raises(BadInput, match=re.escape(message)):
        render_deployment("llama", "ml", spec_of(scaling(**fields)))  # the spec is invalid as a whole


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("autoscaling*.yaml")),
                         ids=lambda p: p.name)
def test_the_autoscaling_examples_render_valid_children(example):
    doc = validate_manifest(yaml.safe_load(example.read_text()))
    name, spec = doc["metadata"]["name"], doc["spec"]
    children = render_scaling(name, "default", spec_of(spec))
    assert children[PDB] is not None
    assert (children[HPA] is None) != (children[SCALED_OBJECT] is None)
    for child in (children[HPA], children[PDB]):
        if child is not None:
            kubernetes_validate.validate(child, kubernetes_validate.latest_version(),
                                         strict=True)
            typed(child)


def test_the_docs_show_what_the_examples_render():
    """docs/operator.md quotes the HPA and the ScaledObject the two examples render."""
    text = (EXAMPLES.parent / "docs" / "operator.md").read_text()
    docs = {}
    for example in ("autoscaling.yaml", "autoscaling-keda.yaml"):
        doc = yaml.safe_load((EXAMPLES / example).read_text())
        docs[example] = render_scaling(doc["metadata"]["name"], "team-a", spec_of(doc["spec"]))
    hpa = docs["autoscaling.yaml"][HPA]["spec"]
    assert f"metric: {{name: {hpa['metrics'][0]['pods']['metric']['name']}}}" in text
    assert f"averageValue: {hpa['metrics'][0]['pods']['target']['averageValue']}}}" in text
    [trigger] = docs["autoscaling-keda.yaml"][SCALED_OBJECT]["spec"]["triggers"]
    for key, value in trigger["metadata"].items():
        shown = f'"{value}"' if key == "threshold" else value
        assert f"{key}: {shown}\n" in text, key
