"""status.startup: a pod's start measured from its status's timestamps, as the kubelet
writes them (the pod's startTime, its init containers' terminated startedAt/finishedAt,
the engine container's running startedAt, the Ready condition's lastTransitionTime)."""

from __future__ import annotations

from kvledger.operator.api.spec import parse_spec
from kvledger.operator.controller.startup import measured_start
from kvledger.operator.controller.status import compute_status


def pod(start: str, preflight: tuple[str, str], engine: str, ready: str | None,
        fetch: tuple[str, str] | None = None) -> dict:
    inits = [{"name": "preflight", "restartCount": 0, "state": {"terminated": {
        "exitCode": 0, "reason": "Completed", "startedAt": preflight[0],
        "finishedAt": preflight[1]}}}]
    if fetch is not None:
        inits.append({"name": "fetch", "restartCount": 0, "state": {"terminated": {
            "exitCode": 0, "reason": "Completed", "startedAt": fetch[0],
            "finishedAt": fetch[1]}}})
    conditions = [{"type": "PodScheduled", "status": "True",
                   "lastTransitionTime": "2026-12-06T10:00:00Z"}]
    if ready is not None:
        conditions.append({"type": "Ready", "status": "True", "lastTransitionTime": ready})
    return {"phase": "Running", "startTime": start, "conditions": conditions,
            "initContainerStatuses": inits,
            "containerStatuses": [{"name": "engine", "restartCount": 0,
                                   "state": {"running": {"startedAt": engine}}}]}


HUB_POD = pod("2026-12-06T10:00:01Z", ("2026-12-06T10:00:04Z", "2026-12-06T10:00:07Z"),
              "2026-12-06T10:01:20Z", "2026-12-06T10:01:52Z",
              fetch=("2026-12-06T10:00:08Z", "2026-12-06T10:01:19Z"))


def test_each_phase_of_a_ready_pod_is_measured_from_its_timestamps():
    assert measured_start([HUB_POD]) == {
        "readyAt": "2026-12-06T10:01:52Z",
        "seconds": {"total": 111, "preflight": 3, "fetch": 71, "engine": 32}}


def test_the_pod_that_became_ready_last_is_the_one_shown():
    older = pod("2026-12-06T09:00:00Z", ("2026-12-06T09:00:01Z", "2026-12-06T09:00:02Z"),
                "2026-12-06T09:00:03Z", "2026-12-06T09:00:30Z")
    newer = pod("2026-12-06T11:00:00+00:00", ("2026-12-06T11:00:01+00:00",
                                              "2026-12-06T11:00:05+00:00"),
                "2026-12-06T11:00:06+00:00", "2026-12-06T11:00:16+00:00")
    shown = measured_start([newer, older, HUB_POD])
    assert shown["readyAt"] == "2026-12-06T11:00:16+00:00"
    assert shown["seconds"] == {"total": 16, "preflight": 4, "engine": 10}


def test_a_pod_not_ready_since_its_engine_restarted_is_not_measured():
    # Ready still True from before the restart, the engine started after it: its start
    # to ready is not known yet.
    restarted = pod("2026-12-06T10:00:00Z", ("2026-12-06T10:00:01Z", "2026-12-06T10:00:02Z"),
                    "2026-12-06T10:05:00Z", "2026-12-06T10:00:30Z")
    starting = pod("2026-12-06T10:00:00Z", ("2026-12-06T10:00:01Z", "2026-12-06T10:00:02Z"),
                   "2026-12-06T10:00:03Z", None)
    assert measured_start([restarted, starting]) is None
    assert measured_start([]) is None


def test_what_the_kubelet_has_not_written_is_left_out_not_guessed():
    partial = pod("not a time", ("2026-12-06T10:00:01Z", "garbage"),
                  "2026-12-06T10:00:03Z", "2026-12-06T10:00:09Z")
    partial["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] = 0
    assert measured_start([partial])["seconds"] == {"engine": 6}
    failed_then_ran = pod("2026-12-06T10:00:00Z", ("2026-12-06T10:00:01Z",
                                                   "2026-12-06T10:00:02Z"),
                          "2026-12-06T10:00:03Z", "2026-12-06T10:00:09Z")
    failed_then_ran["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] = 3
    assert "preflight" not in measured_start([failed_then_ran])["seconds"]
    no_engine = {**HUB_POD, "containerStatuses": [{"name": "engine", "state": {
        "waiting": {"reason": "ContainerCreating"}}}]}
    assert measured_start([no_engine]) is None


def test_the_status_shows_the_measured_start_and_keeps_it_once_no_pod_is_left():
    spec = parse_spec({"model": {"path": "/m"}, "replicas": 1})
    status = compute_status(spec=spec, generation=1, old={}, pods=[HUB_POD],
                            spec_error=None, endpoint="", now="2026-12-06T10:02:00Z")
    assert status["startup"]["seconds"]["total"] == 111
    # Scaled to zero: nothing measured now, and the merge patch names no startup, so the
    # last one measured (how long a scale-up from zero takes) stays on the resource.
    zero = compute_status(spec=parse_spec({"model": {"path": "/m"}, "replicas": 0}),
                          generation=2, old=status, pods=[], spec_error=None,
                          endpoint="", now="2026-12-06T11:00:00Z")
    assert "startup" not in zero
