"""The webhook's verdict (``fit.judge`` through ``webhook.Webhook``) on real plans of real
checkpoints: what refuses (no node fits and every node is known; more GPUs than any node
has) and what is allowed with a warning (a model it cannot read, nodes it cannot see, no GPU
node yet, a fit on some nodes only, webhook.mode warn). Hub models come from
tests/hub_server.py; a slow hub is answered within the deadline and then from memory."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import kopf
import pytest

from kvledger.engine.errors import BadInput
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.cluster.hub_models import HubModels, read_headers
from kvledger.operator.render.policy import Policy
from kvledger.operator.webhook.fit import judge, spec_field
from kvledger.operator.webhook.webhook import Webhook, validate


def node(name: str, gpus: int, mib: int | None, product: str = "NVIDIA-TEST") -> dict:
    labels = {} if mib is None else {"nvidia.com/gpu.memory": str(mib),
                                     "nvidia.com/gpu.product": product}
    return {"name": name, "gpus": gpus, "taints": [], "labels": labels}


BIG, SMALL = node("big", 2, 4096, "NVIDIA-BIG"), node("small", 2, 2200, "NVIDIA-SMALL")
UNLABELLED = node("dark", 4, None)


def verdict(hub, nodes, *, webhook=None, **fields):
    raw = {"model": {"uri": "hf://org/small-llama"}, "gpus": 1,
           "engine": {"maxModelLen": 2048, "maxNumSeqs": 32}} | fields
    return asyncio.run((webhook or Webhook()).verdict("svc", parse_spec(raw), nodes, hub.url))


def test_a_run_that_fits_the_big_node_is_allowed_and_warned_it_may_land_on_the_small(hub):
    both = verdict(hub, [BIG, SMALL])
    assert both.allowed and [p.fits for _, p in sorted(both.plans.items())] == [False, True]
    (warning,) = both.warnings
    assert "fits 1 of the 2 nodes" in warning
    assert "nodeSelector nvidia.com/gpu.product: NVIDIA-BIG" in warning
    assert verdict(hub, [BIG]).warnings == ()


def test_a_run_that_fits_no_known_node_is_refused_with_the_breakdown_and_spec_remedies(hub):
    refused = verdict(hub, [SMALL])
    assert not refused.allowed
    lines = refused.message.splitlines()
    assert lines[0] == ("svc does not fit any node it may run on: the largest offers "
                        "2 x 2.1 GiB (nvidia.com/gpu.product=NVIDIA-SMALL); planned on one of "
                        "its GPUs:")
    assert lines[1].startswith("error: engine requires")
    assert any(line.startswith("  KV cache") for line in lines)
    assert lines[-1].startswith("to fit, in the InferenceService: engine.maxModelLen: ")
    # each remedy, applied to the spec, fits that node
    remedy = lines[-1].split(": ", 1)[1].split(" | ")[0]
    field, value = remedy.split(": ")
    assert field == "engine.maxModelLen"
    again = verdict(hub, [SMALL], engine={"maxModelLen": int(value), "maxNumSeqs": 32})
    assert again.allowed and again.warnings == ()


def test_nodes_it_cannot_see_turn_a_refusal_into_a_warning(hub):
    allowed = verdict(hub, [SMALL, UNLABELLED])
    assert allowed.allowed
    (warning,) = allowed.warnings
    assert "does not fit the 1 node whose GPUs are known" in warning
    assert "1 with no GPU feature discovery labels" in warning
    assert verdict(hub, [UNLABELLED]).warnings[0].startswith("the GPUs of 1 node it may run on")


def test_webhook_mode_warn_allows_what_deny_refuses(hub):
    warned = verdict(hub, [SMALL], webhook=Webhook(refuse=False))
    assert warned.allowed and warned.warnings[0].startswith("would be refused (webhook.mode warn)")


def test_more_gpus_than_any_node_has_is_refused_even_when_the_model_is_unread(hub):
    refused = verdict(hub, [BIG, UNLABELLED], gpus=8,
                      model={"path": "/models/x", "volume": {"persistentVolumeClaim": {"claimName": "models"}}})
    assert not refused.allowed
    assert "needs 8 GPUs in one pod, and the most any node it may run on offers is 4" in (
        refused.message)


def test_what_the_operator_cannot_read_is_allowed_with_a_warning_saying_why(hub):
    local = verdict(hub, [SMALL], model={"path": "/models/x", "volume": {"persistentVolumeClaim": {"claimName": "m"}}})
    assert local.allowed and "on the pod's volume" in local.warnings[0]
    gated = verdict(hub, [SMALL], model={"uri": "hf://org/gated",
                                         "tokenSecretRef": {"name": "hf", "key": "token"}})
    assert gated.allowed and "tokenSecretRef" in gated.warnings[0]
    missing = verdict(hub, [SMALL], model={"uri": "hf://org/not-there"})
    assert missing.allowed and "cannot read the headers of hf://org/not-there" in (
        missing.warnings[0])


def test_no_gpu_node_yet_is_a_warning_and_the_cpu_needs_no_node(hub):
    none = verdict(hub, [], gpus=1)
    assert none.allowed and "stay Pending" in none.warnings[0]
    tainted = dict(BIG, taints=[{"key": "team", "value": "a", "effect": "NoSchedule"}])
    assert "stay Pending" in verdict(hub, [tainted]).warnings[0]
    assert verdict(hub, [], gpus=0) == judge("svc", parse_spec(
        {"model": {"path": "/m"}, "gpus": 0}), [], plan_on=None)


def test_a_model_the_engine_cannot_run_is_refused_as_the_pre_flight_refuses_it(hub):
    with pytest.raises(BadInput, match="NoSuchForCausalLM"):  # the handler's 422
        verdict(hub, [BIG], model={"uri": "hf://org/unsupported"})


def test_a_fault_of_the_webhook_lets_the_resource_in_with_a_warning():
    """Only a verdict refuses: a bug (here, a verdict that raises) answers as
    failurePolicy Ignore would, allowed with a warning and logged."""
    class Broken:
        async def verdict(self, *args):
            raise RuntimeError("a bug")

    memo = kopf.Memo(webhook=Broken(), policy=Policy(), default_image="kvledger:test")
    body = kopf.Body({"metadata": {"name": "svc"}, "spec": {"model": {"path": "/m"}, "gpus": 1}})
    warnings: list[str] = []
    asyncio.run(validate(body=body, old=None, operation="CREATE", memo=memo,
                         warnings=warnings, gpu_nodes={}, logger=logging.getLogger("test")))
    assert warnings == ["the webhook could not plan svc (RuntimeError): the pod's pre-flight "
                        "checks the fit"]


def test_a_slow_hub_is_answered_within_the_deadline_then_from_memory(hub):
    reads = []

    def slow(uri, endpoint, timeout_s):
        reads.append(uri)
        time.sleep(2.5)
        return read_headers(uri, endpoint, timeout_s)

    async def twice():
        # 2 s for the hub: 1 s for the answer's way back, 1 s for planning
        webhook = Webhook(timeout_s=4.0, models=HubModels(slow))
        raw = {"model": {"uri": "hf://org/small-llama"}, "gpus": 1,
               "engine": {"maxModelLen": 2048, "maxNumSeqs": 32}}
        started = time.monotonic()
        first = await webhook.verdict("svc", parse_spec(raw), [SMALL], hub.url)
        first_s = time.monotonic() - started
        await asyncio.sleep(1.0)  # the read finishes meanwhile
        started = time.monotonic()
        second = await webhook.verdict("svc", parse_spec(raw), [SMALL], hub.url)
        return first, first_s, second, time.monotonic() - started

    first, first_s, second, second_s = asyncio.run(twice())
    assert first.allowed and "took over 2 s" in first.warnings[0] and first_s < 2.4
    assert not second.allowed and second_s < 0.5
    assert reads == ["hf://org/small-llama"]


def test_each_remedy_flag_names_its_spec_field():
    assert spec_field("--max-model-len") == "engine.maxModelLen"
    assert spec_field("--kv-cache-dtype") == "engine.kvCacheDtype"
    assert spec_field("--gpu-memory-utilization") == "memory.gpuMemoryUtilization"
    assert spec_field("--tensor-parallel-size") == "gpus"
    assert spec_field("--no-such-flag") is None


def test_a_flood_of_new_models_waits_on_the_webhooks_threads_not_the_operators(hub):
    """40 applies naming models the hub is slow to answer: the webhook answers each within
    its deadline with a warning (the first 20 read or queued, the others turned away at
    once), and the operator's own thread work (the reconcile's hub sizing, on threads of
    its own; asyncio's default pool) is not held up behind them."""

    def slow(uri, endpoint, timeout_s):
        time.sleep(3.0)
        return read_headers(uri, endpoint, timeout_s)

    async def flood():
        webhook = Webhook(timeout_s=4.0, models=HubModels(slow))  # 2 s for the hub
        specs = [parse_spec({"model": {"uri": f"hf://org/m{i}"}, "gpus": 1}) for i in range(40)]
        answers = asyncio.gather(*(webhook.verdict(f"s{i}", spec, [BIG], hub.url)
                                   for i, spec in enumerate(specs)))
        await asyncio.sleep(0.2)
        started = time.monotonic()
        await asyncio.to_thread(lambda: None)  # asyncio's default pool
        sized = await webhook.models.download_bytes("hf://org/small-llama", hub.url)
        reconcile_wait = time.monotonic() - started
        return await answers, reconcile_wait, sized

    verdicts, reconcile_wait, sized = asyncio.run(flood())
    assert sized > 0 and reconcile_wait < 1.0
    assert all(v.allowed for v in verdicts)
    # "took over 2 s" when the read started at once; a review the loaded machine started
    # late had less of its deadline left, and says so ("took over 1 s")
    waited = [v for v in verdicts if re.search(r"took over \d+ s \(the webhook's deadline\)",
                                               v.warnings[0])]
    turned_away = [v for v in verdicts if "other models from the hub now, as many as it may"
                   in v.warnings[0]]
    # Every review is one or the other; at most the 20 places read or wait (the bound that
    # keeps the operator's threads free). On a loaded machine a review can find a place
    # not yet given back and be turned away (19 waited in CI at be3abad); never 21 wait.
    assert len(waited) + len(turned_away) == 40, [v.warnings for v in verdicts]
    assert len(waited) <= 20 <= len(turned_away) and len(waited) >= 16


