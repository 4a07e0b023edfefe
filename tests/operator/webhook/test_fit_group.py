"""The webhook's verdict for spec.nodes above 1: the plan is per GPU of each of the
group's P stages (-pp P -tp T, as the leader's pre-flight plans it), and the nodes the
model fits must have room for the group's nodes pods of gpus GPUs each."""

from __future__ import annotations

import asyncio

from test_fit import BIG, UNLABELLED, node

from kvledger.operator.api.spec import parse_spec
from kvledger.operator.webhook.webhook import Webhook

BIG_TOO = node("big-too", 2, 4096, "NVIDIA-BIG")
# Too small for a third of small-llama, whichever way its attention runs (test_fit.SMALL
# fits one since the GPU's attention stopped gathering K and V).
SMALLER = node("smaller", 2, 1500, "NVIDIA-SMALL")


def verdict(hub, gpu_nodes: list[dict], *, gpus: int, nodes: int = 1):
    raw = {"model": {"uri": "hf://org/small-llama"}, "gpus": gpus, "nodes": nodes,
           "engine": {"maxModelLen": 2048, "maxNumSeqs": 32}}
    return asyncio.run(Webhook().verdict("svc", parse_spec(raw), gpu_nodes, hub.url))


def test_a_group_is_planned_per_gpu_of_each_stage(hub):
    group = verdict(hub, [BIG, BIG_TOO], gpus=2, nodes=2)
    assert group.allowed and not group.warnings
    [plan] = group.plans.values()
    assert (plan.pipeline_parallel_size, plan.tensor_parallel_size) == (2, 2)
    single = verdict(hub, [BIG], gpus=1)
    assert plan.required_bytes < next(iter(single.plans.values())).required_bytes


def test_a_group_needs_room_for_every_pod_on_nodes_it_fits(hub):
    two = verdict(hub, [BIG, SMALLER], gpus=1, nodes=2)  # two pods of one GPU on BIG's two
    assert two.allowed
    three = verdict(hub, [BIG, SMALLER], gpus=1, nodes=3)
    assert not three.allowed
    assert three.message == ("svc needs 3 pods of 1 GPUs (nodes: 3) on nodes it fits, and "
                             "those it may run on hold 2: 1 node of 2 x 4.0 GiB "
                             "(nvidia.com/gpu.product=NVIDIA-BIG)")
    # Nodes whose GPUs are not known may hold the rest: allowed, and said.
    unseen = verdict(hub, [BIG, UNLABELLED], gpus=1, nodes=3)
    assert unseen.allowed
    [warning] = unseen.warnings
    assert warning.startswith("svc needs 3 pods of 1 GPUs") and "not known" in warning
