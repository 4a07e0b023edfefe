"""A start measured from what the kubelet reports: ``status.startup``.

The plan predicts a start (``status.plan.timeToReady``: the weights' read, timed by the
pre-flight on the model's volume); this is what the newest ready pod took, from its own
status's timestamps, so a user and an autoscaler know how long a scale-up takes: from
the pod's start (``status.startTime``, the kubelet took it) to its ``Ready`` condition,
and within it each init container's run (``preflight``, and ``fetch`` for a hub model:
the download) and the engine's, from its container's start to ready (loading, placing,
profiling, capturing graphs, warming up: ``/v1/budget``'s ``time_to_ready`` has those
phases one by one). Timestamps are the API server's, to the second. A cold start's wait
(the interceptor's ``Retry-After`` at zero replicas) is the last start measured, else the
read the pre-flight predicted (``cold_start_seconds``).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from typing import Any

from kvledger.operator.api.resource import DEFAULT_START_S
from kvledger.operator.api.status_types import PodStatus, Startup
from kvledger.operator.controller.pod_status import containers

INIT_CONTAINERS = ("preflight", "fetch")
# A predicted read past this is not a start anyone waits for (and the pre-flight's figure
# comes from the tenant's pod: bounded, as everything read from there is).
MAX_PREDICTED_START_S = 24 * 3600


def measured_start(pods: list[PodStatus]) -> Startup | None:
    """The start of the pod that became ready last (None when no pod is ready since its
    engine container last started: a pod restarting is not measured until ready again)."""
    starts = [s for s in (_start(pod) for pod in pods) if s is not None]
    return max(starts, key=lambda s: s[0], default=(None, None))[1]


def _start(pod: PodStatus) -> tuple[datetime.datetime, Startup] | None:
    ready_at = next((c.get("lastTransitionTime") for c in pod.get("conditions") or []
                     if c.get("type") == "Ready" and c.get("status") == "True"), None)
    engine = containers(pod, "containerStatuses").get("engine")
    engine_at = ((engine or {}).get("state") or {}).get("running", {}).get("startedAt")
    ready, engine_start, pod_start = (_time(ready_at), _time(engine_at),
                                      _time(pod.get("startTime")))
    if ready is None or engine_start is None or engine_start > ready:
        return None
    seconds = {"engine": _seconds(engine_start, ready)}
    if pod_start is not None and pod_start <= engine_start:
        seconds["total"] = _seconds(pod_start, ready)
    for name in INIT_CONTAINERS:
        # This run's end only: a failed earlier run (lastState) timed nothing that counts.
        done = (containers(pod, "initContainerStatuses").get(name) or {}).get(
            "state", {}).get("terminated") or {}
        began, ended = _time(done.get("startedAt")), _time(done.get("finishedAt"))
        if done.get("exitCode") == 0 and began is not None and ended is not None \
                and began <= ended:
            seconds[name] = _seconds(began, ended)
    return ready, {"readyAt": str(ready_at), "seconds": seconds}


def _time(text: object) -> datetime.datetime | None:
    """An RFC 3339 timestamp as the API server writes them (``2026-12-06T13:41:32Z``);
    None for anything else."""
    if not isinstance(text, str):
        return None
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=datetime.UTC)


def _seconds(start: datetime.datetime, end: datetime.datetime) -> int:
    return round((end - start).total_seconds())


def cold_start_seconds(owner: Mapping[str, Any]) -> int | None:
    """A cold start's wait: the last start measured (``status.startup.seconds.total``);
    before one, the read the pre-flight predicted (``status.plan.timeToReady.predictedS
    .read``, whole seconds rounded up) where it is longer than ``DEFAULT_START_S`` (a
    start takes at least its read); None: neither (the default)."""
    status = owner.get("status") or {}
    total = ((status.get("startup") or {}).get("seconds") or {}).get("total")
    if isinstance(total, int) and not isinstance(total, bool):
        return total
    read = (((status.get("plan") or {}).get("timeToReady") or {}).get("predictedS")
            or {}).get("read")
    if isinstance(read, int | float) and not isinstance(read, bool) \
            and DEFAULT_START_S < read < MAX_PREDICTED_START_S:
        return math.ceil(read)
    return None
