"""The webhook and the init container give the same verdict: a corpus of InferenceService
specs x node inventories, each hub model served by tests/hub_server.py.

For every spec and every node it may run on, the webhook's plan (headers read once, the
pre-flight's parser on the rendered flags, the node's GPU memory label as
``--device-memory``) must equal, figure for figure, the plan JSON that the rendered
``preflight`` container writes when it runs (``kvledger preflight``, in this process, as
the pod runs it) on a GPU of that memory. The webhook refuses exactly when no node fits.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from _hub_helpers import point_hub_at
from hub_server import HubServer

from kvledger.engine import cli
from kvledger.engine.errors import EXIT_DOES_NOT_FIT, EXIT_OK
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.render.render import render_pod_spec
from kvledger.operator.webhook.inventory import candidates
from kvledger.operator.webhook.webhook import Webhook

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
from plan_speed import write_sparse_checkpoint  # noqa: E402
from spec_helpers import spec_of  # noqa: E402

MiB = 2**20


def gpu_node(name: str, gpus: int, mib: int, product: str) -> dict:
    """A node index entry as GPU feature discovery labels a node of ``gpus`` such GPUs."""
    return {"name": name, "gpus": gpus, "taints": [],
            "labels": {"nvidia.com/gpu.memory": str(mib), "nvidia.com/gpu.product": product,
                       "nvidia.com/gpu.count": str(gpus)}}


H100 = gpu_node("h100-a", 4, 81559, "NVIDIA-H100-80GB-HBM3")
A100 = gpu_node("a100-a", 8, 40960, "NVIDIA-A100-SXM4-40GB")
L4 = gpu_node("l4-a", 1, 23034, "NVIDIA-L4")
TINY = gpu_node("tiny-a", 2, 1536, "NVIDIA-TEST-1.5GB")  # small enough for the small models
INVENTORIES = {"h100+a100": [H100, A100], "l4": [L4], "tiny+l4": [TINY, L4]}

SPECS = {
    "70b-one-gpu": ("llama-70b", {"gpus": 1, "engine": {"maxModelLen": 8192, "maxNumSeqs": 16}}),
    "70b-four-gpus": ("llama-70b", {"gpus": 4, "engine": {"maxModelLen": 8192,
                                                          "maxNumSeqs": 16}}),
    "70b-two-gpus-util": ("llama-70b", {"gpus": 2, "engine": {"maxModelLen": 4096},
                                        "memory": {"gpuMemoryUtilization": 0.9}}),
    "small-fp8-kv": ("small-llama", {"gpus": 1, "engine": {"maxModelLen": 2048,
                                                           "maxNumSeqs": 64,
                                                           "kvCacheDtype": "fp8"}}),
    "small-limit": ("small-llama", {"gpus": 1, "memory": {"limit": "1GiB"},
                                    "engine": {"maxModelLen": 1024}}),
    "tiny-blocks": ("tiny-llama", {"gpus": 1, "memory": {"numGpuBlocksOverride": 4096}}),
    "tiny-two-gpus": ("tiny-llama", {"gpus": 2, "engine": {"maxNumSeqs": 512,
                                                           "maxModelLen": 512}}),
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory, make_model_dir):
    with HubServer() as server:
        for name in ("tiny-llama", "small-llama"):
            server.add_commit(f"kvledger/{name}", make_model_dir(name))
        big = tmp_path_factory.mktemp("llama-70b")
        write_sparse_checkpoint(big, 30)
        server.add_commit("kvledger/llama-70b", big)
        yield server


def preflight_plan(pod: dict, memory_bytes: int, out: Path) -> tuple[int, dict]:
    """Run the pod's rendered pre-flight on a GPU of ``memory_bytes``: (exit code, plan)."""
    preflight = pod["initContainers"][0]
    assert preflight["command"] == ["kvledger", "preflight"]
    args = list(preflight["args"])
    cut = args.index("--plan-out")  # the pod's own paths, replaced by this test's
    code = cli.main(["preflight", *args[:cut], "--device-memory", str(memory_bytes),
                     "--plan-out", str(out / "plan.json"),
                     "--termination-log", str(out / "termination-log")])
    return code, json.loads((out / "plan.json").read_text())


@pytest.mark.parametrize("inventory", sorted(INVENTORIES))
@pytest.mark.parametrize("case", sorted(SPECS))
def test_the_webhook_answers_as_the_pre_flight_on_every_node(hub, case, inventory, tmp_path,
                                                             monkeypatch, capsys):
    point_hub_at(monkeypatch, hub.url, tmp_path)
    repo, fields = SPECS[case]
    raw = {"model": {"uri": f"hf://kvledger/{repo}", "name": case}, **fields}
    spec = parse_spec(raw)
    nodes = INVENTORIES[inventory]
    verdict = asyncio.run(Webhook().verdict(case, spec, nodes, hub.url))

    pod = render_pod_spec(spec_of(raw), hub_endpoint=hub.url)
    eligible = [n for n in candidates(nodes, pod) if n.gpus >= spec.gpus]
    fits_somewhere = False
    for node in eligible:
        code, plan = preflight_plan(pod, node.memory_bytes, tmp_path)
        assert code in (EXIT_OK, EXIT_DOES_NOT_FIT), capsys.readouterr().err
        ours = json.loads(json.dumps(verdict.plans[node.memory_bytes].to_json()))
        assert ours == plan, (case, node.name)
        fits_somewhere |= plan["fits"]
    if not eligible:  # more GPUs than any node has: refused on the count alone
        assert not verdict.allowed and f"needs {spec.gpus} GPUs" in verdict.message
    else:
        assert verdict.allowed == fits_somewhere, verdict.message
    if not verdict.allowed and eligible:
        largest = eligible[0]
        assert "does not fit any node it may run on" in verdict.message
        assert largest.shape in verdict.message


def test_the_corpus_holds_both_verdicts(hub, tmp_path, monkeypatch):
    """The corpus is worth its name: some runs fit some inventories and not others."""
    point_hub_at(monkeypatch, hub.url, tmp_path)
    seen = set()
    for _, (repo, fields) in SPECS.items():
        raw = {"model": {"uri": f"hf://kvledger/{repo}"}, **fields}
        for nodes in INVENTORIES.values():
            verdict = asyncio.run(Webhook().verdict("x", parse_spec(raw), nodes, hub.url))
            seen.add(verdict.allowed)
    assert seen == {True, False}
