"""The webhook's view of the cluster's GPUs: GPU feature discovery's labels, and which nodes
a pod may land on by the scheduler's hard rules (nodeSelector, required node affinity,
tolerations against NoSchedule and NoExecute taints)."""

from __future__ import annotations

import pytest

from kvledger.operator.api.spec import parse_spec
from kvledger.operator.render.pod import GPU_TOLERATION, placement
from kvledger.operator.webhook.inventory import candidates, gpu_node, may_run_on, node_entry

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def node(name="n1", gpus="4", labels=None, taints=None) -> dict:
    """A Node object as the API server serves it."""
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name,
                                                  **(labels or {})}},
            "spec": {"taints": taints or []},
            "status": {"allocatable": {"cpu": "64", "memory": "512Gi",
                                       **({"nvidia.com/gpu": gpus} if gpus else {})}}}


GFD = {"nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
       "nvidia.com/gpu.count": "4"}


def test_gfd_labels_give_each_gpus_memory_and_the_allocatable_count():
    gpu = gpu_node(node_entry(node(labels=GFD)))
    assert (gpu.gpus, gpu.memory_bytes, gpu.unknown) == (4, 81559 * 2**20, None)
    assert gpu.shape == "4 x 79.6 GiB (nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3)"


@pytest.mark.parametrize(("labels", "why"), [
    ({}, "no GPU feature discovery labels"),
    # GFD leaves the memory label out on a node of mixed GPUs
    ({"nvidia.com/gpu.product": "mixed", "nvidia.com/gpu.count": "2"}, "mixed-GPU node"),
    ({**GFD, "nvidia.com/gpu.replicas": "4"}, "shared"),
    ({**GFD, "nvidia.com/gpu.memory": "lots"}, "not a size in MiB"),
])
def test_a_node_whose_gpu_memory_is_not_known_says_why(labels, why):
    gpu = gpu_node(node_entry(node(labels=labels)))
    assert gpu.memory_bytes is None and why in gpu.unknown


def test_a_node_without_a_device_plugin_count_has_no_gpus_to_offer():
    assert node_entry(node(gpus=None, labels=GFD))["gpus"] == 0
    assert node_entry(node(gpus="many", labels=GFD))["gpus"] == 0


def pod(**fields) -> dict:
    return placement(parse_spec({"model": {"path": "/m"}, "gpus": 1, **fields}))


def test_the_default_gpu_toleration_admits_the_usual_gpu_taint_and_nothing_else():
    tainted = gpu_node(node_entry(node(labels=GFD, taints=[GPU_TAINT])))
    assert pod()["tolerations"] == [GPU_TOLERATION]
    assert may_run_on(tainted, pod())
    other = gpu_node(node_entry(node(labels=GFD, taints=[
        GPU_TAINT, {"key": "team", "value": "a", "effect": "NoExecute"}])))
    assert not may_run_on(other, pod())
    assert may_run_on(other, pod(tolerations=[{"operator": "Exists"}]))
    soft = gpu_node(node_entry(node(labels=GFD, taints=[
        {"key": "team", "value": "a", "effect": "PreferNoSchedule"}])))
    assert may_run_on(soft, pod(tolerations=[]))
    assert not may_run_on(tainted, pod(tolerations=[
        {"key": "nvidia.com/gpu", "value": "absent", "effect": "NoSchedule"}]))


def test_node_selector_and_required_affinity_narrow_the_nodes():
    h100 = gpu_node(node_entry(node("h100", labels=GFD)))
    l4 = gpu_node(node_entry(node("l4", gpus="1", labels={
        "nvidia.com/gpu.memory": "23034", "nvidia.com/gpu.product": "NVIDIA-L4"})))
    by_product = pod(nodeSelector={"nvidia.com/gpu.product": "NVIDIA-L4"})
    assert [n.name for n in (h100, l4) if may_run_on(n, by_product)] == ["l4"]

    def affinity(*expressions, fields=()):
        term = {"matchExpressions": list(expressions)} if expressions else {}
        if fields:
            term["matchFields"] = list(fields)
        return pod(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [term]}}})

    big = affinity({"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["40000"]})
    assert [n.name for n in (h100, l4) if may_run_on(n, big)] == ["h100"]
    not_l4 = affinity({"key": "nvidia.com/gpu.product", "operator": "NotIn",
                       "values": ["NVIDIA-L4"]})
    assert [n.name for n in (h100, l4) if may_run_on(n, not_l4)] == ["h100"]
    named = affinity(fields=[{"key": "metadata.name", "operator": "In", "values": ["l4"]}])
    assert [n.name for n in (h100, l4) if may_run_on(n, named)] == ["l4"]
    missing = affinity({"key": "pool", "operator": "Exists"})
    assert not any(may_run_on(n, missing) for n in (h100, l4))
    assert not any(may_run_on(n, affinity()) for n in (h100, l4))  # an empty term: none


def test_candidates_are_gpu_nodes_the_pod_may_use_largest_memory_first():
    entries = [node_entry(n) for n in (
        node("cpu", gpus=None), node("unlabelled", gpus="8"),
        node("l4", gpus="1", labels={"nvidia.com/gpu.memory": "23034"}),
        node("h100", labels=GFD),
        node("tainted", labels=GFD, taints=[{"key": "x", "effect": "NoSchedule"}]))]
    assert [n.name for n in candidates(entries, pod())] == ["h100", "l4", "unlabelled"]
