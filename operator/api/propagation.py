"""The InferenceService's own labels and annotations, passed on to its pods.

As KServe copies an InferenceService's labels and annotations to its components, a label
set on the resource (a team, a cost centre, a mesh's opt-in) reaches the Deployment (or
LeaderWorkerSet) and the pod template, and an annotation the pod template. The precedence,
lowest first: the resource's metadata, then ``spec.podLabels``/``spec.podAnnotations``
(written for the pods, so more specific), then the operator's own labels, which the
selector and the Service depend on (``render.labels``). None goes into a selector: a
selector is immutable, and the pods are selected by the operator's label alone. Only the
keys the cluster admin allows reach the pods (``render/pod_metadata_policy.py``): a label
of another Service's selector would make them its endpoints.

Dropped, as never meant for a pod: kubectl's last-applied-configuration (the whole
manifest), kopf's own (``kopf.zalando.org/``) and the operator's (``kvledger.dev/``: kopf's
progress and diff-base, rewritten on every change, would roll the pods each time).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvledger.operator.api.resource import GROUP
from kvledger.operator.api.spec import ServiceSpec

DROPPED_KEYS = frozenset({"kubectl.kubernetes.io/last-applied-configuration"})
DROPPED_PREFIXES = ("kopf.zalando.org/", f"{GROUP}/")


def propagated(values: Any) -> dict[str, str]:
    """The labels or annotations of ``values`` a pod gets (string values only)."""
    if not isinstance(values, Mapping):
        return {}
    return {key: value for key, value in values.items()
            if isinstance(key, str) and isinstance(value, str) and key not in DROPPED_KEYS
            and not key.startswith(DROPPED_PREFIXES)}


def with_metadata(spec: ServiceSpec, metadata: Mapping[str, Any] | None) -> ServiceSpec:
    """``spec`` with the resource's ``metadata`` labels and annotations to propagate."""
    metadata = metadata or {}
    return dataclasses.replace(spec, resource_labels=propagated(metadata.get("labels")),
                               resource_annotations=propagated(metadata.get("annotations")))
