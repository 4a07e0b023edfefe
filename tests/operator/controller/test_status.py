"""Pure status logic: pod statuses in, conditions and events out."""

from __future__ import annotations

import json

import pytest
from spec_helpers import spec_of

from kvledger.engine.cli import main as kvledger
from kvledger.engine.errors import EXIT_DOES_NOT_FIT
from kvledger.engine.planner.plan_line import PLAN_LINE_PREFIX
from kvledger.engine.planner.report import format_size
from kvledger.operator.controller.pod_status import pod_problem, preflight_outcome
from kvledger.operator.controller.status import (
    NO_FIGURES,
    compute_status,
    plan_status,
    read_message,
    transition_events,
    upsert_condition,
)

GIB = 2**30
REPORT = ("fits: engine requires 1.2 GiB, limit is 40.0 GiB (38.8 GiB to spare)\n"
          "  weights           0.9 GiB   (bf16, 16 layers)\n"
          "  KV cache          0.2 GiB   (max_model_len=1024 x max_num_seqs=8, bf16)\n"
          "  cuda context      1.0 GiB   (estimate)\n"
          "  KV pool: 512 blocks x 16 tokens, 32.0 KiB per block (8192 tokens)\n")
FIGURES = {"fits": True, "required_bytes": 1288490189, "limit_bytes": 40 * GIB,
           "short_by_bytes": 0, "classes": {"weights": 966367642, "kv_cache": 2**28},
           "kv": {"num_blocks": 512, "block_size": 16}}


def plan_line(figures: dict) -> str:
    return PLAN_LINE_PREFIX + json.dumps(figures, separators=(",", ":")) + "\n"


FITS = REPORT + plan_line(FIGURES)


