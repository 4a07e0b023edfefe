"""``Ready`` and ``Degraded``: whether the resource serves its current spec, and whether a
pod of it fails meanwhile.

``Ready`` is what ``kubectl wait --for=condition=Ready`` waits for, so it answers one
question: does a replica of the current spec serve? True once one replica of the current
generation's pod template is ready (``rollout.py``: the Deployment's counts; the pods'
own readiness where there is none), False while none is, with the reason: a pod's
problem (``pod_status.pod_problem``), ``RollingOut`` (only pods of an earlier spec
serve), ``Starting``. A pod that fails beside serving ones does not flip it: that is
``Degraded`` (True, the failing pod's reason and message; False, ``Healthy``), so an
unschedulable scale-up or one crash-looping replica is reported without saying that the
replicas which answer do not.

At zero replicas (``spec.replicas: 0``) with KEDA's HTTP add-on in front, a request wakes
the service (the interceptor holds it, or answers 503 with a ``Retry-After``, while a
replica starts): ``Ready=True/ScaledToZero``, as a serverless platform says of a revision
scaled to zero. Without the add-on nothing wakes it: ``Ready=False/ScaledToZero``.
"""

from __future__ import annotations

from kvledger.operator.api.spec import ServiceSpec
from kvledger.operator.api.status_types import PodStatus, ServiceStatus
from kvledger.operator.controller.pod_status import past_oom, pod_problem, pod_ready
from kvledger.operator.controller.rollout import Rollout
from kvledger.operator.controller.startup import cold_start_seconds

# (status, reason, message) of a condition.
Verdict = tuple[str, str, str]


def serving_count(pods: list[PodStatus], rollout: Rollout | None,
                  ready_replicas: int | None) -> int:
    """Replicas of the current spec that are ready: the rollout's where the Deployment
    has counted them, else a LeaderWorkerSet's ready groups, else the ready pods."""
    if rollout is not None:
        return rollout.serving
    if ready_replicas is not None:
        return ready_replicas
    return sum(pod_ready(p) for p in pods)


def ready_verdict(spec: ServiceSpec, pods: list[PodStatus], rollout: Rollout | None,
                  serving: int, generation: int | None, status: ServiceStatus) -> Verdict:
    """``Ready`` of a workable spec whose pre-flight did not refuse it (those come first).
    ``status`` is the new status so far (``plan``, ``startup``: a wake's predicted time)."""
    replicas = spec.replicas
    problem = next((p for p in (pod_problem(pod) for pod in pods) if p is not None), None)
    if replicas == 0:
        return _scaled_to_zero(spec, status)
    if spec.sleep is not None:  # asleep, the pods answer 503 and are not ready
        return ("False", "Sleeping",
                f"spec.sleep is {spec.sleep}: {replicas - serving}/{replicas} pods asleep "
                f"(requests get 503 with a Retry-After); remove spec.sleep to wake them")
    if serving > 0:
        message = f"{serving}/{replicas} replicas ready"
        if rollout is not None and not rollout.done:
            message += (f"; rolling out generation {generation}: {rollout.updated}/"
                        f"{replicas} pods updated, {rollout.older} of an earlier spec left")
        return "True", "Ready", message + _oom_note(pods)
    if problem is not None:
        return ("False", *problem)
    if rollout is not None and (not rollout.current or rollout.older):
        older_ready = sum(pod_ready(p) for p in pods)
        return ("False", "RollingOut",
                f"rolling out generation {generation}: 0/{replicas} replicas of it ready "
                f"({rollout.updated} pods updated; {older_ready} ready pods of an earlier "
                f"spec serve meanwhile)")
    return "False", "Starting", f"0/{replicas} replicas ready"


def degraded_verdict(pods: list[PodStatus]) -> Verdict:
    """``Degraded``: True with the first failing pod's reason and message (and how many
    pods fail) while any pod cannot become ready on its own, else False/Healthy."""
    problems = [p for p in (pod_problem(pod) for pod in pods) if p is not None]
    if not problems:
        return "False", "Healthy", f"no pod fails (pods: {len(pods)})"
    reason, message = problems[0]
    return "True", reason, f"{len(problems)}/{len(pods)} pods failing; {message}"


def _scaled_to_zero(spec: ServiceSpec, status: ServiceStatus) -> Verdict:
    add_on = spec.autoscaling.http_add_on if spec.autoscaling is not None else None
    if add_on is None:
        return "False", "ScaledToZero", "spec.replicas is 0"
    seconds = cold_start_seconds({"status": status})
    start = (f"; a start takes about {seconds} s" if seconds is not None else "")
    held = ("answered 503 with a Retry-After while a replica starts"
            if add_on.cold_start == "retryAfter" else "held while a replica starts")
    return ("True", "ScaledToZero",
            f"0 replicas: a request to {', '.join(add_on.hosts)} through KEDA's HTTP add-on "
            f"wakes it (it is {held}){start}")


def _oom_note(pods: list[PodStatus]) -> str:
    """Said of recovered pods whose engine was OOM-killed last time: serving now, but its
    memory limit was once too small for what it was asked."""
    restarts = [r for r in (past_oom(p) for p in pods) if r is not None]
    if not restarts:
        return ""
    return (f"; the engine of {len(restarts)} ready pod(s) was OOM-killed before "
            f"(restarts: {max(restarts)}): spec.resources.limits.memory may be tight")
