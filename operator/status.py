"""Pure status logic: what the pods report -> the InferenceService's conditions.

Conditions (upserted by type): ``MemoryBudget`` (did the pre-flight approve the plan)
and ``Ready`` (can it serve). ``Ready`` is never True while a pod crash-loops, was
OOM-killed, cannot pull its image, cannot be scheduled or cannot download its model, nor
while a hub model's download size cannot be had.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvledger.engine.errors import EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT
from kvledger.operator.spec import hub_uri, needs_download_size

MEMORY_BUDGET = "MemoryBudget"
READY = "Ready"
IMAGE_PULL_REASONS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName",
                      "ErrImageNeverPull"}
# Ready=False reasons that deserve a Warning event on the resource.
WARNING_REASONS = {"DoesNotFit", "PreflightBadInput", "PreflightFailed", "InvalidSpec",
                   "OOMKilled", "EngineCrashLoop", "ImagePullFailed", "Unschedulable",
                   "FetchFailed", "ModelUnavailable"}
# The pre-flight report (engine/planner/report.py): a headline, then one row per class.
_HEADLINE_RE = re.compile(r"^(?:fits|error): engine requires ([\d.]+ \w+), limit is ([\d.]+ \w+)"
                          r"(?: \((?:([\d.]+ \w+) to spare|short by ([\d.]+ \w+))\))?")
_CLASS_ROWS = {"weights": "weights", "activations": "activations", "KV cache": "kvCache",
               "cuda graphs": "cudaGraphs", "cuda context": "context",
               "runtime context": "context"}
_ROW_RE = re.compile(r"^\s+(" + "|".join(_CLASS_ROWS) + r")\s+([\d.]+ \w+)")
_POOL_RE = re.compile(r"^\s+KV pool: (\d+) blocks x (\d+) tokens")
_UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_report(message: str) -> tuple[str, dict[str, Any] | None]:
    """(first line, plan JSON if the message carries one) of a pre-flight termination message."""
    text = (message or "").strip()
    plan = None
    for candidate in (text, *text.splitlines()):
        candidate = candidate.strip()
        if candidate.startswith("{"):
            try:
                parsed = json.loads(candidate)
            except ValueError:
                continue
            if isinstance(parsed, dict) and "fits" in parsed:
                plan = parsed
                break
    first_line = "" if text.startswith("{") else (text.splitlines() or [""])[0]
    return first_line, plan


def plan_status(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan JSON's numbers in camelCase, plus human sizes for the printer columns."""
    def camel(key: str) -> str:
        head, *rest = key.split("_")
        return head + "".join(part.capitalize() for part in rest)

    def convert(value: Any) -> Any:
        if isinstance(value, dict):
            return {camel(k): convert(v) for k, v in value.items()}
        if isinstance(value, list):
            return [convert(v) for v in value]
        return value

    out = convert(plan)
    if isinstance(plan.get("required_bytes"), int):
        out["required"] = human_bytes(plan["required_bytes"])
    if isinstance(plan.get("limit_bytes"), int):
        out["limit"] = human_bytes(plan["limit_bytes"])
    return out


def report_plan(report: str, fits: bool) -> dict[str, Any]:
    """The printer-column sizes and per-class sizes a pre-flight report shows.

    The termination message is the human report (at most 4096 bytes), not the plan JSON,
    so sizes are the report's rounded ones (``required``, ``limit``, ``classes``).
    """
    out: dict[str, Any] = {"fits": fits}
    classes: dict[str, str] = {}
    for line in report.splitlines():
        if (match := _HEADLINE_RE.match(line)) is not None:
            out["required"], out["limit"] = match.group(1), match.group(2)
            if match.group(3):
                out["spare"] = match.group(3)
            if match.group(4):
                out["shortBy"] = match.group(4)
        elif (match := _ROW_RE.match(line)) is not None:
            classes[_CLASS_ROWS[match.group(1)]] = match.group(2)
        elif (match := _POOL_RE.match(line)) is not None:
            out["kv"] = {"numBlocks": int(match.group(1)), "blockSize": int(match.group(2))}
    if classes:
        out["classes"] = classes
    return out


def _terminated(container: dict[str, Any] | None) -> dict[str, Any] | None:
    if not container:
        return None
    return ((container.get("state") or {}).get("terminated")
            or (container.get("lastState") or {}).get("terminated"))


