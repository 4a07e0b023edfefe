"""The resource's labels and annotations reach its pods (as KServe's components get its
InferenceService's): labels on the Deployment or LeaderWorkerSet and the pod template,
never in the selector, never over the operator's own or spec.podLabels; annotations on the
pod template, less kubectl's, kopf's and the operator's own."""

from __future__ import annotations

from kvledger.operator.api.propagation import with_metadata
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.render.render import LABEL, render_deployment, selector_labels
from kvledger.operator.render.render_group import render_leader_worker_set

METADATA = {
    "name": "svc",
    "labels": {"team": "ml", "cost-centre": "42", "sidecar.istio.io/inject": "false",
               LABEL: "someone-else", "app.kubernetes.io/managed-by": "me", "tier": "meta"},
    "annotations": {
        "kubectl.kubernetes.io/last-applied-configuration": '{"spec": "..."}',
        "kopf.zalando.org/last-handled-configuration": "{}",
        "kvledger.dev/last-handled-configuration": "{}",
        "kvledger.dev/reconcile": "{}",
        "prometheus.io/scrape": "true", "owner": "meta"},
}


def _spec(**raw):
    return with_metadata(parse_spec({"model": {"path": "/m"}, **raw}), METADATA)


def test_labels_reach_the_deployment_and_pods_but_not_the_selector():
    spec = _spec(podLabels={"tier": "pod"}, podAnnotations={"owner": "pod"})
    deployment = render_deployment("svc", "ns", spec)
    template = deployment["spec"]["template"]["metadata"]
    assert deployment["spec"]["selector"] == {"matchLabels": selector_labels("svc")}
    for labels in (deployment["metadata"]["labels"], template["labels"]):
        assert labels["team"] == "ml" and labels["sidecar.istio.io/inject"] == "false"
        assert labels[LABEL] == "svc"  # the operator's own win: the Service selects by it
        assert labels["app.kubernetes.io/managed-by"] == "kvledger-operator"
    assert template["labels"]["tier"] == "pod"  # spec.podLabels over metadata.labels
    assert deployment["metadata"]["labels"]["tier"] == "meta"
    assert template["annotations"] == {"prometheus.io/scrape": "true", "owner": "pod"}


def test_a_group_gets_them_on_both_templates():
    lws = render_leader_worker_set("svc", "ns", _spec(nodes=2, gpus=1), key_secret="k")
    assert lws["metadata"]["labels"]["team"] == "ml"
    for role in ("leaderTemplate", "workerTemplate"):
        meta = lws["spec"]["leaderWorkerTemplate"][role]["metadata"]
        assert meta["labels"]["team"] == "ml" and meta["labels"][LABEL] == "svc"
        assert meta["annotations"] == {"prometheus.io/scrape": "true", "owner": "meta"}


def test_without_metadata_the_pods_are_as_before():
    plain = parse_spec({"model": {"path": "/m"}})
    assert with_metadata(plain, None) == plain
    template = render_deployment("svc", "ns", plain)["spec"]["template"]["metadata"]
    assert "annotations" not in template and "team" not in template["labels"]
