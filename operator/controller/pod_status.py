"""What one pod's status says, as the kubelet writes it: how its pre-flight ended, why it
cannot become ready on its own (unschedulable, an image it cannot pull, a failed
download, OOM-killed, crash-looping), whether it is ready; its containers by name.
``status.py`` makes the resource's conditions of it, ``startup.py`` its start's times.

A container's ``lastState.terminated`` is kept by the kubelet until the next termination,
so it explains a container only while that one is not serving again: an engine that
runs and is ready now is judged by now (``engine_recovered``), and its last termination
is at most a note (``past_oom``)."""

from __future__ import annotations

from kvledger.engine.errors import EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT
from kvledger.operator.api.status_types import ContainerStatus, PodStatus, Terminated

IMAGE_PULL_REASONS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName",
                      "ErrImageNeverPull"}


def terminated(container: ContainerStatus | None) -> Terminated | None:
    """The container's termination now, else its last one (an init container waiting to
    run again: it has not succeeded since)."""
    if not container:
        return None
    return ((container.get("state") or {}).get("terminated")
            or (container.get("lastState") or {}).get("terminated"))


def engine_recovered(pod_status: PodStatus, engine: ContainerStatus | None) -> bool:
    """The engine container runs now and is ready (its own ``ready``, or the pod's Ready
    condition): whatever ended its previous run is history, not its state."""
    running = "running" in ((engine or {}).get("state") or {})
    return running and (bool((engine or {}).get("ready")) or pod_ready(pod_status))


def past_oom(pod_status: PodStatus) -> int | None:
    """The engine's restarts, when it was OOM-killed last time and has recovered since
    (running and ready again); None otherwise."""
    engine = containers(pod_status, "containerStatuses").get("engine")
    last = ((engine or {}).get("lastState") or {}).get("terminated") or {}
    if last.get("reason") != "OOMKilled" or not engine_recovered(pod_status, engine):
        return None
    return int((engine or {}).get("restartCount") or 1)


def _waiting_reason(container: ContainerStatus | None) -> str | None:
    return (((container or {}).get("state") or {}).get("waiting") or {}).get("reason")


def containers(pod_status: PodStatus, key: str) -> dict[str, ContainerStatus]:
    statuses: list[ContainerStatus] = pod_status.get(key) or []  # type: ignore[assignment]
    return {c.get("name", ""): c for c in statuses}


def preflight_outcome(pod_status: PodStatus) -> tuple[str, str] | None:
    """(reason, termination message) of the pod's pre-flight, or None while it has not ended."""
    done = terminated(containers(pod_status, "initContainerStatuses").get("preflight"))
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


def pod_problem(pod_status: PodStatus) -> tuple[str, str] | None:
    """(reason, message) when a pod cannot become ready on its own, else None."""
    for condition in pod_status.get("conditions") or []:
        if (condition.get("type") == "PodScheduled" and condition.get("status") == "False"
                and condition.get("reason") == "Unschedulable"):
            return "Unschedulable", f"pod cannot be scheduled: {condition.get('message', '')}"
    statuses = {**containers(pod_status, "initContainerStatuses"),
                **containers(pod_status, "containerStatuses")}
    for name, container in statuses.items():
        reason = _waiting_reason(container)
        if reason in IMAGE_PULL_REASONS:
            waiting = container["state"]["waiting"]
            return "ImagePullFailed", (f"container {name} cannot pull its image ({reason}): "
                                       f"{waiting.get('message', '')}").rstrip(": ")
    fetch = statuses.get("fetch") or {}
    fetched = terminated(fetch)
    if fetched is not None and fetched.get("exitCode") != 0:
        detail = [line for line in (fetched.get("message") or "").strip().splitlines() if line]
        return "FetchFailed", (
            f"the fetch init container failed to download the model (exit "
            f"{fetched.get('exitCode')}, restarts: {fetch.get('restartCount', 0)})"
            + (f": {detail[-1].strip()}" if detail else ""))
    engine = statuses.get("engine") or {}
    # A running, ready engine is fine now, whatever its lastState says (the kubelet keeps
    # that until the next termination: one OOM kill would otherwise be reported forever).
    done = None if engine_recovered(pod_status, engine) else terminated(engine)
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


def pod_ready(pod_status: PodStatus) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod_status.get("conditions") or [])