def preflight(code: int, message: str = "", *, last: bool = False) -> dict:
    terminated = {"exitCode": code, "reason": "Error", "message": message}
    if last:
        return {"name": "preflight", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": terminated}}
    return {"name": "preflight", "state": {"terminated": terminated}}


def engine(state: dict, last: dict | None = None, restarts: int = 0) -> dict:
    return {"name": "engine", "state": state, "lastState": last or {}, "restartCount": restarts}


def status_of(pods: list[dict], old: dict | None = None, **kw) -> dict:
    return compute_status(spec=spec_of(kw.get("spec", {"model": {"path": "/m"}, "replicas": 1})),
                          generation=kw.get("generation", 3), old=old or {}, pods=pods,
                          spec_error=kw.get("spec_error"),
                          endpoint="http://x.ns.svc.cluster.local:8000", now=kw.get("now", "T1"),
                          model=kw.get("model"), model_error=kw.get("model_error"),
                          deployment=kw.get("deployment"))


def cond(status: dict, kind: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_preflight_outcomes_by_exit_code():
    assert preflight_outcome({}) is None
    assert preflight_outcome({"initContainerStatuses": [preflight(0, FITS)]}) == (
        "Fits", FITS.strip())
    assert preflight_outcome({"initContainerStatuses": [preflight(3, "error: x", last=True)]}) \
        == ("DoesNotFit", "error: x")
    assert preflight_outcome({"initContainerStatuses": [preflight(2, "error: bad flag")]})[0] \
        == "PreflightBadInput"
    assert preflight_outcome({"initContainerStatuses": [preflight(1)]})[0] == "PreflightFailed"


def test_the_plan_comes_from_the_plan_line_never_from_the_words():
    """The report's sizes are rounded words; status.plan is the plan line's exact bytes,
    even where the words say otherwise, with the human sizes written as the report does."""
    said, plan = read_message(REPORT.replace("1.2 GiB", "9.9 GiB") + plan_line(FIGURES), True)
    assert said == "fits: engine requires 9.9 GiB, limit is 40.0 GiB (38.8 GiB to spare)"
    assert plan == {"fits": True, "requiredBytes": 1288490189, "limitBytes": 40 * GIB,
                    "shortByBytes": 0, "classes": {"weights": 966367642, "kvCache": 2**28},
                    "kv": {"numBlocks": 512, "blockSize": 16},
                    "required": "1.2 GiB", "limit": "40.0 GiB", "spare": "38.8 GiB"}
    refused = {**FIGURES, "fits": False, "limit_bytes": GIB, "short_by_bytes": 288490189}
    assert plan_status(refused)["shortBy"] == format_size(288490189) == "0.3 GiB"
    assert "spare" not in plan_status(refused)


def test_without_a_plan_line_the_condition_says_the_figures_are_missing():
    """An older image's pre-flight (or a log cut before the line): status.plan has only
    fits, and the MemoryBudget message says why, after the report."""
    said, plan = read_message(REPORT, True)
    assert plan == {"fits": True}
    assert said == f"{REPORT.splitlines()[0]} {NO_FIGURES}"
    refusal = "error: engine requires 2.0 GiB, limit is 1.0 GiB (short by 1.0 GiB)\n  weights"
    status = status_of([{"initContainerStatuses": [preflight(3, refusal)]}])
    budget = cond(status, "MemoryBudget")
    assert budget["message"] == f"{refusal}\n{NO_FIGURES}"
    assert "kvledger-plan" in NO_FIGURES and status["plan"] == {"fits": False}
    assert cond(status, "Ready")["message"] == refusal.splitlines()[0]
    broken = REPORT + PLAN_LINE_PREFIX + '{"fits": tru\n'  # cut mid-line: no figures
    assert read_message(broken, True)[1] == {"fits": True}


def test_does_not_fit_sets_both_conditions_with_the_report():
    report = ("error: engine requires 83.9 GiB, limit is 40.0 GiB (short by 43.9 GiB)\n"
              "  weights          70.0 GiB   (bf16, 80 layers)\n")
    figures = {"fits": False, "required_bytes": 90085289574, "limit_bytes": 40 * GIB,
               "short_by_bytes": 90085289574 - 40 * GIB}
    status = status_of([{"initContainerStatuses": [
        preflight(3, report + plan_line(figures), last=True)]}])
    budget = cond(status, "MemoryBudget")
    assert (budget["status"], budget["reason"], budget["message"]) == (
        "False", "DoesNotFit", report.strip())
    ready = cond(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "DoesNotFit")
    assert ready["message"] == report.splitlines()[0]
    assert status["plan"] == {"fits": False, "requiredBytes": 90085289574,
                              "limitBytes": 40 * GIB, "shortByBytes": figures["short_by_bytes"],
                              "required": "83.9 GiB", "limit": "40.0 GiB", "shortBy": "43.9 GiB"}
    assert status["observedGeneration"] == 3


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    assert kvledger(["make-model", "tiny-llama", str(path)]) == 0
    return str(path)


def test_the_real_preflights_message_and_log_give_the_plans_figures(tiny_llama, tmp_path,
                                                                    capsys):
    """`kvledger preflight` as the pod runs it, on a built-in model that does not fit: its
    termination message (and its log, which the kubelet falls back to) give the status
    the plan's exact figures, and the conditions its report."""
    log, plan_out = tmp_path / "termination-log", tmp_path / "plan.json"
    capsys.readouterr()
    assert kvledger(["preflight", "--model", tiny_llama, "--device", "cpu", "--memory-limit",
                     "64MiB", "--max-model-len", "1024", "--plan-out", str(plan_out),
                     "--termination-log", str(log)]) == EXIT_DOES_NOT_FIT
    logged = capsys.readouterr().err
    planned = json.loads(plan_out.read_text())
    message = log.read_text()
    assert message == logged  # under 4096 bytes: nothing cut
    report, line = message.rsplit(PLAN_LINE_PREFIX, 1)
    assert report.startswith("error: engine requires ") and line.count("\n") == 1
    for kubelet_said in (message, logged):
        status = status_of([{"initContainerStatuses": [preflight(3, kubelet_said)]}])
        budget = cond(status, "MemoryBudget")
        assert (budget["reason"], budget["message"]) == ("DoesNotFit", report.strip())
        assert cond(status, "Ready")["message"] == report.splitlines()[0]
        plan = status["plan"]
        assert plan["fits"] is False and plan["limitBytes"] == 64 * 2**20
        assert (plan["requiredBytes"], plan["shortByBytes"]) == (
            planned["required_bytes"], planned["short_by_bytes"])
        assert plan["classes"] == {"weights": planned["classes"]["weights"],
                                   "activations": planned["classes"]["activations"],
                                   "kvCache": planned["classes"]["kv_cache"],
                                   "cudaGraphs": planned["classes"]["cuda_graphs"],
                                   "context": planned["classes"]["context"],
                                   "lora": 0}  # no --enable-lora
        # --max-num-seqs not given under a cap: refused as one 1024-token sequence
        assert plan["kv"]["numBlocks"] == planned["kv"]["num_blocks"] == 1024 // 16
        assert (plan["maxNumSeqs"], plan["maxNumSeqsSource"]) == (1, "kv-pool")
        assert (plan["required"], plan["limit"], plan["shortBy"]) == (
            format_size(planned["required_bytes"]), "64.0 MiB",
            format_size(planned["short_by_bytes"]))
        assert report.startswith(f"error: engine requires {plan['required']}, limit is "
                                 f"{plan['limit']} (short by {plan['shortBy']})")


def _ready_pod(extra_engine: dict | None = None) -> dict:
    return {"conditions": [{"type": "Ready", "status": "True"}],
            "initContainerStatuses": [preflight(0, FITS)],
            "containerStatuses": [extra_engine or engine({"running": {}})]}


def test_a_pod_failing_beside_a_serving_one_is_degraded_not_unready():
    """Ready is "a replica of the current spec serves": a crash-looping replica beside a
    ready one is Degraded (with its reason, and a Warning event), not Ready=False; alone,
    it is Ready=False with the same reason."""
    status = status_of([_ready_pod()])
    assert cond(status, "Ready")["status"] == "True" and status["readyReplicas"] == 1
    assert cond(status, "MemoryBudget")["reason"] == "Fits"
    assert (cond(status, "Degraded")["status"], cond(status, "Degraded")["reason"]) == (
        "False", "Healthy")
    crashing = {"initContainerStatuses": [preflight(0, FITS)], "containerStatuses": [engine(
        {"waiting": {"reason": "CrashLoopBackOff"}},
        {"terminated": {"exitCode": 1, "reason": "Error", "message": "boom\nRuntimeError: x"}},
        restarts=3)]}
    both = status_of([_ready_pod(), crashing], old=status, spec={"model": {"path": "/m"},
                                                                 "replicas": 2})
    ready, degraded = cond(both, "Ready"), cond(both, "Degraded")
    assert (ready["status"], ready["reason"], ready["message"]) == (
        "True", "Ready", "1/2 replicas ready")
    assert (degraded["status"], degraded["reason"]) == ("True", "EngineCrashLoop")
    assert degraded["message"].startswith("1/2 pods failing; engine container is crash-looping")
    assert "exit 1" in degraded["message"] and degraded["message"].endswith("RuntimeError: x")
    assert transition_events(status["conditions"], both["conditions"]) == [
        ("Warning", "EngineCrashLoop", degraded["message"])]
    alone = cond(status_of([crashing]), "Ready")
    assert (alone["status"], alone["reason"]) == ("False", "EngineCrashLoop")
    assert alone["message"].endswith("RuntimeError: x")


def test_an_unschedulable_scale_up_or_a_bad_image_leaves_the_serving_replicas_ready():
    """An HPA's scale-up waiting for the cluster autoscaler, or a pod that cannot pull its
    image, beside ready replicas: Ready holds, Degraded says why."""
    pending = {"conditions": [{"type": "PodScheduled", "status": "False",
                               "reason": "Unschedulable",
                               "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}
    pull = {"initContainerStatuses": [{"name": "preflight", "state": {"waiting": {
        "reason": "ImagePullBackOff", "message": "Back-off pulling image"}}}]}
    three = {"model": {"path": "/m"}, "replicas": 3}
    for failing, reason in ((pending, "Unschedulable"), (pull, "ImagePullFailed")):
        status = status_of([_ready_pod(), failing], spec=three)
        assert (cond(status, "Ready")["status"], cond(status, "Ready")["reason"]) == (
            "True", "Ready")
        assert (cond(status, "Degraded")["status"], cond(status, "Degraded")["reason"]) == (
            "True", reason)
        assert cond(status_of([failing], spec=three), "Ready")["reason"] == reason


def test_a_recovered_oom_killed_engine_is_ready_and_the_message_says_it_was_killed():
    """The kubelet keeps lastState.terminated (OOMKilled) until the next termination: a
    running, ready engine is judged by now; Ready's message keeps the OOM kill as a note."""
    recovered = _ready_pod(engine({"running": {"startedAt": "2026-01-01T00:01:00Z"}},
                                  {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
                                  restarts=1))
    assert pod_problem(recovered) is None
    killed = status_of([{"containerStatuses": [engine(
        {"waiting": {"reason": "CrashLoopBackOff"}},
        {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}, restarts=1)]}])
    assert cond(killed, "Ready")["reason"] == "OOMKilled"
    status = status_of([recovered], old=killed, now="T2")
    ready = cond(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "Ready")
    assert ready["message"].startswith("1/1 replicas ready; the engine of 1 ready pod(s) was "
                                       "OOM-killed before (restarts: 1)")
    assert cond(status, "Degraded")["status"] == "False"
    assert transition_events(killed["conditions"], status["conditions"])[0][:2] == (
        "Normal", "Ready")
    # Running again but not ready yet (loading after the kill): still the OOM kill.
    loading = {"containerStatuses": [engine(
        {"running": {}}, {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}, 2)]}
    assert pod_problem(loading)[0] == "OOMKilled"


def deployment(generation: int, applied: int, observed: int, replicas: int, updated: int,
               available: int) -> dict:
    return {"generation": generation, "applied": str(applied),
            "status": {"observedGeneration": observed, "replicas": replicas,
                       "updatedReplicas": updated, "availableReplicas": available}}


def test_ready_waits_for_a_replica_of_the_current_spec():
    """After a spec update the old pods' readiness is not Ready: until the Deployment holds
    the new generation (applied and observed) and one of its new pods is available, Ready
    is False/RollingOut; updatedReplicas counts the new pods."""
    two = {"model": {"path": "/m"}, "replicas": 2}
    pods = [_ready_pod(), _ready_pod()]
    before = status_of(pods, spec=two, generation=3,
                       deployment=deployment(5, 3, 5, 2, 2, 2))
    assert cond(before, "Ready")["message"] == "2/2 replicas ready"
    assert before["updatedReplicas"] == 2
    # Not applied yet, then not observed yet by the Deployment controller: a template
    # change or a scale cannot be told apart, so Ready stands as it was, for generation 3
    # (kubectl wait compares a condition's observedGeneration with the resource's).
    for entry in (deployment(5, 3, 5, 2, 2, 2), deployment(6, 4, 5, 2, 2, 2)):
        status = status_of(pods, old=before, spec=two, generation=4, deployment=entry)
        assert cond(status, "Ready") == cond(before, "Ready"), entry
        assert status["observedGeneration"] == 4 and status["updatedReplicas"] == 0
    stages = [  # (the Deployment's entry, Ready's status and reason, updatedReplicas)
        (deployment(6, 4, 6, 3, 1, 2), "False", "RollingOut", 1),  # new pod starting
        (deployment(6, 4, 6, 3, 1, 3), "True", "Ready", 1),  # new pod available
        (deployment(6, 4, 6, 2, 2, 2), "True", "Ready", 2),  # done
        (deployment(7, 4, 7, 3, 3, 2), "True", "Ready", 3),  # a scale: no rollout
    ]
    for entry, value, reason, updated in stages:
        status = status_of(pods, old=before, spec=two, generation=4, deployment=entry)
        ready = cond(status, "Ready")
        assert (ready["status"], ready["reason"], status["updatedReplicas"]) == (
            value, reason, updated), entry
        assert ready["observedGeneration"] == 4
    assert cond(status_of(pods, spec=two, generation=4,  # the first status: said
                          deployment=deployment(6, 4, 5, 2, 2, 2)), "Ready")["reason"] \
        == "RollingOut"
    rolling = cond(status_of(pods, spec=two, generation=4,
                             deployment=deployment(6, 4, 6, 3, 1, 3)), "Ready")["message"]
    assert rolling == ("1/2 replicas ready; rolling out generation 4: 1/2 pods updated, "
                       "2 of an earlier spec left")
    starting = cond(status_of(pods, spec=two, generation=4,
                              deployment=deployment(6, 4, 6, 3, 1, 2)), "Ready")["message"]
    assert starting.startswith("rolling out generation 4: 0/2 replicas of it ready")
    # A new pod that crash-loops while only old ones serve: its reason, not RollingOut.
    crashing = {"containerStatuses": [engine({"waiting": {"reason": "CrashLoopBackOff"}},
                                             {"terminated": {"exitCode": 1}})]}
    assert cond(status_of([*pods, crashing], spec=two, generation=4,
                          deployment=deployment(6, 4, 6, 3, 1, 2)), "Ready")["reason"] \
        == "EngineCrashLoop"
    # No status from the Deployment controller yet (no pods either): the pods count.
    fresh = {"generation": 1, "applied": "4", "status": {}}
    assert cond(status_of(pods, spec=two, generation=4, deployment=fresh),
                "Ready")["status"] == "True"


def test_scaled_to_zero_is_ready_behind_the_http_add_on_and_says_what_wakes_it():
    keda = {"model": {"path": "/m"}, "replicas": 0,
            "autoscaling": {"provider": "keda", "minReplicas": 0, "maxReplicas": 2,
                            "httpAddOn": {"hosts": ["m.ns.svc.cluster.local"]}}}
    bare = {"model": {"path": "/m"}, "replicas": 0}
    assert (cond(status_of([], spec=bare), "Ready")["status"],
            cond(status_of([], spec=bare), "Ready")["reason"]) == ("False", "ScaledToZero")
    ready = cond(status_of([], spec=keda), "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "ScaledToZero")
    assert ready["message"] == ("0 replicas: a request to m.ns.svc.cluster.local through "
                                "KEDA's HTTP add-on wakes it (it is held while a replica "
                                "starts)")
    measured = {"startup": {"readyAt": "T0", "seconds": {"total": 42}}}
    assert cond(status_of([], spec=keda, old=measured), "Ready")["message"].endswith(
        "; a start takes about 42 s")
    keda["autoscaling"]["httpAddOn"]["coldStart"] = "retryAfter"
    assert "answered 503 with a Retry-After" in cond(status_of([], spec=keda),
                                                     "Ready")["message"]


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
    assert cond(status_of([], spec={"model": {"path": "/m"}, "replicas": 0}),
                "Ready")["reason"] == "ScaledToZero"
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
        status = compute_status(spec=spec_of({"model": {"path": "/m"}, "replicas": 3}), generation=1,
                                old={}, pods=[ready],
                                spec_error=spec_error, endpoint="http://x", now="T1",
                                replicas=2, selector="kvledger.dev/inferenceservice=x")
        assert (status["replicas"], status["selector"]) == (2, "kvledger.dev/inferenceservice=x")
        assert status["readyReplicas"] == (1 if spec_error is None else 0)
    assert status_of([])["replicas"] == 0  # no Deployment (yet): no pods
