"""Does an InferenceService fit a node it may run on? The admission webhook's verdict, pure.

The planner is the pre-flight's (``plan_on``, given the engine flags the pods get and one
node's GPU memory as ``--device-memory``), so the webhook and the init container answer
alike for the same node: same fits, same figures (tests/operator/webhook/test_fit_corpus.py). The
webhook plans each GPU as wholly free, its total memory as GPU feature discovery labels it
(NVML's total, in whole MiB); the pre-flight sees what is actually free on the node it
lands on, so it may still refuse a run the webhook let through (another process holds
memory there), and never the reverse.

Messages name what a node offers (its GPUs' count, memory and product), never the node:
whoever may create a resource learns no more of the cluster than a refusal needs.

Only what is known refuses. A run is refused when it fits none of the nodes it may run on
and each of those nodes' GPUs is known, or when no such node has as many GPUs as one pod
asks for. Otherwise it is allowed, with a warning where the answer rests on what the webhook
cannot see: nodes whose GPUs are not labelled, a model it cannot read (a local folder, a
volume, a gated hub model), no GPU node it may run on at all (the pods stay Pending until
one comes), or nodes it fits only some of (the scheduler may pick one it does not fit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvledger.engine.planner.plan_line import truncate_utf8
from kvledger.engine.planner.record import Plan, Remedy
from kvledger.engine.planner.report import format_size, render_report
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.declare import settings_of
from kvledger.operator.api.spec import ServiceSpec
from kvledger.operator.render.pod import placement
from kvledger.operator.webhook.inventory import PRODUCT_LABEL, GpuNode, candidates

# What the API server shows of a refusal: the report fits, as in a pod's termination log.
MESSAGE_MAX_BYTES = 4096
TP_FLAG = "--tensor-parallel-size"


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    message: str = ""  # the refusal, when not allowed
    warnings: tuple[str, ...] = ()
    plans: Mapping[int, Plan] = field(default_factory=dict)  # GPU memory bytes -> plan


def judge(name: str, spec: ServiceSpec, nodes: Iterable[Mapping[str, Any]], *,
          plan_on: Callable[[int], Plan] | None, unread: str | None = None,
          refuse: bool = True) -> Verdict:
    """The verdict on ``spec`` (named ``name``) against the node index's ``nodes``.

    ``plan_on(memory_bytes)`` plans the run on one GPU of that memory; None when the model
    cannot be read here, ``unread`` then saying why. ``refuse`` False (the chart's
    ``webhook.mode: warn``) turns a refusal into a warning."""
    if spec.gpus == 0:
        return Verdict(True)  # the CPU: host memory, planned in the pod against its limit
    pod = placement(spec)
    found = candidates(nodes, pod)
    if not found:
        return Verdict(True, warnings=(
            f"no node {name} may run on offers nvidia.com/gpu now (its nodeSelector, affinity "
            "and tolerations): its pods stay Pending until one does",))
    enough = [node for node in found if node.gpus >= spec.gpus]
    if not enough:
        most = max(found, key=lambda node: node.gpus)
        return _refusal(
            f"{name} needs {spec.gpus} GPUs in one pod, and the most any node it may run on "
            f"offers is {most.gpus} ({most.shape}); to fit, set gpus: {most.gpus} "
            "or fewer (a pod runs on one node)", refuse)
    known = [node for node in enough if node.memory_bytes is not None]
    unknown = [node for node in enough if node.memory_bytes is None]
    if plan_on is None:
        return _unread(name, spec, known, unknown, unread, refuse)
    plans = {memory: plan_on(memory) for memory in {node.memory_bytes for node in known}}
    fitting = [node for node in known if plans[node.memory_bytes].fits]
    if fitting:
        short = _group_short(name, spec, fitting, unknown)
        if short is not None:
            return _refusal(short, refuse, plans) if not unknown else Verdict(
                True, warnings=(f"{short} (and the GPUs of {_count(unknown, 'node')} are "
                                "not known)",), plans=plans)
        return Verdict(True, warnings=_partial_fit(name, known, fitting, unknown), plans=plans)
    if unknown:
        said = (f"{name} does not fit the {_count(known, 'node')} whose GPUs are known "
                f"({_headline(plans[known[0].memory_bytes], known[0])}); " if known else "")
        return Verdict(True, plans=plans, warnings=(
            f"{said}the GPUs of {_count(unknown, 'node')} it may run on are not known "
            f"({_reasons(unknown)}): the pod's pre-flight checks the fit",))
    largest = known[0]
    plan = plans[largest.memory_bytes]
    gpus = f"{spec.gpus} of its GPUs" if spec.gpus > 1 else "one of its GPUs"
    message = (f"{name} does not fit any node it may run on: the largest offers "
               f"{largest.shape}; planned on {gpus}:\n{render_report(plan)}"
               f"{_spec_remedies(plan.remedies, largest.gpus)}")
    return _refusal(message, refuse, plans)


def _group_short(name: str, spec: ServiceSpec, fitting: list[GpuNode],
                 unknown: list[GpuNode]) -> str | None:
    """Why the nodes the model fits cannot hold one group of ``spec.nodes`` pods of
    ``spec.gpus`` GPUs each (LWS may put two pods of a group on one node with room for
    both), or None when they can."""
    room = sum(node.gpus // spec.gpus for node in fitting)
    if spec.nodes <= 1 or room >= spec.nodes:
        return None
    return (f"{name} needs {spec.nodes} pods of {spec.gpus} GPUs (nodes: {spec.nodes}) on "
            f"nodes it fits, and those it may run on hold {room}: {_count(fitting, 'node')} "
            f"of {fitting[0].shape}" + ("" if len({n.shape for n in fitting}) == 1
                                        else " and others"))


def _unread(name: str, spec: ServiceSpec, known: list[GpuNode], unknown: list[GpuNode],
            unread: str | None, refuse: bool) -> Verdict:
    """The verdict without the model: only the spec's own fields can refuse. A
    ``memory.limit`` above every known node's GPU memory fits none, whatever the model (a
    cap above the device's free memory does not fit: the pre-flight refuses it too)."""
    limit = spec.engine.memory_limit_bytes
    if limit is not None and known and not unknown and all(
            node.memory_bytes < limit for node in known):
        return _refusal(
            f"{name} does not fit any node it may run on: memory.limit "
            f"{format_size(limit)} is more than one GPU of the largest offers "
            f"({known[0].shape}); to fit, set memory.limit below "
            f"{format_size(known[0].memory_bytes)} (what one GPU holds, less what else "
            "runs there)", refuse)
    return Verdict(True, warnings=(f"{unread}: the pod's pre-flight checks the fit",))