def _waiting_reason(container: dict[str, Any] | None) -> str | None:
    return (((container or {}).get("state") or {}).get("waiting") or {}).get("reason")


def _containers(pod_status: dict[str, Any], key: str) -> dict[str, dict[str, Any]]:
    return {c.get("name"): c for c in pod_status.get(key) or []}


def preflight_outcome(pod_status: dict[str, Any]) -> tuple[str, str] | None:
    """(reason, termination message) of the pod's pre-flight, or None while it has not ended."""
    done = _terminated(_containers(pod_status, "initContainerStatuses").get("preflight"))
    if done is None:
        return None
    code, message = done.get("exitCode"), (done.get("message") or "").strip()
    if code == 0:
        return "Fits", message
    if code == EXIT_DOES_NOT_FIT:
        return "DoesNotFit", message or "the pre-flight refused the plan (exit 3)"
    if code == EXIT_BAD_INPUT:
        return "PreflightBadInput", message or "the pre-flight rejected its flags (exit 2)"
    return "PreflightFailed", message or f"the pre-flight exited {code} ({done.get('reason')})"


def pod_problem(pod_status: dict[str, Any]) -> tuple[str, str] | None:
    """(reason, message) when a pod cannot become ready on its own, else None."""
    for condition in pod_status.get("conditions") or []:
        if (condition.get("type") == "PodScheduled" and condition.get("status") == "False"
                and condition.get("reason") == "Unschedulable"):
            return "Unschedulable", f"pod cannot be scheduled: {condition.get('message', '')}"
    statuses = {**_containers(pod_status, "initContainerStatuses"),
                **_containers(pod_status, "containerStatuses")}
    for name, container in statuses.items():
        reason = _waiting_reason(container)
        if reason in IMAGE_PULL_REASONS:
            waiting = container["state"]["waiting"]
            return "ImagePullFailed", (f"container {name} cannot pull its image ({reason}): "
                                       f"{waiting.get('message', '')}").rstrip(": ")
    fetch = statuses.get("fetch")
    fetched = _terminated(fetch)
    if fetched is not None and fetched.get("exitCode") != 0:
        detail = [line for line in (fetched.get("message") or "").strip().splitlines() if line]
        return "FetchFailed", (
            f"the fetch init container failed to download the model (exit "
            f"{fetched.get('exitCode')}, restarts: {fetch.get('restartCount', 0)})"
            + (f": {detail[-1].strip()}" if detail else ""))
    engine = statuses.get("engine")
    done = _terminated(engine)
    if done is not None and done.get("reason") == "OOMKilled":
        return "OOMKilled", ("engine container was killed for exceeding its host-memory limit "
                             f"(OOMKilled, restarts: {engine.get('restartCount', 0)}); "
                             "raise spec.resources.limits.memory")
    if _waiting_reason(engine) == "CrashLoopBackOff":
        last = done or {}
        detail = (last.get("message") or "").strip().splitlines()
        return "EngineCrashLoop", (
            f"engine container is crash-looping (exit {last.get('exitCode')}, "
            f"{last.get('reason', 'Error')}, restarts: {engine.get('restartCount', 0)})"
            + (f": {detail[-1]}" if detail else ""))
    return None


def pod_ready(pod_status: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod_status.get("conditions") or [])


def upsert_condition(conditions: list[dict[str, Any]], new: dict[str, Any],
                     now: str) -> list[dict[str, Any]]:
    """Replace the condition of ``new['type']``; keep its transition time if status held."""
    out, old = [], None
    for condition in conditions:
        if condition.get("type") == new["type"]:
            old = condition
        else:
            out.append(condition)
    held = old is not None and old.get("status") == new["status"]
    merged = {**new, "lastTransitionTime": old.get("lastTransitionTime", now) if held else now}
    return [*out, merged]


def find_condition(conditions: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == kind), None)


