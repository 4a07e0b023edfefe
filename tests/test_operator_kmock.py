"""The real operator, in-process, against kmock's Kubernetes emulator over HTTP.

One operator run is shared by the module; each test uses its own resource name.
"""

from __future__ import annotations

import pytest
import pytest_asyncio
from operator_harness import eventually, running_operator, service_manifest

from kvledger.operator.crd import API_VERSION, PLURAL
from kvledger.operator.render import LABEL

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


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster():
    async with running_operator(default_image="kvledger:test") as running:
        yield running


def condition(obj: dict | None, kind: str) -> dict:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return c
    return {}


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
                                      engine={"maxModelLen": 2048}, gpus=2)
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
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert engine["image"] == "kvledger:test"
    assert service["spec"]["selector"] == {LABEL: "alpha"}
    status = await eventually(lambda: (cluster.stored(API_VERSION, PLURAL, NS, "alpha") or {})
                              .get("status"))
    assert status["endpoint"] == "http://alpha.default.svc.cluster.local:8000"
    assert condition({"status": status}, "Ready")["status"] == "False"


async def test_preflight_refusal_lands_in_memory_budget_and_a_warning_event(cluster):
    await create_service(cluster, "big", memory={"limit": "40Gi"})
    await cluster.create("v1", "pods", pod("big", "big-1", {
        "phase": "Pending",
        "initContainerStatuses": [{
            "name": "preflight", "restartCount": 2,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 3, "reason": "Error", "message": REPORT}},
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
        "fits": False, "required": "83.9 GiB", "limit": "40.0 GiB", "shortBy": "43.9 GiB",
        "classes": {"weights": "70.0 GiB", "activations": "1.4 GiB", "kvCache": "10.0 GiB",
                    "cudaGraphs": "2.0 GiB", "context": "0.5 GiB"},
        "kv": {"numBlocks": 2048, "blockSize": 16}}
    [event] = await eventually(lambda: [e for e in cluster.events_for("big")
                                        if e.get("type") == "Warning"], what="warning event")
    assert event["reason"] == "DoesNotFit"
    assert event["message"] == REPORT.splitlines()[0]


async def test_crash_looping_engine_is_never_ready(cluster):
    await create_service(cluster, "crashy")
    ready_status = {"phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True"}],
                    "initContainerStatuses": [preflight_done(
        0, "fits: engine requires 1.2 GiB, limit is 40.0 GiB (38.8 GiB to spare)\n")],
                    "containerStatuses": [{"name": "engine", "ready": True, "restartCount": 0,
                                           "state": {"running": {}}}]}
    await cluster.create("v1", "pods", pod("crashy", "crashy-1", ready_status))

    def ready_reason():
        return condition(cluster.stored(API_VERSION, PLURAL, NS, "crashy"), "Ready").get("reason")

    await eventually(lambda: ready_reason() == "Ready", what="Ready=True")
    obj = cluster.stored(API_VERSION, PLURAL, NS, "crashy")
    assert condition(obj, "MemoryBudget")["status"] == "True"
    assert obj["status"]["plan"] == {"fits": True, "required": "1.2 GiB", "limit": "40.0 GiB",
                                     "spare": "38.8 GiB"}
    assert obj["status"]["readyReplicas"] == 1

    # A second replica crash-loops while the first still serves: not Ready.
    await cluster.create("v1", "pods", pod("crashy", "crashy-2", {
        "phase": "Running",
        "initContainerStatuses": [preflight_done(0)],
        "containerStatuses": [{
            "name": "engine", "ready": False, "restartCount": 4,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                         "message": "RuntimeError: CUDA error"}}}]}))
    await eventually(lambda: ready_reason() == "EngineCrashLoop", what="EngineCrashLoop")
    ready = condition(cluster.stored(API_VERSION, PLURAL, NS, "crashy"), "Ready")
    assert ready["status"] == "False"
    assert "exit 1" in ready["message"] and "CUDA error" in ready["message"]

    # Then it gets OOM-killed: the reason says so.
    await cluster.patch("v1", "pods", NS, "crashy-2", {"status": {"containerStatuses": [{
        "name": "engine", "ready": False, "restartCount": 5,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}},
        subresource="status")
    await eventually(lambda: ready_reason() == "OOMKilled", what="OOMKilled")
    # Events are posted asynchronously by kopf, after the status patch.
    await eventually(lambda: {e["reason"] for e in cluster.events_for("crashy")
                              if e.get("type") == "Warning"} >= {"EngineCrashLoop", "OOMKilled"},
                     what="EngineCrashLoop and OOMKilled warning events")


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