def _refusal(message: str, refuse: bool, plans: Mapping[int, Plan] | None = None) -> Verdict:
    message = truncate_utf8(message.rstrip(), MESSAGE_MAX_BYTES)
    plans = plans or {}
    if refuse:
        return Verdict(False, message=message, plans=plans)
    return Verdict(True, warnings=(f"would be refused (webhook.mode warn): {message}",),
                   plans=plans)


def _headline(plan: Plan, node: GpuNode) -> str:
    per_gpu = " per GPU" if plan.tensor_parallel_size > 1 else ""
    return (f"the engine requires {format_size(plan.required_bytes)}{per_gpu}, the largest "
            f"node it may run on offers {node.shape}, a limit of "
            f"{format_size(plan.limit_bytes)}{per_gpu}")


def _partial_fit(name: str, known: list[GpuNode], fitting: list[GpuNode],
                 unknown: list[GpuNode]) -> tuple[str, ...]:
    """A warning when the scheduler may place the pods where they do not fit."""
    if len(fitting) == len(known):
        return ()
    products = sorted({node.product for node in fitting if node.product})
    pin = (f"; to land only where it fits, set nodeSelector {PRODUCT_LABEL}: {products[0]}"
           if len(products) == 1 else "")
    also = f" (and {_count(unknown, 'node')} whose GPUs are not known)" if unknown else ""
    return (f"{name} fits {len(fitting)} of the {_count(known, 'node')} it may run on{also}: "
            f"a pod scheduled on another one is refused by its pre-flight{pin}",)


def _reasons(nodes: list[GpuNode]) -> str:
    reasons: dict[str, int] = {}
    for node in nodes:
        reasons[node.unknown or ""] = reasons.get(node.unknown or "", 0) + 1
    return "; ".join(f"{count} with {why}" for why, count in reasons.items())


def _count(items: list[Any], noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def spec_field(flag: str) -> str | None:
    """The InferenceService field of an engine flag (``--max-model-len`` ->
    ``engine.maxModelLen``); ``gpus`` for the tensor-parallel size; None when it has none."""
    if flag == TP_FLAG:
        return "gpus"
    for _, declared in settings_of(EngineConfig):
        if declared.flag == flag and declared.crd is not None and declared.spec_name:
            return f"{declared.crd.section}.{declared.spec_name}"
    return None


def _spec_remedies(remedies: list[Remedy], node_gpus: int) -> str:
    """The planner's remedies as the resource's fields, on one line (empty when none)."""
    shown = []
    for remedy in remedies:
        changes = [(remedy.flag, remedy.value), *remedy.also]
        fields_ = [(spec_field(flag), value) for flag, value in changes]
        if any(name is None for name, _ in fields_):
            continue
        if remedy.flag == TP_FLAG and isinstance(remedy.value, int) and remedy.value > node_gpus:
            continue  # more GPUs than the node has: not a remedy on this cluster
        shown.append(", ".join(f"{name}: {'true' if value is None else value}"
                               for name, value in fields_))
    return f"to fit, in the InferenceService: {' | '.join(shown)}\n" if shown else ""
