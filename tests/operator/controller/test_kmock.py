"""The real operator, in-process, against kmock's Kubernetes emulator over HTTP.

One operator run is shared by the module; each test uses its own resource name.
"""

from __future__ import annotations

import base64
import json

import kopf
import pytest
import pytest_asyncio
from operator_harness import condition, eventually, running_operator, service_manifest

from kvledger.engine.checkpoint.hub import repo as hub
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.plan_line import PLAN_LINE_PREFIX
from kvledger.operator.api.resource import API_VERSION, PLURAL
from kvledger.operator.cluster.hub_models import OPERATOR_LIMITS
from kvledger.operator.controller import handlers
from kvledger.operator.main import operator_memo
from kvledger.operator.render.pod import cache_size_limit
from kvledger.operator.render.policy import Policy
from kvledger.operator.render.render import LABEL

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")]

NS = "default"
REPORT = """\
error: engine requires 83.9 GiB, limit is 40.0 GiB (short by 43.9 GiB)
  weights          70.0 GiB   (bf16, 80 layers)
  activations       1.4 GiB   (peak @ max_num_batched_tokens=8192)
  KV cache         10.0 GiB   (max_model_len=32768 x max_num_seqs=1, bf16)
  cuda graphs       2.0 GiB   (estimate)
  runtime context   0.5 GiB   (estimate)
  KV pool: 2048 blocks x 16 tokens, 5.0 MiB per block (32768 tokens)
  --max-model-len 4096  (KV cache 1.3 GiB)
  limit: --memory-limit 40.0 GiB
"""
GIB = 2**30
# The figures the pre-flight writes after its report (the plan line); the status takes its
# sizes from them, not from the report's words.
REFUSED = {"fits": False, "required_bytes": 90085289574, "limit_bytes": 40 * GIB,
           "short_by_bytes": 90085289574 - 40 * GIB,
           "classes": {"weights": 70 * GIB, "activations": 1503238554, "kv_cache": 10 * GIB,
                       "cuda_graphs": 2 * GIB, "context": GIB // 2},
           "kv": {"num_blocks": 2048, "block_size": 16}}
FITS = {"fits": True, "required_bytes": 1288490189, "limit_bytes": 40 * GIB,
        "short_by_bytes": 0}


def plan_line(figures: dict) -> str:
    return f"{PLAN_LINE_PREFIX}{json.dumps(figures)}\n"


MIRROR = "https://hf-mirror.example.com"
# What the admin allows these tests (the operator's Helm values): a priority class, a
# hub mirror beside the public hub, and a few pod labels and annotations.
POLICY = Policy(priority_classes=("high",), hub_endpoints=("https://huggingface.co", MIRROR),
                pod_labels=("team", "tier"), pod_annotations=("note", "owner"))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster():
    async with running_operator(default_image="kvledger:test", policy=POLICY) as running:
        yield running


def pod(service: str, name: str, status: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {LABEL: service}},
            "spec": {"containers": [{"name": "engine", "image": "kvledger:test"}]},
            "status": status}


def preflight_done(code: int, message: str = "") -> dict:
    return {"name": "preflight", "ready": False, "restartCount": 0,
            "state": {"terminated": {"exitCode": code, "reason": "Completed" if code == 0
                                     else "Error", "message": message}}}


async def create_service(cluster, name: str, **spec) -> dict:
    await cluster.create(API_VERSION, PLURAL, service_manifest(name, NS, **spec))
    return await eventually(lambda: cluster.stored("apps/v1", "deployments", NS, name),
                            what=f"deployment {name}")


