"""A hostile author's pod labels and annotations (``render/pod_metadata_policy.py``): a
label of another Service's selector made the author's pods its endpoints, an annotation
took them out of the mesh. Only the keys the admin lists reach the pods; spec.podLabels
and spec.podAnnotations name theirs on purpose and are refused otherwise, the resource's
own metadata is left on the resource."""

from __future__ import annotations

import json

import pytest

from kvledger.operator.api.propagation import with_metadata
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.render.policy import Policy, PolicyDenied
from kvledger.operator.render.render import LABEL, render_deployment, render_service


def _spec(metadata=None, **raw):
    return with_metadata(parse_spec({"model": {"path": "/m"}, **raw}), metadata or {})


@pytest.mark.parametrize(("field", "values", "said"), [
    # Another Service's selector: its traffic comes to the author's engine.
    ("podLabels", {"app": "payments"}, "spec.podLabels app is not allowed"),
    # A NetworkPolicy's subject (its egress, another service's ingress).
    ("podLabels", {"role": "db-client", "team": "ml"}, "spec.podLabels role is not allowed"),
    ("podAnnotations", {"sidecar.istio.io/inject": "false"},
     "spec.podAnnotations sidecar.istio.io/inject is not allowed"),
    ("podAnnotations", {"traffic.sidecar.istio.io/excludeInboundPorts": "8000"},
     "spec.podAnnotations traffic.sidecar.istio.io/excludeInboundPorts is not allowed"),
    ("podAnnotations", {"sidecar.istio.io/userVolume": json.dumps(
        {"root": {"hostPath": {"path": "/"}}})},
     "spec.podAnnotations sidecar.istio.io/userVolume is not allowed"),
    ("podAnnotations", {"cni.projectcalico.org/ipAddrs": '["10.0.0.7"]'},
     "spec.podAnnotations cni.projectcalico.org/ipAddrs is not allowed"),
    ("podAnnotations", {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
     "spec.podAnnotations cluster-autoscaler.kubernetes.io/safe-to-evict is not allowed"),
])
def test_pod_labels_and_annotations_are_the_admins_choice(field, values, said):
    policy = Policy(pod_labels=("team",))
    with pytest.raises(PolicyDenied) as refused:
        policy.check(_spec(**{field: values}), "kvledger:test", name="svc", namespace="ns")
    message = str(refused.value)
    assert message.startswith(said)
    assert ("policy.podLabels" if field == "podLabels" else "policy.podAnnotations") in message


def test_listed_keys_and_prefixes_pass():
    policy = Policy(pod_labels=("team", "example.com/"), pod_annotations=("prometheus.io/",))
    spec = _spec(podLabels={"team": "ml", "example.com/cost": "42"},
                 podAnnotations={"prometheus.io/scrape": "true"})
    policy.check(spec, "kvledger:test", name="svc", namespace="ns")
    template = render_deployment("svc", "ns", policy.pod_metadata(spec))["spec"]["template"]
    assert template["metadata"]["labels"]["example.com/cost"] == "42"
    assert template["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}
    # a prefix is a prefix of keys, not of a longer domain
    assert not Policy(pod_labels=("example.com/",)).pod_metadata(
        _spec({"labels": {"example.com.evil/x": "1"}})).resource_labels


def test_the_resources_own_metadata_reaches_the_pods_only_where_listed():
    """kustomize's common labels on the resource are not refused; those the admin does not
    list stay on the resource. A label of another Service's selector never reaches a pod,
    so that Service's endpoints stay its own pods."""
    metadata = {"labels": {"app": "payments", "team": "ml"},
                "annotations": {"linkerd.io/inject": "disabled", "owner": "ml"}}
    policy = Policy(pod_labels=("team",), pod_annotations=("owner",))
    spec = _spec(metadata)
    policy.check(spec, "kvledger:test", name="svc", namespace="ns")
    deployment = render_deployment("svc", "ns", policy.pod_metadata(spec))
    template = deployment["spec"]["template"]["metadata"]
    assert "app" not in template["labels"] and "app" not in deployment["metadata"]["labels"]
    assert template["labels"]["team"] == "ml" and template["labels"][LABEL] == "svc"
    assert template["annotations"] == {"owner": "ml"}
    payments = {"app": "payments"}  # another Service's selector: not a subset of these labels
    assert not payments.items() <= template["labels"].items()
    assert render_service("svc", "ns", spec)["spec"]["selector"] == {LABEL: "svc"}


def test_the_lists_come_from_the_charts_json():
    policy = Policy.from_json(json.dumps({"podLabels": ["team"],
                                          "podAnnotations": ["prometheus.io/"]}))
    assert policy.pod_labels == ("team",) and policy.pod_annotations == ("prometheus.io/",)
    assert Policy.from_json(None).pod_labels == ()