def test_a_memory_limit_above_every_gpu_is_refused_without_reading_the_model(
        hub, tiny_llama_dir):
    """A model on a volume is not read, but a memory.limit larger than one GPU of every
    node it may run on fits none, whatever the model: refused, as the pre-flight refuses a
    cap above the device's memory (checked here with the planner on such a GPU)."""
    from kvledger.engine.planner.plan import make_plan
    from kvledger.engine.settings.config import EngineConfig

    volume = {"path": "/models/x", "volume": {"persistentVolumeClaim": {"claimName": "m"}}}
    refused = verdict(hub, [BIG, SMALL], model=volume, memory={"limit": "5Gi"})
    assert not refused.allowed
    assert "memory.limit 5.0 GiB is more than one GPU of the largest offers (2 x 4.0 GiB" in (
        refused.message)
    pre_flight = make_plan(EngineConfig(model=str(tiny_llama_dir), memory_limit_bytes=5 * 2**30,
                                        device_memory_bytes=4096 * 2**20))
    assert not pre_flight.fits and pre_flight.cap_above_free
    within = verdict(hub, [BIG], model=volume, memory={"limit": "3Gi"})
    assert within.allowed and "on the pod's volume" in within.warnings[0]
    unseen = verdict(hub, [BIG, UNLABELLED], model=volume, memory={"limit": "5Gi"})
    assert unseen.allowed  # a node whose GPUs are not known may hold it


def test_a_kvledger_bug_on_a_tenants_files_leaves_that_model_unplanned(hub, monkeypatch, caplog):
    """An exception the planner should never raise (a bug its hostile-file fuzzing has
    not found) on one tenant's files: that model goes unplanned, logged with its
    traceback, and the operator's reads go on; it is not refused on a bug's word."""
    from kvledger.operator.cluster import hub_models

    def buggy(*_args):
        raise TypeError("unhashable type: 'list'")

    monkeypatch.setattr(hub_models, "read_checkpoint", buggy)
    headers = read_headers("hf://org/small-llama", hub.url, 10.0)
    assert headers.refused is None and headers.shape is None
    assert "TypeError: a kvledger bug" in headers.unread
    assert "reading hf://org/small-llama's headers failed" in caplog.text
    monkeypatch.undo()
    assert read_headers("hf://org/small-llama", hub.url, 10.0).shape is not None
