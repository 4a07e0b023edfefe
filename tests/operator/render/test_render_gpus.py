"""spec.gpus: N > 1 (issue 23): one pod, one node, the model sharded over its N GPUs. The
pure renderers give both containers --tensor-parallel-size N, the engine nvidia.com/gpu: N
and a memory-backed /dev/shm; the pre-flight's own args plan per GPU."""

from __future__ import annotations

import json

import pytest
from spec_helpers import spec_of

from kvledger.engine.cli import main
from kvledger.engine.planner.estimates import NCCL_BYTES_PER_RANK
from kvledger.operator.api.parallel import shm_size_limit
from kvledger.operator.render.pod import GPU_RESOURCE
from kvledger.operator.render.render import render_pod_spec


def _pod(gpus: int, path: str = "/m") -> dict:
    return render_pod_spec(spec_of({"model": {"path": path}, "gpus": gpus}))


def _containers(pod: dict) -> tuple[dict, dict]:
    [preflight] = pod["initContainers"]
    [engine] = pod["containers"]
    return preflight, engine


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_n_gpus_render_the_tensor_parallel_size_the_gpus_and_a_memory_backed_shm(gpus):
    pod = _pod(gpus)
    preflight, engine = _containers(pod)
    for container in (preflight, engine):
        args = container["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == str(gpus)
        assert container["resources"]["limits"][GPU_RESOURCE] == str(gpus)
    [shm] = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": shm_size_limit(gpus)}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    assert all(m["name"] != "dshm" for m in preflight["volumeMounts"])  # it plans, no NCCL


@pytest.mark.parametrize("gpus", [0, 1])
def test_one_gpu_or_none_renders_no_sharding_and_no_shm(gpus):
    pod = _pod(gpus)
    for container in _containers(pod):
        assert "--tensor-parallel-size" not in container["args"]
    assert all(v["name"] != "dshm" for v in pod["volumes"])


def test_the_shm_holds_every_ranks_nccl_buffers():
    assert shm_size_limit(2) == f"{(2 * NCCL_BYTES_PER_RANK + 512 * 2**20) // 2**20}Mi"
    assert shm_size_limit(8) == "1536Mi"


def test_the_preflight_args_plan_per_gpu(tiny_llama_dir, tmp_path):
    """The init container's own args, the model where the pod mounts it and a what-if
    80 GiB card for the one this machine lacks: a plan of one of 2 GPUs."""
    preflight, _ = _containers(_pod(2, path="/m"))
    args = [str(tiny_llama_dir) if a == "/m" else a for a in preflight["args"]]
    args[args.index("--plan-out") + 1] = str(tmp_path / "plan.json")
    args[args.index("--termination-log") + 1] = str(tmp_path / "termination-log")
    assert main(["preflight", *args, "--device-memory", "80GiB"]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["tensor_parallel_size"] == 2
    assert main(["preflight", *[a if a != "2" else "1" for a in args],
                 "--device-memory", "80GiB"]) == 0
    one = json.loads((tmp_path / "plan.json").read_text())
    assert plan["kv"]["bytes_per_block"] * 2 == one["kv"]["bytes_per_block"]
    assert plan["classes"]["weights"] < one["classes"]["weights"]


def test_pipeline_stages_split_the_pods_gpus():
    """engine.pipelineParallelSize P: the pod's gpus are P stages of gpus / P ranks each,
    as the pre-flight and the engine are told; a P that does not divide gpus is refused."""
    from kvledger.engine.errors import BadInput
    from kvledger.operator.api.spec import parse_spec
    from kvledger.operator.render.render import render_pod_spec

    raw = {"model": {"path": "/models/m"}, "gpus": 4, "engine": {"pipelineParallelSize": 2}}
    spec = parse_spec(raw)
    assert (spec.engine.pipeline_parallel_size, spec.engine.tensor_parallel_size) == (2, 2)
    pod = render_pod_spec(spec_of(raw))
    for container in (pod["initContainers"][0], pod["containers"][0]):
        args = container["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == "2"
        assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    with pytest.raises(BadInput, match=r"engine\.pipelineParallelSize must divide gpus"):
        parse_spec({**raw, "gpus": 3})
    with pytest.raises(BadInput, match=r"engine\.pipelineParallelSize must divide gpus"):
        parse_spec({"model": {"path": "/m"}, "engine": {"pipelineParallelSize": 2}})
