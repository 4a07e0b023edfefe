"""spec.nodes above 1: the LeaderWorkerSet, its Service, NetworkPolicy and key Secret,
rendered as the engine's multi-node contract wants them."""

from __future__ import annotations

import base64
import re

import pytest
from spec_helpers import spec_of

from kvledger.engine.errors import BadInput
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.render.autoscaling import pod_name_pattern, render_scaling
from kvledger.operator.render.render import LABEL, render_deployment
from kvledger.operator.render.render_group import (
    CONTROL_PORT,
    LWS_NAME_LABEL,
    NODE_KEY_ENV,
    RENDEZVOUS_PORT,
    WORKER_INDEX_LABEL,
    render_group_network_policy,
    render_leader_worker_set,
    render_node_key_secret,
    render_serving_service,
    render_workload,
    serving_selector,
)

MODEL = {"path": "/models/m", "name": "m"}
GROUP_FLAGS = ["--nnodes", "2", "--node-rank", "$(LWS_WORKER_INDEX)",
               "--master-addr", "$(LWS_LEADER_ADDRESS)", "--master-port", "29500"]


def _pods(spec: dict) -> tuple[dict, dict, dict]:
    """(LeaderWorkerSet, leader pod spec, worker pod spec)."""
    lws = render_leader_worker_set("big", "ns", spec_of(spec), key_secret="big-nodes-x7k2q",
                                   default_image="kvledger:test")
    template = lws["spec"]["leaderWorkerTemplate"]
    return lws, template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]


def _engine(pod: dict) -> dict:
    [engine] = pod["containers"]
    assert engine["name"] == "engine"
    return engine


