"""Every manifest in examples/ plans as its comments say, on the card they name: the pod's
own flags (``local_config``, what ``kvledger run`` and the operator's pod pass) planned on a
what-if device of that size, the Llama 8B ones on Llama-3-8B's published shape (Llama 3.1
8B's tensors and KV heads are the same), the tiny ones on the built-in tiny-llama. A
manifest that names no card is planned on this machine, as ``kvledger run`` plans it;
``does-not-fit.yaml`` is refused, as it says. The pod the operator renders declares
``--max-num-seqs`` exactly when the manifest does, so its pre-flight plans the same."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from budget_checkpoints import write_header_only
from published_models import published_config, published_tensors
from spec_helpers import spec_of

from kvledger.engine.planner.plan import make_plan
from kvledger.engine.planner.report import render_report
from kvledger.engine.settings.kinds import parse_size
from kvledger.operator.local_run import load_manifest, local_config
from kvledger.operator.render.render import render_deployment

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))
REFUSED = {"does-not-fit.yaml"}
# "one 24 GB GPU", "one 24 GB card", "an 80 GiB card": the size as Kubernetes reads it.
CARD = re.compile(r"(\d+) (GB|GiB) (?:GPU|card)")
HOLDS = re.compile(r"(\d+) sequences of (\d+) tokens")


def comments(path: Path) -> str:
    lines = [line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#")]
    return " ".join(lines)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from kvledger.engine.model.builtin import write_model

    root = tmp_path_factory.mktemp("example-models")
    write_model("tiny-llama", root / "tiny-llama")
    for name, published in (("llama-8b", "Llama-3-8B"), ("qwen3-8b", "Qwen3-8B")):
        config = published_config(published)
        write_header_only(root / name, config, published_tensors(config))
    return {"tiny": root / "tiny-llama", "llama-8b": root / "llama-8b",
            "qwen3-8b": root / "qwen3-8b"}


def example_plan(path: Path, models: dict[str, Path]):
    spec = load_manifest(str(path))["spec"]
    where = spec["model"].get("path") or spec["model"]["uri"]
    model = (models["tiny"] if "tiny-llama" in where
             else models["qwen3-8b"] if "Qwen3-8B" in where else models["llama-8b"])
    config = local_config(spec_of(spec), str(model))
    card = CARD.search(comments(path))
    if card is not None:
        size = parse_size(card.group(1) + card.group(2))
        config = dataclasses.replace(config, device="auto", device_memory_bytes=size)
    return make_plan(config)


def test_every_real_model_example_names_its_card() -> None:
    real = [p.name for p in EXAMPLES if "Llama" in p.read_text() or "Qwen" in p.read_text()]
    assert len(real) == 5, real
    assert all(CARD.search(comments(p)) for p in EXAMPLES if p.name in real)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_plans_on_the_card_it_names(path: Path, models) -> None:
    plan = example_plan(path, models)
    report = render_report(plan)
    assert plan.fits == (path.name not in REFUSED), report
    said = HOLDS.search(comments(path))
    if said is not None:  # what the comment promises is what the plan gives
        assert plan.max_num_seqs_source == "kv-pool", report
        assert (plan.kv.sequences, plan.max_model_len) == tuple(map(int, said.groups())), report
        assert plan.max_num_seqs == plan.kv.sequences


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_pod_declares_max_num_seqs_only_where_the_manifest_does(path: Path) -> None:
    spec = load_manifest(str(path))["spec"]
    pod = render_deployment("x", "ns", spec_of(spec))["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["initContainers"] + pod["containers"]}
    declared = "maxNumSeqs" in (spec.get("engine") or {})
    for name in ("preflight", "engine"):
        argv = containers[name].get("command", []) + containers[name].get("args", [])
        assert ("--max-num-seqs" in argv) == declared, (name, argv)


def test_the_llama_examples_leave_the_seats_to_the_pool() -> None:
    for path in EXAMPLES:
        if "Llama" in path.read_text():
            assert "maxNumSeqs" not in yaml.safe_load(path.read_text())["spec"]["engine"]
