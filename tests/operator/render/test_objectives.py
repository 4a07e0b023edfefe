"""The router's InferenceObjectives behind an InferencePool: the operator writes the pool's
objectives (name and priority) into the ConfigMap NAME-objectives, which the engines read as
``--objectives-file`` with ``x-gateway-inference-objective`` believed from the admin's gateway
addresses alone. Every objective given here is valid, strictly, against the vendored CRD
(GAIE v1.5.0's, the schema the router still serves); the file the operator writes is read
back by the engine's own reader; the real operator keeps it current on kmock's emulator
as objectives come and go, and writes an empty one where the CRD is not served."""

from __future__ import annotations

import asyncio

import jsonschema
import pytest
import yaml
from operator_harness import eventually, running_operator, service_manifest
from spec_helpers import spec_of
from vendored_crds import DATA, check_release, strict_version_schema

from kvledger.engine.cli import build_parser
from kvledger.engine.server.objectives import parse_objectives
from kvledger.operator.api.resource import API_VERSION, OBJECTIVES_FILE, OBJECTIVES_KEY, PLURAL
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.render.gateway import (
    INFERENCE_OBJECTIVES,
    OBJECTIVE_API_VERSION,
    pool_objectives,
    render_objectives_config_map,
)
from kvledger.operator.render.gateway_wiring import GatewayWiring
from kvledger.operator.render.policy import Policy
from kvledger.operator.render.render import render_deployment

CRD = DATA / "gaie" / "inference.networking.x-k8s.io_inferenceobjectives.yaml"
SCHEMA = strict_version_schema(CRD, "v1alpha2")
MODEL = {"path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "models"},
                                         "mountPath": "/models"}}
POOLED = {"model": MODEL, "inferencePool": {"endpointPicker": {"name": "epp"}}}
PEERS = GatewayWiring(peers=("10.8.0.0/16",))


def objective(name: str, pool: str, priority: int | None = None, namespace: str = "default",
              **ref) -> dict:
    spec: dict = {"poolRef": {"name": pool, **ref}}
    if priority is not None:
        spec["priority"] = priority
    body = {"apiVersion": OBJECTIVE_API_VERSION, "kind": "InferenceObjective",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}
    jsonschema.validate(body, SCHEMA)  # as the API server would admit it
    return body


def test_the_vendored_crd_is_the_release_it_names():
    check_release(CRD, "v1.5.0")


def test_the_pools_objectives_are_its_own_by_name():
    listed = [objective("critical", "chat", 10), objective("batch", "chat", -10),
              objective("plain", "chat"), objective("theirs", "other-pool", 100),
              objective("imported", "chat", 50, group="inference.networking.x-k8s.io",
                        kind="InferencePoolImport"),
              objective("huge", "chat", 2**40)]  # v1.5.0's CRD admits it; int32 since
    assert pool_objectives(listed, "chat") == [
        {"name": "batch", "priority": -10}, {"name": "critical", "priority": 10},
        {"name": "plain", "priority": 0}]


def test_a_namespace_with_too_many_objectives_still_gets_a_file_the_api_takes():
    """A ConfigMap holds 1 MiB: past MAX_OBJECTIVES (the first by name kept), the file would
    be refused, and every reconcile of the service with it."""
    from kvledger.operator.render.gateway import MAX_OBJECTIVES

    listed = [objective(f"o{i:05d}-" + "x" * 240, "chat", i) for i in range(MAX_OBJECTIVES + 50)]
    chosen = pool_objectives(listed, "chat")
    assert len(chosen) == MAX_OBJECTIVES and chosen[0]["name"].startswith("o00000-")
    text = render_objectives_config_map("chat", "ns", chosen)["data"][OBJECTIVES_KEY]
    assert len(text.encode()) < 2**20 // 2
    assert len(parse_objectives(text, "f")) == MAX_OBJECTIVES


def test_the_file_the_operator_writes_is_what_the_engine_reads():
    chosen = pool_objectives([objective("critical", "chat", 10),
                              objective("a: b # not yaml", "chat", -3)], "chat")
    config_map = render_objectives_config_map("chat", "ns", chosen)
    assert config_map["metadata"]["name"] == "chat-objectives"
    text = config_map["data"][OBJECTIVES_KEY]
    assert parse_objectives(text, "f") == {"critical": 10, "a: b # not yaml": -3}
    empty = render_objectives_config_map("chat", "ns", [])["data"][OBJECTIVES_KEY]
    assert yaml.safe_load(empty) == {"objectives": []} and parse_objectives(empty, "f") == {}