def test_two_nodes_of_two_gpus_is_a_group_of_two_pods_with_tp2_pp2():
    spec = {"model": MODEL, "gpus": 2, "nodes": 2, "replicas": 3}
    lws, leader, worker = _pods(spec)
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["kind"] == "LeaderWorkerSet" and lws["metadata"]["name"] == "big"
    assert lws["spec"]["replicas"] == 3
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    # The args of one pod of 4 GPUs in 2 stages, exactly, then the group's; a worker has
    # no HTTP server.
    deployed = _engine(render_deployment("big", "ns", spec_of({**spec, "gpus": 4, "nodes": 1, "engine": {
        "pipelineParallelSize": 2}}), default_image="kvledger:test")["spec"]["template"]["spec"])
    assert _engine(leader)["args"] == deployed["args"] + GROUP_FLAGS
    assert _engine(worker)["args"] == deployed["args"] + GROUP_FLAGS + ["--headless"]
    args = _engine(leader)["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    for pod in (leader, worker):
        assert _engine(pod)["resources"]["limits"]["nvidia.com/gpu"] == "2"


def test_the_preflight_runs_on_the_leader_with_the_engines_tp_and_pp():
    _, leader, worker = _pods({"model": MODEL, "gpus": 4, "nodes": 2,
                               "engine": {"pipelineParallelSize": 4}})
    [preflight] = leader["initContainers"]
    flags = preflight["args"][:preflight["args"].index("--plan-out")]
    assert _engine(leader)["args"][:len(flags)] == flags
    assert flags[flags.index("--tensor-parallel-size") + 1] == "2"
    assert flags[flags.index("--pipeline-parallel-size") + 1] == "4"
    assert "initContainers" not in worker


def test_a_hub_model_is_fetched_by_every_pod_and_planned_by_the_leader():
    _, leader, worker = _pods({"model": {"uri": "hf://org/m"}, "gpus": 1, "nodes": 2})
    assert [c["name"] for c in leader["initContainers"]] == ["preflight", "fetch"]
    assert [c["name"] for c in worker["initContainers"]] == ["fetch"]


def test_the_leader_declares_http_rendezvous_and_control_ports_and_the_worker_none():
    _, leader, worker = _pods({"model": MODEL, "gpus": 1, "nodes": 2, "port": 9000})
    assert _engine(leader)["ports"] == [
        {"name": "http", "containerPort": 9000, "protocol": "TCP"},
        {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"},
        {"name": "control", "containerPort": CONTROL_PORT, "protocol": "TCP"}]
    assert (RENDEZVOUS_PORT, CONTROL_PORT) == (29500, 29501)
    assert {"startupProbe", "livenessProbe", "readinessProbe"} <= _engine(leader).keys()
    assert not {"ports", "startupProbe", "livenessProbe", "readinessProbe"} \
        & _engine(worker).keys()


def test_every_pod_gets_the_node_key_from_the_services_secret():
    _, leader, worker = _pods({"model": MODEL, "nodes": 2,
                               "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]})
    for pod in (leader, worker):
        env = _engine(pod)["env"]
        assert env[0] == {"name": "NCCL_DEBUG", "value": "INFO"}
        assert env[-1] == {"name": NODE_KEY_ENV, "valueFrom": {
            "secretKeyRef": {"name": "big-nodes-x7k2q", "key": "key"}}}
    with pytest.raises(BadInput, match=f"^env {NODE_KEY_ENV}: "):  # no spec may set it itself
        parse_spec({"model": MODEL, "nodes": 2, "env": [{"name": NODE_KEY_ENV, "value": "x"}]})


def test_the_node_key_secret_holds_the_key_it_is_given():
    secret = render_node_key_secret("big", "ns", bytes(range(32)))
    # Named by the API server as it is created: nobody can make it first.
    assert secret["metadata"]["generateName"] == "big-nodes-" and "name" not in secret["metadata"]
    assert secret["metadata"]["labels"][LABEL] == "big"
    again = render_node_key_secret("big", "ns", bytes(range(32)), "big-nodes-x7k2q")
    assert again["metadata"]["name"] == "big-nodes-x7k2q" and "generateName" not in again[
        "metadata"]
    # Hex: the engine reads it from an env var, text (raw bytes could hold a NUL).
    assert base64.b64decode(secret["data"]["key"]) == bytes(range(32)).hex().encode()


def test_pod_templates_carry_the_operators_labels_over_pod_labels():
    lws, _, _ = _pods({"model": MODEL, "nodes": 2, "podLabels": {"team": "a", LABEL: "x"},
                       "podAnnotations": {"note": "y"}})
    for role in ("leaderTemplate", "workerTemplate"):
        meta = lws["spec"]["leaderWorkerTemplate"][role]["metadata"]
        assert meta["labels"][LABEL] == "big" and meta["labels"]["team"] == "a"
        assert meta["annotations"] == {"note": "y"}


def test_the_service_and_the_scale_selector_take_the_leaders_only():
    group = parse_spec({"model": MODEL, "nodes": 2})
    assert render_serving_service("big", "ns", group)["spec"]["selector"] == {
        LABEL: "big", WORKER_INDEX_LABEL: "0"}
    assert serving_selector("big", group) == (
        f"{LABEL}=big,{WORKER_INDEX_LABEL}=0")
    single = parse_spec({"model": MODEL})
    assert render_serving_service("big", "ns", single)["spec"]["selector"] == {LABEL: "big"}
    assert serving_selector("big", single) == f"{LABEL}=big"


def test_the_network_policy_admits_the_group_on_every_port_and_others_on_http_only():
    spec = parse_spec({"model": MODEL, "nodes": 2, "port": 9000})
    policy = render_group_network_policy("big", "ns", spec, None)
    assert policy["metadata"]["name"] == "big"
    assert policy["spec"]["podSelector"] == {"matchLabels": {LABEL: "big"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {LABEL: "big", LWS_NAME_LABEL: "big"}}}]},
        {"ports": [{"protocol": "TCP", "port": 9000}]}]
    # With the admin's networkPolicy.enabled, HTTP comes from the admitted namespaces only.
    fenced = render_group_network_policy("big", "ns", spec, ("gateway",))
    assert fenced["spec"]["ingress"][1] == {
        "from": [{"podSelector": {}}, {"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "gateway"}}}],
        "ports": [{"protocol": "TCP", "port": 9000}]}


def test_one_node_is_the_deployment_as_before():
    spec = parse_spec({"model": MODEL, "gpus": 2})
    assert spec.nodes == 1
    kind, body = render_workload("one", "ns", spec, default_image="kvledger:test")
    assert kind == ("apps/v1", "deployments")
    assert body == render_deployment("one", "ns", spec_of(spec), default_image="kvledger:test")
    kind, body = render_workload("two", "ns", parse_spec({"model": MODEL, "nodes": 2}),
                                 key_secret="two-nodes-abcde")
    assert kind == ("leaderworkerset.x-k8s.io/v1", "leaderworkersets")
    assert body["kind"] == "LeaderWorkerSet"
    with pytest.raises(ValueError, match="key Secret"):
        render_workload("two", "ns", parse_spec({"model": MODEL, "nodes": 2}))


def test_keda_sums_the_metric_over_the_leaders_which_alone_serve_it():
    scaling = render_scaling("big", "ns", spec_of({"model": MODEL, "nodes": 2, "autoscaling": {
        "maxReplicas": 3, "provider": "keda", "metric": "requestsWaiting"}}))
    [scaled] = [body for body in scaling.values() if body and body["kind"] == "ScaledObject"]
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    assert query == 'sum(kvledger_requests_waiting{namespace="ns",pod=~"big-[0-9]+"})'
    pattern = re.compile(pod_name_pattern("big", nodes=2))
    assert pattern.fullmatch("big-0") and pattern.fullmatch("big-12")
    assert not pattern.fullmatch("big-0-1")  # a worker
    assert not pattern.fullmatch("big-7d9f8c6b5-x2x4z")  # a Deployment's pod
