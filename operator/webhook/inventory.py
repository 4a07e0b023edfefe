"""The cluster's GPUs as the admission webhook sees them: pure, from Node objects.

A node's GPUs are read from NVIDIA GPU feature discovery's labels (``nvidia.com/gpu.memory``,
the memory of ONE GPU in MiB, as NVML reports its total; ``nvidia.com/gpu.product``) and the
count a pod may request from its allocatable ``nvidia.com/gpu`` (what the device plugin
advertises, which the pods the operator renders request). A node whose memory is not known
does not decide a refusal (``GpuNode.unknown``): no GFD labels, a mixed-GPU node (GFD then
leaves the memory label out), or GPUs shared by time-slicing or MPS (``nvidia.com/gpu.replicas``
above 1: a pod gets part of a GPU, how much is not labelled).

Which nodes a pod may land on follows the scheduler's hard rules for the pod the operator
renders (``pod.placement``): its nodeSelector, required node affinity (matchExpressions on
labels, matchFields on ``metadata.name``) and tolerations against the NoSchedule and NoExecute
taints. Cordoned nodes count: being cordoned is a passing state, not a verdict on the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
MEMORY_LABEL = "nvidia.com/gpu.memory"
PRODUCT_LABEL = "nvidia.com/gpu.product"
COUNT_LABEL = "nvidia.com/gpu.count"
REPLICAS_LABEL = "nvidia.com/gpu.replicas"
MiB = 2**20
HARD_EFFECTS = ("NoSchedule", "NoExecute")


@dataclass(frozen=True)
class GpuNode:
    """One node: ``gpus`` a pod may request there, each GPU's ``memory_bytes`` (None:
    ``unknown`` says why), and what placement reads."""

    name: str
    labels: Mapping[str, str]
    taints: tuple[Mapping[str, Any], ...]
    gpus: int
    memory_bytes: int | None
    product: str
    unknown: str | None = None

    @property
    def shape(self) -> str:
        """``4 x 79.6 GiB (nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3)``."""
        memory = f"{self.memory_bytes / 2**30:.1f} GiB" if self.memory_bytes else "? GiB"
        return f"{self.gpus} x {memory} ({PRODUCT_LABEL}={self.product or '?'})"


def node_entry(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator's node index keeps of a Node: name, labels, taints, allocatable GPUs."""
    meta, spec, status = (body.get(key) or {} for key in ("metadata", "spec", "status"))
    allocatable = (status.get("allocatable") or {}).get(GPU_RESOURCE, "0")
    try:  # a device plugin's count is a whole number ("8")
        gpus = max(0, int(str(allocatable)))
    except ValueError:
        gpus = 0
    return {"name": meta.get("name", ""), "labels": dict(meta.get("labels") or {}),
            "taints": [dict(t) for t in spec.get("taints") or [] if isinstance(t, dict)],
            "gpus": gpus}


def gpu_node(entry: Mapping[str, Any]) -> GpuNode:
    """A node index entry as a GpuNode, its memory read from the GFD labels."""
    labels = entry.get("labels") or {}
    memory, unknown = None, None
    raw = labels.get(MEMORY_LABEL)
    if (_int_label(labels, REPLICAS_LABEL) or 1) > 1:
        unknown = f"its GPUs are shared ({REPLICAS_LABEL}={labels[REPLICAS_LABEL]})"
    elif raw is None:
        unknown = (f"a mixed-GPU node (no {MEMORY_LABEL} label)"
                   if labels.get(PRODUCT_LABEL) or labels.get(COUNT_LABEL)
                   else f"no GPU feature discovery labels ({MEMORY_LABEL})")
    elif (mib := _int_label(labels, MEMORY_LABEL)) is None or mib <= 0:
        unknown = f"{MEMORY_LABEL}={raw!r} is not a size in MiB"
    else:
        memory = mib * MiB
    return GpuNode(name=str(entry.get("name", "")), labels=labels,
                   taints=tuple(entry.get("taints") or ()), gpus=int(entry.get("gpus") or 0),
                   memory_bytes=memory, product=labels.get(PRODUCT_LABEL, ""), unknown=unknown)


def _int_label(labels: Mapping[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


def may_run_on(node: GpuNode, pod: Mapping[str, Any]) -> bool:
    """Whether the scheduler's hard rules let ``pod`` (a pod spec's placement fields) onto
    ``node``: nodeSelector, required node affinity and tolerations."""
    selector = pod.get("nodeSelector") or {}
    if any(node.labels.get(key) != value for key, value in selector.items()):
        return False
    required = (((pod.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    if required is not None and not any(
            _term_matches(term, node) for term in required.get("nodeSelectorTerms") or []):
        return False
    tolerations = pod.get("tolerations") or []
    return all(any(_tolerates(t, taint) for t in tolerations)
               for taint in node.taints if taint.get("effect") in HARD_EFFECTS)


def _term_matches(term: Mapping[str, Any], node: GpuNode) -> bool:
    """A node selector term: every expression holds (an empty term matches no node)."""
    expressions = [(e, node.labels) for e in term.get("matchExpressions") or []]
    expressions += [(e, {"metadata.name": node.name}) for e in term.get("matchFields") or []]
    return bool(expressions) and all(_expression_holds(e, values) for e, values in expressions)


def _expression_holds(expression: Mapping[str, Any], values: Mapping[str, str]) -> bool:
    key, operator = expression.get("key"), expression.get("operator")
    wanted = [str(v) for v in expression.get("values") or []]
    present = key in values
    value = values.get(key)
    if operator == "In":
        return present and value in wanted
    if operator == "NotIn":
        return not present or value not in wanted
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and len(wanted) == 1:
        try:
            have, bound = int(value), int(wanted[0])
        except ValueError:
            return False
        return have > bound if operator == "Gt" else have < bound
    return False


def _tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("operator") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint.get("key")
    return (toleration.get("key") == taint.get("key")
            and (toleration.get("value") or "") == (taint.get("value") or ""))


def candidates(entries: Iterable[Mapping[str, Any]], pod: Mapping[str, Any]) -> list[GpuNode]:
    """The nodes with GPUs that ``pod`` may land on, largest GPU memory first (unknown last)."""
    nodes = [gpu_node(entry) for entry in entries]
    chosen = [node for node in nodes if node.gpus > 0 and may_run_on(node, pod)]
    return sorted(chosen, key=lambda n: (n.memory_bytes is None, -(n.memory_bytes or 0),
                                         -n.gpus, n.name))
