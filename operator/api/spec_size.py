"""How deep and how large an InferenceService's spec may be, checked before it is read.

The CRD types every field (operator/api/pod_schemas.json: Kubernetes' own schemas for
affinity and an env var's valueFrom), so the API server stores nothing deeper than
Kubernetes' own fields. A cluster may still hold the CRD of an older release, which kept
those two open (Helm never upgrades a CRD), and 1.5 MiB of a typed list is still half a
million values: this is the operator's own bound, whatever the CRD.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvledger.engine.errors import BadInput, plain

# How deep a spec may nest, and how many values it may hold. Kubernetes' own fields nest
# about ten levels (an affinity term's matchExpressions' values), and a large spec holds a
# few thousand values (env's 1024 variables). Every copy of the spec (copy.deepcopy,
# json.dumps) recurses once a level: a few hundred levels, where an older CRD kept a field
# open, raised RecursionError in the operator; and half a million values took each
# reconcile seconds of the event loop every tenant shares.
MAX_SPEC_DEPTH = 64
MAX_SPEC_VALUES = 20_000


def check_size(raw: Mapping[str, Any]) -> None:
    """BadInput naming the field of ``raw`` that nests deeper than ``MAX_SPEC_DEPTH`` or
    takes the spec past ``MAX_SPEC_VALUES`` values (a walk a level at a time: however deep
    the spec, no recursion; however large, it stops at the bound)."""
    count = 0
    for name, value in raw.items():
        level, depth = [value], 1
        while level:
            count += len(level)
            if count > MAX_SPEC_VALUES:
                raise BadInput(f"spec.{plain(str(name))}: the spec holds more than "
                               f"{MAX_SPEC_VALUES} values; a pod's fields take a few thousand")
            if depth > MAX_SPEC_DEPTH:
                raise BadInput(f"spec.{plain(str(name))} nests deeper than {MAX_SPEC_DEPTH} "
                               "levels: Kubernetes' own fields nest about ten")
            below: list[Any] = []
            for node in level:
                if isinstance(node, Mapping):
                    below += node.values()
                elif isinstance(node, list):
                    below += node
            level, depth = below, depth + 1