def _engine(spec: dict, gateway: GatewayWiring) -> tuple[dict, dict]:
    pod = render_deployment("chat", "ns", spec_of(parse_spec(spec)),
                            gateway=gateway)["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_the_engines_read_the_objectives_from_the_admins_gateway_alone():
    pod, engine = _engine(POOLED, PEERS)
    args = engine["args"]
    flags = args[args.index("--tenant-header"):]
    assert flags == ["--tenant-header", "x-gateway-inference-fairness-id",
                     "--tenant-header-from", "10.8.0.0/16",
                     "--objective-header", "x-gateway-inference-objective",
                     "--objectives-file", OBJECTIVES_FILE]
    parsed = build_parser("serve").parse_args(args)  # as the engine will read them
    assert (parsed.objective_header, parsed.objectives_file) == (
        "x-gateway-inference-objective", OBJECTIVES_FILE)
    [mount] = [m for m in engine["volumeMounts"] if m["name"] == "objectives"]
    assert f"{mount['mountPath']}/{OBJECTIVES_KEY}" == OBJECTIVES_FILE and mount["readOnly"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "objectives"]
    assert volume["configMap"] == {"name": "chat-objectives", "optional": True,
                                   "defaultMode": 0o444,
                                   "items": [{"key": OBJECTIVES_KEY, "path": OBJECTIVES_KEY}]}
    assert all(m["name"] != "objectives" for m in pod["initContainers"][0]["volumeMounts"])
    for spec, gateway in ((POOLED, GatewayWiring()), ({"model": MODEL}, PEERS)):
        pod, engine = _engine(spec, gateway)
        assert "--objective-header" not in engine["args"]
        assert all(v["name"] != "objectives" for v in pod["volumes"])


def _policy() -> Policy:
    return Policy.from_json('{"gateway": {"addresses": ["10.8.0.0/16"], '
                            '"endpointPicker": {"name": "epp"}}}')


def _file(cluster) -> dict[str, int] | None:
    found = cluster.stored("v1", "configmaps", "default", "chat-objectives")
    return None if found is None else parse_objectives(found["data"][OBJECTIVES_KEY], "f")


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
async def test_the_operator_keeps_the_file_as_objectives_come_and_go():
    """Each change is in the file within seconds (the objective's event), not the 60 s
    resync; another pool's objective never is, nor one another namespace's author wrote
    naming a pool of this name (its pool is in its own namespace)."""
    async with running_operator(policy=_policy(), pool=True, objectives=True) as cluster:
        await cluster.create(*INFERENCE_OBJECTIVES, objective("critical", "chat", 10))
        await cluster.create(*INFERENCE_OBJECTIVES, objective("theirs", "other", 99))
        await cluster.create(*INFERENCE_OBJECTIVES,
                             objective("urgent", "chat", 1000, namespace="intruder"))
        await cluster.create(API_VERSION, PLURAL,
                             service_manifest("chat", inferencePool={}))
        await eventually(lambda: _file(cluster) == {"critical": 10}, what="the first file")
        owner = cluster.stored(API_VERSION, PLURAL, "default", "chat")
        stored = cluster.stored("v1", "configmaps", "default", "chat-objectives")
        assert stored["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
        await cluster.create(*INFERENCE_OBJECTIVES, objective("batch", "chat", -5))
        await eventually(lambda: _file(cluster) == {"critical": 10, "batch": -5},
                         what="an objective added", timeout_s=10)
        await cluster.patch(*INFERENCE_OBJECTIVES, "default", "critical",
                            {"spec": {"priority": 20}})
        await eventually(lambda: _file(cluster) == {"critical": 20, "batch": -5},
                         what="a priority changed", timeout_s=10)
        await cluster.delete(*INFERENCE_OBJECTIVES, "default", "batch")
        await eventually(lambda: _file(cluster) == {"critical": 20},
                         what="an objective deleted", timeout_s=10)
        await cluster.patch(*INFERENCE_OBJECTIVES, "intruder", "urgent",
                            {"spec": {"priority": 2000}})  # its event names pool "chat"
        await asyncio.sleep(1)
        assert _file(cluster) == {"critical": 20}


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
async def test_a_cluster_without_objectives_gets_an_empty_file():
    async with running_operator(policy=_policy(), pool=True) as cluster:
        await cluster.create(API_VERSION, PLURAL,
                             service_manifest("chat", inferencePool={}))
        await eventually(lambda: _file(cluster) == {}, what="the empty file")
        await eventually(lambda: cluster.stored("apps/v1", "deployments", "default", "chat"),
                         what="the deployment")
