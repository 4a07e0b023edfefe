"""Pure status logic: pod statuses in, conditions and events out."""

from __future__ import annotations

from kvledger.operator.status import (
    compute_status,
    human_bytes,
    parse_report,
    plan_status,
    pod_problem,
    preflight_outcome,
    report_plan,
    transition_events,
    upsert_condition,
)

FITS = ("fits: engine requires 1.2 GiB, limit is 40.0 GiB (38.8 GiB to spare)\n"
        "  weights           0.9 GiB   (bf16, 16 layers)\n"
        "  KV cache          0.2 GiB   (max_model_len=1024 x max_num_seqs=8, bf16)\n"
        "  cuda context      1.0 GiB   (estimate)\n"
        "  KV pool: 512 blocks x 16 tokens, 32.0 KiB per block (8192 tokens)\n")


def preflight(code: int, message: str = "", *, last: bool = False) -> dict:
    terminated = {"exitCode": code, "reason": "Error", "message": message}
    if last:
        return {"name": "preflight", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": terminated}}
    return {"name": "preflight", "state": {"terminated": terminated}}


def engine(state: dict, last: dict | None = None, restarts: int = 0) -> dict:
    return {"name": "engine", "state": state, "lastState": last or {}, "restartCount": restarts}


def status_of(pods: list[dict], old: dict | None = None, **kw) -> dict:
    return compute_status(spec=kw.get("spec", {"replicas": 1}), generation=kw.get("generation", 3),
                          old=old or {}, pods=pods, spec_error=kw.get("spec_error"),
                          endpoint="http://x.ns.svc.cluster.local:8000", now=kw.get("now", "T1"),
                          model=kw.get("model"), model_error=kw.get("model_error"))


def cond(status: dict, kind: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_preflight_outcomes_by_exit_code():
    assert preflight_outcome({}) is None
    assert preflight_outcome({"initContainerStatuses": [preflight(0, FITS)]}) == ("Fits", FITS.strip())
    assert preflight_outcome({"initContainerStatuses": [preflight(3, "error: x", last=True)]}) \
        == ("DoesNotFit", "error: x")
    assert preflight_outcome({"initContainerStatuses": [preflight(2, "error: bad flag")]})[0] \
        == "PreflightBadInput"
    assert preflight_outcome({"initContainerStatuses": [preflight(1)]})[0] == "PreflightFailed"


def test_report_plan_reads_headline_classes_and_pool():
    assert report_plan(FITS, True) == {
        "fits": True, "required": "1.2 GiB", "limit": "40.0 GiB", "spare": "38.8 GiB",
        "classes": {"weights": "0.9 GiB", "kvCache": "0.2 GiB", "context": "1.0 GiB"},
        "kv": {"numBlocks": 512, "blockSize": 16}}
    assert report_plan("error: engine requires 2.0 GiB, limit is 1.0 GiB (short by 1.0 GiB)",
                       False) == {"fits": False, "required": "2.0 GiB", "limit": "1.0 GiB",
                                  "shortBy": "1.0 GiB"}


def test_plan_json_in_the_message_wins_and_is_camel_cased():
    message = '{"fits": true, "required_bytes": 1073741824, "limit_bytes": 2147483648, ' \
              '"classes": {"kv_cache": 5}}'
    first_line, plan = parse_report(message)
    assert first_line == "" and plan is not None
    assert plan_status(plan) == {"fits": True, "requiredBytes": 2**30, "limitBytes": 2**31,
                                 "classes": {"kvCache": 5}, "required": "1.0 GiB",
                                 "limit": "2.0 GiB"}
    assert human_bytes(512) == "512 B" and human_bytes(3 * 2**20) == "3.0 MiB"


def test_does_not_fit_sets_both_conditions_with_the_report():
    report = "error: engine requires 83.9 GiB, limit is 40.0 GiB (short by 43.9 GiB)\n  weights  70.0 GiB"
    status = status_of([{"initContainerStatuses": [preflight(3, report, last=True)]}])
    budget = cond(status, "MemoryBudget")
    assert (budget["status"], budget["reason"], budget["message"]) == (
        "False", "DoesNotFit", report)
    ready = cond(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "DoesNotFit")
    assert ready["message"] == report.splitlines()[0]
    assert status["plan"]["fits"] is False and status["observedGeneration"] == 3


def _ready_pod(extra_engine: dict | None = None) -> dict:
    return {"conditions": [{"type": "Ready", "status": "True"}],
            "initContainerStatuses": [preflight(0, FITS)],
            "containerStatuses": [extra_engine or engine({"running": {}})]}


def test_ready_only_without_crashing_pods():
    status = status_of([_ready_pod()])
    assert cond(status, "Ready")["status"] == "True" and status["readyReplicas"] == 1
    assert cond(status, "MemoryBudget")["reason"] == "Fits"
    crashing = {"initContainerStatuses": [preflight(0, FITS)], "containerStatuses": [engine(
        {"waiting": {"reason": "CrashLoopBackOff"}},
        {"terminated": {"exitCode": 1, "reason": "Error", "message": "boom\nRuntimeError: x"}},
        restarts=3)]}
    status = status_of([_ready_pod(), crashing])
    ready = cond(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "EngineCrashLoop")
    assert "exit 1" in ready["message"] and ready["message"].endswith("RuntimeError: x")


def test_oom_image_pull_and_unschedulable_reasons():
    oom = {"containerStatuses": [engine({"waiting": {"reason": "CrashLoopBackOff"}},
                                        {"terminated": {"exitCode": 137, "reason": "OOMKilled"}})]}
    assert pod_problem(oom)[0] == "OOMKilled"
    pull = {"initContainerStatuses": [{"name": "preflight", "state": {"waiting": {
        "reason": "ImagePullBackOff", "message": "Back-off pulling image \"kvledger:nope\""}}}]}
    reason, message = pod_problem(pull)
    assert reason == "ImagePullFailed" and "preflight" in message and "kvledger:nope" in message
    pending = {"conditions": [{"type": "PodScheduled", "status": "False",
                               "reason": "Unschedulable",
                               "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}
    reason, message = pod_problem(pending)
    assert reason == "Unschedulable" and "Insufficient nvidia.com/gpu" in message
    assert cond(status_of([pending]), "Ready")["reason"] == "Unschedulable"


def test_no_pods_keeps_the_last_budget_and_says_starting_or_scaled_to_zero():
    first = status_of([_ready_pod()])
    later = status_of([], old=first, now="T2")
    assert cond(later, "MemoryBudget") == cond(first, "MemoryBudget")
    assert later["plan"] == first["plan"]
    assert cond(later, "Ready")["reason"] == "Starting"
    assert cond(status_of([], spec={"replicas": 0}), "Ready")["reason"] == "ScaledToZero"
    fresh = status_of([])
    assert cond(fresh, "MemoryBudget")["status"] == "Unknown"


def test_invalid_spec_condition():
    status = status_of([], spec_error="memory.limit must be more than 0 bytes, got '0Gi'")
    ready = cond(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "memory.limit" in ready["message"]


def test_upsert_keeps_transition_time_while_status_holds():
    conditions = upsert_condition([], {"type": "Ready", "status": "False", "reason": "A"}, "T1")
    conditions = upsert_condition(conditions, {"type": "Ready", "status": "False",
                                               "reason": "B"}, "T2")
    assert conditions == [{"type": "Ready", "status": "False", "reason": "B",
                           "lastTransitionTime": "T1"}]
    conditions = upsert_condition(conditions, {"type": "Ready", "status": "True",
                                               "reason": "Ready"}, "T3")
    assert conditions[0]["lastTransitionTime"] == "T3"


def test_events_on_transitions_only():
    refused = status_of([{"initContainerStatuses": [preflight(
        3, "error: engine requires 2.0 GiB, limit is 1.0 GiB (short by 1.0 GiB)\n  more")]}])
    events = transition_events([], refused["conditions"])
    assert events == [("Warning", "DoesNotFit",
                       "error: engine requires 2.0 GiB, limit is 1.0 GiB (short by 1.0 GiB)")]
    assert transition_events(refused["conditions"], refused["conditions"]) == []
    ready = status_of([_ready_pod()], old=refused)
    assert transition_events(refused["conditions"], ready["conditions"]) == [
        ("Normal", "Ready", "1/1 replicas ready")]
    starting = status_of([])
    assert transition_events([], starting["conditions"]) == []  # Starting is not a warning


def fetch(code: int, message: str = "", *, last: bool = False, restarts: int = 0) -> dict:
    terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                  "message": message}
    if last:
        return {"name": "fetch", "restartCount": restarts,
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": terminated}}
    return {"name": "fetch", "restartCount": restarts, "state": {"terminated": terminated}}


def test_a_failed_fetch_is_fetch_failed_with_its_last_log_line():
    gated = ("Fetching 7 files...\nerror: hf://meta-llama/Llama-3.1-8B-Instruct is gated: "
             "set HF_TOKEN to a token that was granted access\n")
    pod = {"initContainerStatuses": [preflight(0, FITS), fetch(2, gated, last=True, restarts=3)]}
    reason, message = pod_problem(pod)
    assert reason == "FetchFailed"
    assert message == ("the fetch init container failed to download the model (exit 2, "
                       "restarts: 3): error: hf://meta-llama/Llama-3.1-8B-Instruct is gated: "
                       "set HF_TOKEN to a token that was granted access")
    status = status_of([pod])
    assert cond(status, "MemoryBudget")["reason"] == "Fits"  # the plan was approved first
    ready = cond(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "FetchFailed")
    assert transition_events([], status["conditions"])[0][:2] == ("Warning", "FetchFailed")
    assert pod_problem({"initContainerStatuses": [fetch(137)]})[1].endswith("restarts: 0)")
    done = {"conditions": [{"type": "Ready", "status": "True"}],
            "initContainerStatuses": [preflight(0, FITS), fetch(0, "fetched ...")],
            "containerStatuses": [engine({"running": {}})]}
    assert pod_problem(done) is None
    assert cond(status_of([done]), "Ready")["reason"] == "Ready"


HUB = {"model": {"uri": "hf://org/m"}, "replicas": 1}
SIZED = {"uri": "hf://org/m", "downloadBytes": 16 * 2**30}


def test_a_hub_model_that_cannot_be_sized_is_model_unavailable_until_it_is():
    error = "cannot size hf://org/m from the hub: hf://org/m: the hub is unreachable"
    unavailable = status_of([], spec=HUB, model_error=error)
    ready = cond(unavailable, "Ready")
    assert (ready["status"], ready["reason"], ready["message"]) == (
        "False", "ModelUnavailable", error)
    assert "model" not in unavailable
    assert transition_events([], unavailable["conditions"]) == [
        ("Warning", "ModelUnavailable", error)]
    # A pod event recomputes the status without asking the hub: still unavailable.
    again = status_of([], old=unavailable, spec=HUB, now="T2")
    assert cond(again, "Ready") == ready
    # Sized at last: the status keeps the size, and the pods speak again.
    sized = status_of([], old=again, spec=HUB, model=SIZED, now="T3")
    assert sized["model"] == SIZED and cond(sized, "Ready")["reason"] == "Starting"
    later = status_of([_ready_pod()], old=sized, spec=HUB, now="T4")
    assert later["model"] == SIZED and cond(later, "Ready")["reason"] == "Ready"
    # A new uri that cannot be sized is unavailable again, though old pods still serve.
    moved = {"model": {"uri": "hf://org/other"}, "replicas": 1}
    down = status_of([_ready_pod()], old=later, spec=moved, model_error="down", now="T5")
    assert cond(down, "Ready")["reason"] == "ModelUnavailable"
    assert cond(status_of([_ready_pod()], old=down, spec=moved), "Ready")["reason"] \
        == "ModelUnavailable"


def test_status_model_goes_with_the_hub_model():
    sized = status_of([], spec=HUB, model=SIZED)
    claimed = {"model": {**HUB["model"], "cache": {"persistentVolumeClaim": {"claimName": "c"}}}}
    assert status_of([], old=sized, spec=claimed)["model"] == SIZED  # kept, harmless
    local = status_of([], old=sized, spec={"model": {"path": "/m"}})
    assert local["model"] is None  # the merge patch removes it
    assert "model" not in status_of([], spec={"model": {"path": "/m"}})


def test_the_scale_subresource_fields_are_always_written():
    """``replicas`` (the Deployment's pods) and ``selector`` feed the scale subresource, an
    invalid spec included (an HPA still reads them); ``readyReplicas`` counts ready pods."""
    ready = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    for spec_error in (None, "gpus must be 0 or 1"):
        status = compute_status(spec={"replicas": 3}, generation=1, old={}, pods=[ready],
                                spec_error=spec_error, endpoint="http://x", now="T1",
                                replicas=2, selector="kvledger.dev/inferenceservice=x")
        assert (status["replicas"], status["selector"]) == (2, "kvledger.dev/inferenceservice=x")
        assert status["readyReplicas"] == (1 if spec_error is None else 0)
    assert status_of([])["replicas"] == 0  # no Deployment (yet): no pods
