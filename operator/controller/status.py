"""Pure status logic: what the pods report -> the InferenceService's conditions.

Conditions (upserted by type): ``MemoryBudget`` (did the pre-flight approve the plan),
``Ready`` (does a replica of the current spec serve) and ``Degraded`` (does a pod fail
meanwhile): ``ready.py``. ``Ready`` is never True while the spec cannot be applied, the
pre-flight refused it or a hub model's download size cannot be had; a pod that
crash-loops, was OOM-killed, cannot pull its image, cannot be scheduled or cannot
download its model keeps it False only while no replica of the current spec is ready.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from kvledger.engine.planner.plan_line import PLAN_LINE_PREFIX, read_plan_line
from kvledger.engine.planner.report import format_size
from kvledger.operator.api.spec import ServiceSpec
from kvledger.operator.api.status_types import (
    Condition,
    DeploymentEntry,
    GroupPod,
    Json,
    ModelRecord,
    PodEntry,
    PodStatus,
    ServiceStatus,
)
from kvledger.operator.controller.pod_status import pod_ready, preflight_outcome
from kvledger.operator.controller.ready import degraded_verdict, ready_verdict, serving_count
from kvledger.operator.controller.rollout import rollout_of
from kvledger.operator.controller.startup import measured_start

MEMORY_BUDGET = "MemoryBudget"
READY = "Ready"
DEGRADED = "Degraded"
# Ready=False reasons that deserve a Warning event on the resource.
WARNING_REASONS = {"DoesNotFit", "PreflightBadInput", "PreflightFailed", "InvalidSpec",
                   "PolicyDenied",
                   "OOMKilled", "EngineCrashLoop", "ImagePullFailed", "Unschedulable",
                   "FetchFailed", "ModelUnavailable", "LeaderWorkerSetMissing",
                   "InferencePoolMissing", "KedaHttpAddOnMissing"}
NO_FIGURES = (f"(no plan figures: the pre-flight's message has no {PLAN_LINE_PREFIX.strip()} "
              "line; is its image older than the operator's?)")


def plan_status(figures: dict[str, Json]) -> dict[str, Json]:
    """The plan's figures (the pre-flight's plan line) in camelCase, plus human sizes for
    the printer columns and a reader: ``required``, ``limit``, and ``spare`` or ``shortBy``,
    written as the report writes them."""
    def camel(key: str) -> str:
        head, *rest = key.split("_")
        return head + "".join(part.capitalize() for part in rest)

    def convert(value: Json) -> Json:
        if isinstance(value, dict):
            return {camel(k): convert(v) for k, v in value.items()}
        if isinstance(value, list):
            return [convert(v) for v in value]
        return value

    out = cast(dict[str, Json], convert(figures))
    sizes: dict[str, Json] = {"required": figures.get("required_bytes"), "limit": figures.get("limit_bytes")}
    if figures.get("fits") and isinstance(sizes["required"], int) \
            and isinstance(sizes["limit"], int):
        sizes["spare"] = sizes["limit"] - sizes["required"]
    if figures.get("short_by_bytes"):
        sizes["shortBy"] = figures["short_by_bytes"]
    out.update({key: format_size(n) for key, n in sizes.items() if isinstance(n, int)})
    return out


def read_message(message: str, fits: bool) -> tuple[str, dict[str, Json]]:
    """(the ``MemoryBudget`` message, ``status.plan``) of a pre-flight's termination message
    (or log): the plan comes from its plan line, never from the report's words.

    The condition's message is the report for a refusal, its headline for a plan that fits.
    Without a plan line (an older image), ``status.plan`` is ``fits`` alone and the message
    says the figures are missing."""
    report, figures = read_plan_line(message)
    report = report.strip()
    said = report if not fits else (report.splitlines() or ["the plan fits"])[0]
    if figures is not None:
        return said, plan_status(figures)
    separator = " " if fits else "\n"  # a headline stays one line
    return f"{said}{separator}{NO_FIGURES}".strip(), {"fits": fits}


def upsert_condition(conditions: list[Condition], new: Condition, now: str) -> list[Condition]:
    """Replace the condition of ``new['type']``; keep its transition time if status held."""
    out: list[Condition] = []
    old: Condition = {}
    for condition in conditions:
        if condition.get("type") == new["type"]:
            old = condition
        else:
            out.append(condition)
    held = bool(old) and old.get("status") == new["status"]
    merged: Condition = {**new, "lastTransitionTime": old.get("lastTransitionTime", now)
                         if held else now}
    return [*out, merged]


def find_condition(conditions: list[Condition], kind: str) -> Condition | None:
    return next((c for c in conditions if c.get("type") == kind), None)


def compute_status(*, spec: ServiceSpec | None, generation: int | None,
                   old: ServiceStatus,
                   pods: list[PodStatus], spec_error: str | None,
                   endpoint: str, now: str, model: ModelRecord | None = None,
                   model_error: str | None = None, replicas: int = 0,
                   selector: str | None = None,
                   spec_reason: str = "InvalidSpec", ready_replicas: int | None = None,
                   group_pods: list[GroupPod] | None = None,
                   blocked: tuple[str, str] | None = None,
                   deployment: DeploymentEntry | None = None) -> ServiceStatus:
    """The whole desired status from the pods' statuses (level-based: history-free).

    ``old`` is the current status (for transition times and what pods no longer show);
    ``spec`` is the parsed spec, and ``spec_error`` is set instead (``spec`` None) when the spec can never work (``spec_reason``: InvalidSpec, or PolicyDenied
    for what the cluster admin's policy does not allow). For a hub model cached in an
    emptyDir, ``model`` is its download size just had (``status.model``, else the old one)
    and ``model_error`` why it could not be had: until ``status.model`` holds the spec's
    uri, ``Ready`` stays ``ModelUnavailable`` once it is.

    The scale subresource reads ``replicas`` (the pods the Deployment has, from its status)
    and ``selector`` (the pods' label selector, with which an HPA finds their metrics);
    ``readyReplicas`` counts the ready pods themselves, unless ``ready_replicas`` (a
    LeaderWorkerSet's groups with every pod ready) is given. ``deployment`` (its index
    entry) says which pods run the current spec (``rollout.py``: ``updatedReplicas``, and
    what ``Ready`` counts); without one the ready pods do.

    A multi-node service also shows ``group_pods`` (``status.pods``: ``group_pod_status``),
    and ``blocked`` (reason, message) is what keeps it from being applied at all
    (``LeaderWorkerSetMissing``; ``InferencePoolMissing`` for any service behind a pool,
    ``KedaHttpAddOnMissing`` for one behind KEDA's HTTP add-on):
    ``Ready=False`` with it, whatever pods there are.
    """
    conditions = list(old.get("conditions") or [])
    # url and address.url: where KServe's clients and scripts read an InferenceService's
    status: ServiceStatus = {"endpoint": endpoint, "url": endpoint,
                             "address": {"url": endpoint}, "replicas": replicas}
    if selector is not None:
        status["selector"] = selector
    if generation is not None:
        status["observedGeneration"] = generation

    def set_condition(kind: str, value: str, reason: str, message: str) -> None:
        nonlocal conditions
        condition: Condition = {"type": kind, "status": value, "reason": reason, "message": message}
        if generation is not None:
            condition["observedGeneration"] = generation
        conditions = upsert_condition(conditions, condition, now)

    if group_pods is not None:
        status["pods"] = group_pods
    elif "pods" in old:
        status["pods"] = None  # one node again: the merge patch removes the list
    if spec is None or spec_error is not None or blocked is not None:
        set_condition(READY, "False", *((spec_reason, spec_error or "") if blocked is None
                                        else blocked))
        status["conditions"], status["readyReplicas"] = conditions, 0
        return status

    refusal = _memory_budget(pods, old, status, set_condition)
    model_problem = _model_status(spec, model, model_error, old, status)
    ready_count = (sum(pod_ready(p) for p in pods) if ready_replicas is None
                   else ready_replicas)
    rollout = rollout_of(deployment, generation)
    if rollout is not None:
        status["updatedReplicas"] = rollout.updated
    startup = measured_start(pods)
    if startup is not None:  # else the last one measured stays (the patch names no startup)
        status["startup"] = startup
    if model_problem is not None:  # no pod of this spec can exist yet
        set_condition(READY, "False", "ModelUnavailable", model_problem)
    elif refusal is not None:
        set_condition(READY, "False", refusal[0], (refusal[1].splitlines() or [""])[0])
    elif rollout is not None and not rollout.current \
            and find_condition(conditions, READY) is not None:
        # This generation is not applied to the Deployment yet, or its controller has not
        # acted on it: whether its template changed (a rollout) or only its count (a
        # scale) cannot be told, so the last verdict stands, with its own
        # observedGeneration (older than the resource's: kubectl wait waits).
        pass
    else:
        serving = serving_count(pods, rollout, ready_replicas)
        set_condition(READY, *ready_verdict(spec, pods, rollout, serving, generation,
                                            {**old, **status}))
    set_condition(DEGRADED, *degraded_verdict(pods))
    status["conditions"], status["readyReplicas"] = conditions, ready_count
    return status


def group_pod_status(entries: list[PodEntry]) -> list[GroupPod]:
    """``status.pods`` of a multi-node service from the pod index's entries (``name``,
    ``status``, LWS's ``group`` and ``worker`` indexes): every pod of every group, each
    group's leader first, with its phase and readiness."""
    def order(entry: PodEntry) -> tuple[int, int, str]:
        return (int(entry.get("group") or 0), int(entry.get("worker") or 0), entry["name"])

    return [{"name": entry["name"], "group": int(entry.get("group") or 0),
             "role": "leader" if str(entry.get("worker") or "0") == "0" else "worker",
             "phase": entry["status"].get("phase", "Pending"),
             "ready": pod_ready(entry["status"])}
            for entry in sorted(entries, key=order)]


def _memory_budget(pods: list[PodStatus], old: ServiceStatus, status: ServiceStatus,
                   set_condition: Callable[[str, str, str, str], None]) -> tuple[str, str] | None:
    """``MemoryBudget`` (and ``status.plan``) from the pods' pre-flights: a refusal's
    reason and message when one refused (None when none did)."""
    outcomes = [o for o in (preflight_outcome(p) for p in pods) if o is not None]
    refusal = next((o for o in outcomes if o[0] != "Fits"), None)
    approval = next((o for o in outcomes if o[0] == "Fits"), None)
    if refusal is not None:
        reason, refused = refusal
        if reason == "DoesNotFit":
            refused, status["plan"] = read_message(refused, fits=False)
        set_condition(MEMORY_BUDGET, "False", reason, refused)
        refusal = (reason, refused)
    elif approval is not None:
        headline, status["plan"] = read_message(approval[1], fits=True)
        set_condition(MEMORY_BUDGET, "True", "Fits", headline)
    elif find_condition(list(old.get("conditions") or []), MEMORY_BUDGET) is None:
        set_condition(MEMORY_BUDGET, "Unknown", "Pending", "waiting for the pre-flight to run")
    if "plan" not in status and old.get("plan"):
        status["plan"] = old["plan"]
    return refusal


def _model_status(spec: ServiceSpec, model: ModelRecord | None, model_error: str | None,
                  old: ServiceStatus, status: ServiceStatus) -> str | None:
    """``status.model`` for a hub model, and why it cannot be had yet (None: it can, or
    the spec needs no download size): until ``status.model`` holds the spec's uri, a
    ``ModelUnavailable`` Ready stays so."""
    record = model or old.get("model")
    uri = spec.model.uri
    if uri is None:
        if "model" in old:
            status["model"] = None  # no hub model any more: the merge patch removes it
    elif record:
        status["model"] = record
    if not spec.model.needs_download_size:
        return None
    if model_error is not None:
        return model_error
    before = find_condition(list(old.get("conditions") or []), READY) or {}
    if (record or {}).get("uri") != uri and before.get("reason") == "ModelUnavailable":
        return before.get("message", "")  # not had since: still unavailable
    return None


def transition_events(old: list[Condition], new: list[Condition]) -> list[tuple[str, str, str]]:
    """(type, reason, one-line message) events for the transitions of ``Ready`` (Normal
    when True, Warning for a ``WARNING_REASONS`` one) and of ``Degraded`` to True or to
    another reason (Warning, unless Ready's event just said the same reason): a pod
    failing beside serving ones is told though Ready holds."""
    events: list[tuple[str, str, str]] = []
    for kind in (READY, DEGRADED):
        before, after = find_condition(old, kind) or {}, find_condition(new, kind)
        if after is None or (before.get("status"), before.get("reason")) == (
                after["status"], after.get("reason")):
            continue
        first_line = (after.get("message") or "").strip().splitlines()
        message = first_line[0] if first_line else after.get("reason", "")
        if kind == READY and after["status"] == "True":
            events.append(("Normal", "Ready", message))
        elif kind == DEGRADED and after["status"] != "True":
            continue  # healthy again: Ready's event (if any) says what serves
        elif after.get("reason") in WARNING_REASONS and not any(
                reason == after["reason"] for _, reason, _ in events):
            events.append(("Warning", after["reason"], message))
    return events
