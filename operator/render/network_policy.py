"""The NetworkPolicy a service gets when the admin turns ``networkPolicy.enabled`` on
(``policy.Policy`` reads that Helm value, never the resource's spec): a pure function, as
``render``'s are."""

from __future__ import annotations

from typing import Any

from kvledger.operator.api.spec import ServiceSpec
from kvledger.operator.render.render import labels, selector_labels


def render_network_policy(name: str, namespace: str, spec: ServiceSpec,
                          allow_namespaces: tuple[str, ...] = ()) -> dict[str, Any]:
    """The NetworkPolicy named as the resource (with the admin's ``networkPolicy.enabled``):
    its pods admit, on the engine's port only, the pods of their own namespace and of
    ``allow_namespaces`` (a gateway's, the metrics scraper's), and nothing else. The
    kubelet's probes come from the node, which a NetworkPolicy does not filter."""
    sources: list[dict[str, Any]] = [{"podSelector": {}}]  # this namespace's pods
    sources += [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": other}}}
                for other in allow_namespaces]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {
            "podSelector": {"matchLabels": selector_labels(name)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": sources, "ports": [{"protocol": "TCP", "port": spec.serve.port}]}],
        },
    }