async def test_create_renders_owned_children_with_the_same_flags(cluster):
    deployment = await create_service(cluster, "alpha", memory={"limit": "40Gi"},
                                      engine={"maxModelLen": 2048}, gpus=1)
    service = await eventually(lambda: cluster.stored("v1", "services", NS, "alpha"))
    owner = cluster.stored(API_VERSION, PLURAL, NS, "alpha")
    for child in (deployment, service):
        [ref] = child["metadata"]["ownerReferences"]
        assert ref["uid"] == owner["metadata"]["uid"]
        assert ref["kind"] == "InferenceService" and ref["controller"] is True
    pod_spec = deployment["spec"]["template"]["spec"]
    [preflight], [engine] = pod_spec["initContainers"], pod_spec["containers"]
    flags = preflight["args"][:preflight["args"].index("--plan-out")]
    assert engine["args"][:len(flags)] == flags
    assert flags[flags.index("--memory-limit") + 1] == str(40 * 2**30)
    assert flags[flags.index("--max-model-len") + 1] == "2048"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert engine["image"] == "kvledger:test"
    assert service["spec"]["selector"] == {LABEL: "alpha"}
    status = await eventually(lambda: (cluster.stored(API_VERSION, PLURAL, NS, "alpha") or {})
                              .get("status"))
    assert status["endpoint"] == "http://alpha.default.svc.cluster.local:8000"
    # and where KServe's clients read it (`kubectl get isvc X -o jsonpath={.status.url}`)
    assert status["url"] == status["address"]["url"] == status["endpoint"]
    assert condition({"status": status}, "Ready")["status"] == "False"