def compute_status(*, spec: dict[str, Any], generation: int | None, old: dict[str, Any],
                   pods: list[dict[str, Any]], spec_error: str | None,
                   endpoint: str, now: str, model: dict[str, Any] | None = None,
                   model_error: str | None = None, replicas: int = 0,
                   selector: str | None = None) -> dict[str, Any]:
    """The whole desired status from the pods' statuses (level-based: history-free).

    ``old`` is the current status (for transition times and what pods no longer show);
    ``spec_error`` is set when the spec can never work. For a hub model cached in an
    emptyDir, ``model`` is its download size just had (``status.model``, else the old one)
    and ``model_error`` why it could not be had: until ``status.model`` holds the spec's
    uri, ``Ready`` stays ``ModelUnavailable`` once it is.

    The scale subresource reads ``replicas`` (the pods the Deployment has, from its status)
    and ``selector`` (the pods' label selector, with which an HPA finds their metrics);
    ``readyReplicas`` counts the ready pods themselves.
    """
    conditions = list(old.get("conditions") or [])
    status: dict[str, Any] = {"endpoint": endpoint, "replicas": replicas}
    if selector is not None:
        status["selector"] = selector
    if generation is not None:
        status["observedGeneration"] = generation

    def set_condition(kind: str, value: str, reason: str, message: str) -> None:
        nonlocal conditions
        condition = {"type": kind, "status": value, "reason": reason, "message": message}
        if generation is not None:
            condition["observedGeneration"] = generation
        conditions = upsert_condition(conditions, condition, now)

    if spec_error is not None:
        set_condition(READY, "False", "InvalidSpec", spec_error)
        status.update(conditions=conditions, readyReplicas=0)
        return status

    outcomes = [o for o in (preflight_outcome(p) for p in pods) if o is not None]
    refusal = next((o for o in outcomes if o[0] != "Fits"), None)
    approval = next((o for o in outcomes if o[0] == "Fits"), None)
    if refusal is not None:
        _, plan = parse_report(refusal[1])
        set_condition(MEMORY_BUDGET, "False", refusal[0], refusal[1])
        if refusal[0] == "DoesNotFit":
            status["plan"] = plan_status(plan) if plan else report_plan(refusal[1], False)
    elif approval is not None:
        first_line, plan = parse_report(approval[1])
        set_condition(MEMORY_BUDGET, "True", "Fits", first_line or "the plan fits")
        status["plan"] = plan_status(plan) if plan else report_plan(approval[1], True)
    elif find_condition(conditions, MEMORY_BUDGET) is None:
        set_condition(MEMORY_BUDGET, "Unknown", "Pending", "waiting for the pre-flight to run")
    if "plan" not in status and old.get("plan"):
        status["plan"] = old["plan"]

    record = model or old.get("model")
    if hub_uri(spec) is None:
        if "model" in old:
            status["model"] = None  # no hub model any more: the merge patch removes it
    elif record:
        status["model"] = record
    model_problem = None
    if needs_download_size(spec):
        before = find_condition(conditions, READY) or {}
        if model_error is not None:
            model_problem = model_error
        elif (record or {}).get("uri") != hub_uri(spec) \
                and before.get("reason") == "ModelUnavailable":
            model_problem = before.get("message", "")  # not had since: still unavailable

    ready_count = sum(pod_ready(p) for p in pods)
    replicas = spec.get("replicas", 1)
    problem = next((p for p in (pod_problem(pod) for pod in pods) if p is not None), None)
    if model_problem is not None:  # no pod of this spec can exist yet
        set_condition(READY, "False", "ModelUnavailable", model_problem)
    elif refusal is not None:
        set_condition(READY, "False", refusal[0], refusal[1].splitlines()[0] if refusal[1] else "")
    elif problem is not None:
        set_condition(READY, "False", *problem)
    elif replicas == 0:
        set_condition(READY, "False", "ScaledToZero", "spec.replicas is 0")
    elif ready_count > 0:
        set_condition(READY, "True", "Ready", f"{ready_count}/{replicas} replicas ready")
    else:
        set_condition(READY, "False", "Starting", f"0/{replicas} replicas ready")
    status.update(conditions=conditions, readyReplicas=ready_count)
    return status


def transition_events(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(type, reason, one-line message) events for the Ready condition's transitions."""
    before, after = find_condition(old, READY) or {}, find_condition(new, READY)
    if after is None or (before.get("status"), before.get("reason")) == (
            after["status"], after.get("reason")):
        return []
    first_line = (after.get("message") or "").strip().splitlines()
    message = first_line[0] if first_line else after.get("reason", "")
    if after["status"] == "True":
        return [("Normal", "Ready", message)]
    if after.get("reason") in WARNING_REASONS:
        return [("Warning", after["reason"], message)]
    return []
