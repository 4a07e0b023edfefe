"""Which labels and annotations an InferenceService's author may put on its pods: the
cluster admin's list (Helm values ``policy.podLabels`` and ``policy.podAnnotations``),
none by default.

A pod's labels decide what selects it, and nothing bounds who selects by what: a label
``app: payments`` made the author's pods endpoints of the namespace's ``payments`` Service
(its clients' requests, and their credentials, went to the author's engine), a subject of
a NetworkPolicy that opens egress or another service's ingress to ``app: payments``, a
member of another team's PodDisruptionBudget or InferencePool. Annotations change what
others do to the pod: a mesh's injection opt-out (``sidecar.istio.io/inject: "false"``,
``linkerd.io/inject: disabled``) or its traffic exclusions (``traffic.sidecar.istio.io/*``)
take the pod out of the mesh's mTLS and authorization; ``sidecar.istio.io/userVolume``
adds volumes (a hostPath) to the pod; Multus's ``k8s.v1.cni.cncf.io/networks`` and
Calico's ``cni.projectcalico.org/ipAddrs`` choose its networks and address;
``cluster-autoscaler.kubernetes.io/safe-to-evict: "false"`` keeps a node from scaling
down. Whoever may create Pods may write all of these; an author who may create only
InferenceServices may not, so no deny-list would stay complete: only the keys the admin
lists pass, an entry ending in ``/`` allowing every key under that prefix
(``example.com/``).

``spec.podLabels`` and ``spec.podAnnotations`` name their keys on purpose: one the list
does not allow is refused (``PolicyDenied``, naming the key and the Helm value). The
resource's own ``metadata.labels`` and ``metadata.annotations`` (kustomize's common labels,
a team's bookkeeping) are not refused: those the list does not allow stay on the resource
and do not reach the pods (``propagation``). The operator's own labels win over all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from kvledger.engine.errors import plain
from kvledger.operator.api.spec import ServiceSpec


def key_allowed(key: str, allowed: Iterable[str]) -> bool:
    """Whether ``allowed`` lists ``key``, or a prefix of it ending in ``/``."""
    return any(key == entry or (entry.endswith("/") and key.startswith(entry))
               for entry in allowed)


def refused_key(values: Mapping[str, str], allowed: tuple[str, ...]) -> str | None:
    """The first key of ``values`` (sorted) that ``allowed`` does not list, if any."""
    return next((key for key in sorted(values) if not key_allowed(key, allowed)), None)


def refusal(field: str, key: str, allowed: tuple[str, ...]) -> str:
    """The one-line refusal of ``spec.<field>`` key ``key``."""
    what = "label" if field == "podLabels" else "annotation"
    value = "policy.podLabels" if field == "podLabels" else "policy.podAnnotations"
    why = ("a pod's labels choose which Services, NetworkPolicies and budgets select it (a "
           "label of another service's selector makes these pods its endpoints)"
           if what == "label" else
           "a pod's annotations change what the mesh, the CNI and the autoscaler do to it "
           "(a sidecar opt-out leaves the mesh's mTLS and authorization)")
    return (f"spec.{field} {plain(key)} is not allowed: {why}, so pod {what}s are the cluster "
            f"admin's choice (the operator's Helm value {value}; allowed now: "
            f"{', '.join(allowed) or 'none'})")


def allowed_resource_metadata(spec: ServiceSpec, labels: tuple[str, ...],
                              annotations: tuple[str, ...]) -> ServiceSpec:
    """``spec`` with only the resource's own labels and annotations the admin allows."""
    return dataclasses.replace(
        spec,
        resource_labels={k: v for k, v in spec.resource_labels.items()
                         if key_allowed(k, labels)},
        resource_annotations={k: v for k, v in spec.resource_annotations.items()
                              if key_allowed(k, annotations)})