async def test_preflight_refusal_lands_in_memory_budget_and_a_warning_event(cluster):
    await create_service(cluster, "big", memory={"limit": "40Gi"})
    await cluster.create("v1", "pods", pod("big", "big-1", {
        "phase": "Pending",
        "initContainerStatuses": [{
            "name": "preflight", "restartCount": 2,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 3, "reason": "Error",
                                         "message": REPORT + plan_line(REFUSED)}},
        }]}))

    def refused():
        obj = cluster.stored(API_VERSION, PLURAL, NS, "big")
        return obj if condition(obj, "MemoryBudget").get("reason") == "DoesNotFit" else None

    obj = await eventually(refused, what="MemoryBudget=False DoesNotFit")
    budget, ready = condition(obj, "MemoryBudget"), condition(obj, "Ready")
    assert budget["status"] == "False" and budget["message"] == REPORT.strip()
    assert (ready["status"], ready["reason"]) == ("False", "DoesNotFit")
    assert ready["message"] == REPORT.splitlines()[0]
    assert obj["status"]["plan"] == {
        "fits": False, "requiredBytes": 90085289574, "limitBytes": 40 * GIB,
        "shortByBytes": REFUSED["short_by_bytes"],
        "classes": {"weights": 70 * GIB, "activations": 1503238554, "kvCache": 10 * GIB,
                    "cudaGraphs": 2 * GIB, "context": GIB // 2},
        "kv": {"numBlocks": 2048, "blockSize": 16},
        "required": "83.9 GiB", "limit": "40.0 GiB", "shortBy": "43.9 GiB"}
    [event] = await eventually(lambda: [e for e in cluster.events_for("big")
                                        if e.get("type") == "Warning"], what="warning event")
    assert event["reason"] == "DoesNotFit"
    assert event["message"] == REPORT.splitlines()[0]


async def test_a_crash_looping_or_oom_killed_replica_is_degraded_beside_a_serving_one(cluster):
    await create_service(cluster, "crashy", replicas=2)
    ready_status = {"phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True"}],
                    "initContainerStatuses": [preflight_done(
        0, "fits: engine requires 1.2 GiB, limit is 40.0 GiB (38.8 GiB to spare)\n"
        + plan_line(FITS))],
                    "containerStatuses": [{"name": "engine", "ready": True, "restartCount": 0,
                                           "state": {"running": {}}}]}
    await cluster.create("v1", "pods", pod("crashy", "crashy-1", ready_status))

    def conditions():
        obj = cluster.stored(API_VERSION, PLURAL, NS, "crashy")
        return condition(obj, "Ready"), condition(obj, "Degraded")

    def ready_reason():
        return conditions()[0].get("reason")

    def degraded_reason():
        return conditions()[1].get("reason")

    await eventually(lambda: ready_reason() == "Ready", what="Ready=True")
    obj = cluster.stored(API_VERSION, PLURAL, NS, "crashy")
    assert condition(obj, "MemoryBudget")["status"] == "True"
    assert obj["status"]["plan"] == {"fits": True, "requiredBytes": 1288490189,
                                     "limitBytes": 40 * GIB, "shortByBytes": 0,
                                     "required": "1.2 GiB", "limit": "40.0 GiB",
                                     "spare": "38.8 GiB"}
    assert obj["status"]["readyReplicas"] == 1
    assert condition(obj, "Degraded")["status"] == "False"

    # A second replica crash-loops while the first still serves: Ready holds (a replica
    # serves the spec), Degraded says why the other does not.
    await cluster.create("v1", "pods", pod("crashy", "crashy-2", {
        "phase": "Running",
        "initContainerStatuses": [preflight_done(0)],
        "containerStatuses": [{
            "name": "engine", "ready": False, "restartCount": 4,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                         "message": "RuntimeError: CUDA error"}}}]}))
    await eventually(lambda: degraded_reason() == "EngineCrashLoop", what="EngineCrashLoop")
    ready, degraded = conditions()
    assert (ready["status"], ready["reason"]) == ("True", "Ready")
    assert degraded["status"] == "True"
    assert "exit 1" in degraded["message"] and "CUDA error" in degraded["message"]

    # Then it gets OOM-killed: the reason says so.
    await cluster.patch("v1", "pods", NS, "crashy-2", {"status": {"containerStatuses": [{
        "name": "engine", "ready": False, "restartCount": 5,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}},
        subresource="status")
    await eventually(lambda: degraded_reason() == "OOMKilled", what="OOMKilled")
    assert ready_reason() == "Ready"
    # Events are posted asynchronously by kopf, after the status patch; from the operator.
    warnings = await eventually(
        lambda: [e for e in cluster.events_for("crashy") if e.get("type") == "Warning"
                 and e["reason"] in {"EngineCrashLoop", "OOMKilled"}]
        if {e["reason"] for e in cluster.events_for("crashy")
            if e.get("type") == "Warning"} >= {"EngineCrashLoop", "OOMKilled"} else None,
        what="EngineCrashLoop and OOMKilled warning events")
    assert {e["source"]["component"] for e in warnings} == {handlers.REPORTING_COMPONENT}
    assert {e["reportingComponent"] for e in warnings} == {handlers.REPORTING_COMPONENT}

    # It restarts and serves: the kubelet keeps the OOM kill in lastState, but the pod
    # is healthy now, and Ready's message keeps the kill as a note.
    await cluster.patch("v1", "pods", NS, "crashy-2", {"status": {
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [{
            "name": "engine", "ready": True, "restartCount": 5, "state": {"running": {}},
            "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}},
        subresource="status")
    await eventually(lambda: degraded_reason() == "Healthy", what="Degraded=False")
    ready = conditions()[0]
    assert (ready["status"], ready["reason"]) == ("True", "Ready")
    assert ready["message"].startswith("2/2 replicas ready; the engine of 1 ready pod(s) was "
                                       "OOM-killed before (restarts: 5)")


async def test_ready_waits_for_the_rollout_of_a_spec_update(cluster):
    """`kubectl apply && kubectl wait --for=condition=Ready`: after a spec update, Ready
    is False/RollingOut until the Deployment holds the new generation and one of its new
    pods is available, whatever the old pods say."""
    await create_service(cluster, "wait", engine={"maxModelLen": 1024})
    await cluster.create("v1", "pods", pod("wait", "wait-1", {
        "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [{"name": "engine", "ready": True, "state": {"running": {}}}]}))

    async def controller_writes(observed: int, replicas: int, updated: int, available: int):
        live = cluster.stored("apps/v1", "deployments", NS, "wait")
        await cluster.patch("apps/v1", "deployments", NS, "wait", {"status": {
            "observedGeneration": observed, "replicas": replicas,
            "updatedReplicas": updated, "availableReplicas": available}},
            subresource="status")
        return live

    def ready_is(status: str, reason: str, generation: int):
        found = condition(cluster.stored(API_VERSION, PLURAL, NS, "wait"), "Ready")
        return (found.get("status"), found.get("reason"), found.get("observedGeneration")) \
            == (status, reason, generation)

    deployment = await controller_writes(1, 1, 1, 1)
    assert deployment["metadata"]["annotations"]["kvledger.dev/generation"] == "1"
    await eventually(lambda: ready_is("True", "Ready", 1), what="Ready=True, generation 1")
    # The API server bumps a Deployment's generation with the template the update below
    # brings; kmock bumps none, so the test does, first.
    await cluster.patch("apps/v1", "deployments", NS, "wait", {}, bump_generation=True)
    await cluster.patch(API_VERSION, PLURAL, NS, "wait",
                        {"spec": {"engine": {"maxModelLen": 4096}}}, bump_generation=True)
    # Not yet applied, then not yet acted on by the Deployment controller (its counts are
    # the old template's): Ready stands for generation 1, so kubectl wait still waits.
    await eventually(lambda: cluster.stored("apps/v1", "deployments", NS, "wait")["metadata"]
                     ["annotations"]["kvledger.dev/generation"] == "2", what="applied")
    await eventually(lambda: cluster.stored(API_VERSION, PLURAL, NS, "wait")["status"]
                     ["observedGeneration"] == 2, what="status of generation 2")
    assert ready_is("True", "Ready", 1)
    await controller_writes(2, 2, 1, 1)  # the new pod is starting; the old one serves
    await eventually(lambda: ready_is("False", "RollingOut", 2), what="RollingOut")
    assert cluster.stored(API_VERSION, PLURAL, NS, "wait")["status"]["updatedReplicas"] == 1
    await controller_writes(2, 2, 1, 2)  # the new pod is available
    await eventually(lambda: ready_is("True", "Ready", 2), what="Ready=True, generation 2")


async def test_spec_update_rolls_the_deployment(cluster):
    await create_service(cluster, "rolling", engine={"maxModelLen": 1024})
    await cluster.patch(API_VERSION, PLURAL, NS, "rolling",
                        {"spec": {"engine": {"maxModelLen": 4096}}}, bump_generation=True)

    def rolled():
        deployment = cluster.stored("apps/v1", "deployments", NS, "rolling")
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        return args[args.index("--max-model-len") + 1] == "4096"

    await eventually(rolled, what="deployment with --max-model-len 4096")
    init_args = cluster.stored("apps/v1", "deployments", NS, "rolling")[
        "spec"]["template"]["spec"]["initContainers"][0]["args"]
    assert init_args[init_args.index("--max-model-len") + 1] == "4096"
    await eventually(lambda: cluster.stored(API_VERSION, PLURAL, NS, "rolling")
                     ["status"].get("observedGeneration") == 2, what="observedGeneration 2")


async def test_delete_removes_children(cluster):
    await create_service(cluster, "doomed")
    await eventually(lambda: cluster.stored("v1", "services", NS, "doomed"))
    assert await cluster.delete(API_VERSION, PLURAL, NS, "doomed")
    await eventually(lambda: cluster.stored(API_VERSION, PLURAL, NS, "doomed") is None,
                     what="resource gone (finalizer released)")
    await eventually(lambda: cluster.stored("apps/v1", "deployments", NS, "doomed") is None
                     and cluster.stored("v1", "services", NS, "doomed") is None,
                     what="children deleted")


async def test_invalid_spec_is_a_permanent_invalid_spec_condition(cluster):
    # "0Gi" passes the schema's SIZE pattern, but a zero limit can never work.
    await cluster.create(API_VERSION, PLURAL, service_manifest("broken", NS,
                                                               memory={"limit": "0Gi"}))

    def invalid():
        obj = cluster.stored(API_VERSION, PLURAL, NS, "broken")
        return condition(obj, "Ready").get("reason") == "InvalidSpec" and obj

    obj = await eventually(invalid, what="InvalidSpec")
    assert "memory.limit" in condition(obj, "Ready")["message"]
    assert cluster.stored("apps/v1", "deployments", NS, "broken") is None
    events = await eventually(lambda: [e for e in cluster.events_for("broken")
                                       if e.get("reason") == "InvalidSpec"])
    assert len(events) == 1
    # kopf writes last-handled-configuration only once the creation is concluded: after a
    # retriable error it would not, and would call the handler again after a back-off.
    await eventually(lambda: "last-handled-configuration" in str(
        cluster.stored(API_VERSION, PLURAL, NS, "broken")["metadata"].get("annotations")),
        what="kopf finished the creation")
    assert len([e for e in cluster.events_for("broken") if e.get("reason") == "InvalidSpec"]) == 1
    assert cluster.stored("apps/v1", "deployments", NS, "broken") is None


async def test_more_gpus_than_a_node_has_is_an_invalid_spec(cluster):
    await cluster.create(API_VERSION, PLURAL, service_manifest("nine-gpus", NS, gpus=9))

    def invalid():
        obj = cluster.stored(API_VERSION, PLURAL, NS, "nine-gpus")
        return condition(obj, "Ready").get("reason") == "InvalidSpec" and obj

    obj = await eventually(invalid, what="InvalidSpec")
    assert condition(obj, "Ready")["message"].startswith(
        "gpus must be at most 8: kvledger serves a model on the GPUs of one node")
    assert cluster.stored("apps/v1", "deployments", NS, "nine-gpus") is None


async def test_fields_dropped_from_the_spec_leave_the_pod_template(cluster):
    await create_service(cluster, "placed", nodeSelector={"pool": "a"}, priorityClassName="high",
                         podLabels={"team": "x"}, podAnnotations={"note": "y"},
                         env=[{"name": "NCCL_DEBUG", "value": "INFO"}])
    # `kubectl rollout restart` annotates the template: not ours to remove.
    restart = {"kubectl.kubernetes.io/restartedAt": "2026-01-01T00:00:00Z"}
    await cluster.patch("apps/v1", "deployments", NS, "placed",
                        {"spec": {"template": {"metadata": {"annotations": restart}}}})
    await cluster.patch(API_VERSION, PLURAL, NS, "placed", {"spec": {
        "nodeSelector": None, "priorityClassName": None, "podLabels": None,
        "podAnnotations": None, "env": None}}, bump_generation=True)

    def dropped():
        deployment = cluster.stored("apps/v1", "deployments", NS, "placed")
        pod = deployment["spec"]["template"]["spec"]
        return deployment if "nodeSelector" not in pod else None

    template = (await eventually(dropped, what="nodeSelector removed"))["spec"]["template"]
    assert "priorityClassName" not in template["spec"]
    assert "team" not in template["metadata"]["labels"]
    assert template["metadata"]["labels"][LABEL] == "placed"
    assert template["metadata"]["annotations"] == restart
    assert [c["env"] for c in template["spec"]["containers"]] == [
        [{"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "false"}]]


GIB = 2**30
TOKEN = "hf_not_a_real_token_0123456789"


def token_secret(name: str, token: str = TOKEN) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NS},
            "data": {"token": base64.b64encode(f"{token}\n".encode()).decode()}}


def hub_model(uri: str, secret: str | None = None, **extra) -> dict:
    model = {"uri": uri, "name": "m", **extra}
    if secret is not None:
        model["tokenSecretRef"] = {"name": secret, "key": "token"}
    return model


async def test_hub_model_is_sized_once_from_the_hub_without_a_token(cluster, monkeypatch):
    asked = []

    def download_bytes(uri: str, *, endpoint: str | None = None, limits=None) -> int:
        asked.append((uri, endpoint))
        assert limits is OPERATOR_LIMITS  # what the operator reads of one model
        return 16 * GIB

    monkeypatch.setattr(hub, "download_bytes", download_bytes)
    deployment = await create_service(
        cluster, "hubby", model=hub_model("hf://org/m@v1", endpoint=MIRROR))
    assert asked == [("hf://org/m@v1", MIRROR)]
    pod = deployment["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["preflight", "fetch"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"]["emptyDir"] == {"sizeLimit": cache_size_limit(16 * GIB)}
    obj = await eventually(lambda: (cluster.stored(API_VERSION, PLURAL, NS, "hubby") or {})
                           .get("status", {}).get("model") and
                           cluster.stored(API_VERSION, PLURAL, NS, "hubby"))
    assert obj["status"]["model"] == {"uri": "hf://org/m@v1", "downloadBytes": 16 * GIB}

    # A change that keeps the uri re-renders from status.model: the hub is not asked again.
    await cluster.patch(API_VERSION, PLURAL, NS, "hubby",
                        {"spec": {"engine": {"maxModelLen": 4096}}}, bump_generation=True)

    def rolled():
        args = cluster.stored("apps/v1", "deployments", NS, "hubby")[
            "spec"]["template"]["spec"]["containers"][0]["args"]
        return "--max-model-len" in args

    await eventually(rolled, what="deployment with --max-model-len")
    assert len(asked) == 1


async def test_a_model_behind_a_token_is_sized_in_its_pod_and_no_secret_is_read(
        cluster, monkeypatch):
    """The operator never reads a Secret (whoever may create a resource would otherwise
    have every Secret of the namespace sent where the resource says): the token reaches
    the pods through a secretKeyRef, the hub is not asked, and the emptyDir has no limit."""

    def download_bytes(uri: str, **_) -> int:
        raise AssertionError("a model behind a token is sized in its pod")

    monkeypatch.setattr(hub, "download_bytes", download_bytes)
    await cluster.create("v1", "secrets", token_secret("hf-token"))
    deployment = await create_service(
        cluster, "gated", model=hub_model("hf://org/gated", "hf-token", endpoint=MIRROR))
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"]["emptyDir"] == {}
    assert ("GET", "deployments") in cluster.emulator.asked  # the log sees the operator's reads
    assert not [asked for asked in cluster.emulator.asked if asked[1] == "secrets"
                and asked[0] != "POST"]  # the test's own create only
    written = json.dumps([cluster.stored("apps/v1", "deployments", NS, "gated"),
                          cluster.stored(API_VERSION, PLURAL, NS, "gated"),
                          cluster.events_for("gated")])
    assert TOKEN not in written
    assert json.dumps({"secretKeyRef": {"key": "token", "name": "hf-token"}},
                      sort_keys=True)[1:-1] in json.dumps(json.loads(written), sort_keys=True)
    obj = await eventually(lambda: (cluster.stored(API_VERSION, PLURAL, NS, "gated") or {})
                           .get("status", {}).get("model") and
                           cluster.stored(API_VERSION, PLURAL, NS, "gated"))
    assert obj["status"]["model"] == {"uri": "hf://org/gated"}


async def test_a_hub_model_the_hub_cannot_size_is_model_unavailable_until_it_can(
        cluster, monkeypatch):
    monkeypatch.setattr(handlers, "HUB_RETRY_DELAY_S", 0.3)
    hub_down = {"now": True}

    def gated(uri: str, **_) -> int:
        raise BadInput(f"{uri} is gated: set HF_TOKEN to a token that has been granted access")

    monkeypatch.setattr(hub, "download_bytes", gated)
    await cluster.create(API_VERSION, PLURAL, service_manifest(
        "tokenless", NS, model=hub_model("hf://org/gated")))
    tokenless = await eventually(lambda: condition(cluster.stored(
        API_VERSION, PLURAL, NS, "tokenless"), "Ready").get("message"), what="tokenless")
    assert tokenless == ("cannot size hf://org/gated from the hub: hf://org/gated is gated: set "
                         "HF_TOKEN to a token that has been granted access (on the cluster: "
                         "spec.model.tokenSecretRef)")

    def download_bytes(uri: str, **_) -> int:
        if hub_down["now"]:
            raise BadInput(f"{uri}: cannot reach the hub at https://huggingface.co")
        return GIB

    monkeypatch.setattr(hub, "download_bytes", download_bytes)
    await cluster.create(API_VERSION, PLURAL, service_manifest(
        "public", NS, model=hub_model("hf://org/public")))

    def ready(message_part: str):
        def check():
            obj = cluster.stored(API_VERSION, PLURAL, NS, "public")
            ready = condition(obj, "Ready")
            return ready if message_part in ready.get("message", "") else None
        return check

    down = await eventually(ready("cannot reach the hub"), what="ModelUnavailable: hub down")
    assert (down["status"], down["reason"]) == ("False", "ModelUnavailable")
    assert down["message"] == ("cannot size hf://org/public from the hub: hf://org/public: "
                               "cannot reach the hub at https://huggingface.co")
    assert cluster.stored("apps/v1", "deployments", NS, "public") is None

    hub_down["now"] = False
    deployment = await eventually(lambda: cluster.stored("apps/v1", "deployments", NS, "public"),
                                  what="deployment once the hub answers")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model-cache"]["emptyDir"]["sizeLimit"] == cache_size_limit(GIB)
    await eventually(lambda: condition(cluster.stored(API_VERSION, PLURAL, NS, "public"),
                                       "Ready").get("reason") == "Starting", what="Starting")
    warnings = [e for e in cluster.events_for("public") if e.get("type") == "Warning"]
    assert [e["reason"] for e in warnings] == ["ModelUnavailable"]  # once, on the transition


async def test_the_resync_timer_sizes_a_hub_model_the_hub_could_not_size_before(cluster,
                                                                               monkeypatch):
    def down(uri: str, **_) -> int:
        raise BadInput(f"{uri}: cannot reach the hub")

    monkeypatch.setattr(hub, "download_bytes", down)
    await cluster.create(API_VERSION, PLURAL, service_manifest(
        "later", NS, model=hub_model("hf://org/later")))
    await eventually(lambda: condition(cluster.stored(API_VERSION, PLURAL, NS, "later"),
                                       "Ready").get("reason") == "ModelUnavailable",
                     what="ModelUnavailable")
    monkeypatch.setattr(hub, "download_bytes", lambda uri, **_: 3 * GIB)
    # What the 60 s timer runs, run now (the handler's retry is still 60 s away).
    obj = cluster.stored(API_VERSION, PLURAL, NS, "later")
    await handlers.resync(name="later", namespace=NS, spec=kopf.Spec(kopf.Body(obj)),
                          body=kopf.Body(obj), memo=operator_memo("kvledger:test", cluster.api),
                          pods_by_service={})
    deployment = cluster.stored("apps/v1", "deployments", NS, "later")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model-cache"]["emptyDir"]["sizeLimit"] == cache_size_limit(3 * GIB)
    obj = cluster.stored(API_VERSION, PLURAL, NS, "later")
    assert obj["status"]["model"] == {"uri": "hf://org/later", "downloadBytes": 3 * GIB}
    assert condition(obj, "Ready")["reason"] == "Starting"


async def test_the_measured_start_reaches_the_status_and_outlives_its_pod(cluster):
    await create_service(cluster, "timed")
    started = {"phase": "Running", "startTime": "2026-12-06T10:00:00Z",
               "conditions": [{"type": "Ready", "status": "True",
                               "lastTransitionTime": "2026-12-06T10:00:42Z"}],
               "initContainerStatuses": [{**preflight_done(0, plan_line(FITS)), "state": {
                   "terminated": {"exitCode": 0, "reason": "Completed",
                                  "message": plan_line(FITS),
                                  "startedAt": "2026-12-06T10:00:02Z",
                                  "finishedAt": "2026-12-06T10:00:05Z"}}}],
               "containerStatuses": [{"name": "engine", "ready": True, "restartCount": 0,
                                      "state": {"running": {
                                          "startedAt": "2026-12-06T10:00:06Z"}}}]}
    await cluster.create("v1", "pods", pod("timed", "timed-1", started))

    def startup():
        return (cluster.stored(API_VERSION, PLURAL, NS, "timed").get("status") or {}).get(
            "startup")

    measured = await eventually(startup, what="status.startup")
    assert measured == {"readyAt": "2026-12-06T10:00:42Z",
                        "seconds": {"total": 42, "preflight": 3, "engine": 36}}
    # The pod goes (scaled to zero, evicted): the last start measured stays on the resource.
    assert await cluster.delete("v1", "pods", NS, "timed-1")
    await eventually(lambda: condition(cluster.stored(API_VERSION, PLURAL, NS, "timed"),
                                       "Ready").get("reason") == "Starting",
                     what="Ready=False/Starting")
    assert startup() == measured


async def test_a_child_the_api_server_refuses_is_said_in_the_status(cluster, monkeypatch):
    """A child the API server refuses as written (a 422: an object it finds invalid) was
    retried every few seconds with nothing in the status; now Ready=False/ApplyFailed
    quotes the API server, and a refusal a retry may pass (a conflict) says nothing."""
    from kvledger.operator.cluster.kube import KubeApi, KubeError

    applied = KubeApi.apply

    async def apply(self, api_version, plural, body):
        if plural == "deployments" and body["metadata"]["name"] == "refused":
            raise KubeError(422, 'Deployment.apps "refused" is invalid: '
                            "spec.template.metadata.annotations: Too long")
        return await applied(self, api_version, plural, body)

    monkeypatch.setattr(KubeApi, "apply", apply)
    monkeypatch.setattr(handlers, "RETRY_DELAY_S", 0.3)
    await cluster.create(API_VERSION, PLURAL, service_manifest("refused", NS))
    ready = await eventually(lambda: condition(cluster.stored(
        API_VERSION, PLURAL, NS, "refused"), "Ready").get("reason") == "ApplyFailed"
        and condition(cluster.stored(API_VERSION, PLURAL, NS, "refused"), "Ready"),
        what="ApplyFailed")
    assert ready["status"] == "False" and ready["message"] == (
        'the API server refused a child: HTTP 422: Deployment.apps "refused" is invalid: '
        "spec.template.metadata.annotations: Too long")
    assert not KubeError(409, "conflict").refused  # a retry passes it: not the status's
    monkeypatch.setattr(KubeApi, "apply", applied)  # the child is taken: ApplyFailed goes
    await eventually(lambda: condition(cluster.stored(
        API_VERSION, PLURAL, NS, "refused"), "Ready").get("reason") != "ApplyFailed",
        what="ApplyFailed cleared")


async def test_the_resources_labels_and_annotations_reach_its_pods(cluster):
    """As KServe's components get their InferenceService's: labels on the Deployment and
    its pods (never the selector), filtered annotations on the pods; a label changed on
    the resource reaches them too."""
    manifest = service_manifest("labelled", NS, podLabels={"tier": "pod"})
    manifest["metadata"]["labels"] = {"team": "ml", LABEL: "not-this"}
    manifest["metadata"]["annotations"] = {
        "kubectl.kubernetes.io/last-applied-configuration": "{}", "owner": "ml-platform"}
    await cluster.create(API_VERSION, PLURAL, manifest)
    deployment = await eventually(  # CI's two busy workers once took over 10 s
        lambda: cluster.stored("apps/v1", "deployments", NS, "labelled"), what="deployment",
        timeout_s=30)
    template = deployment["spec"]["template"]["metadata"]
    assert deployment["metadata"]["labels"]["team"] == "ml"
    assert deployment["spec"]["selector"] == {"matchLabels": {LABEL: "labelled"}}
    assert template["labels"] | {"team": "ml", "tier": "pod", LABEL: "labelled"} == (
        template["labels"])
    assert template["annotations"] == {"owner": "ml-platform"}
    await cluster.patch(API_VERSION, PLURAL, NS, "labelled",
                        {"metadata": {"labels": {"team": "search"}}})
    await eventually(lambda: cluster.stored("apps/v1", "deployments", NS, "labelled")[
        "spec"]["template"]["metadata"]["labels"]["team"] == "search", what="label changed")
