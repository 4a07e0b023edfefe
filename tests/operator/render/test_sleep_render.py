"""``spec.sleep`` with ``engine.enableSleepMode``: the pods sleep and wake without a restart.
The operator writes the level into a ConfigMap it owns (NAME-sleep), which each engine
reads (serve --sleep-level-file, the ConfigMap mounted read-only); changing ``spec.sleep``
changes the ConfigMap only, never the pod template, so no pod is replaced."""

from __future__ import annotations

import kubernetes_validate
import pytest
from operator_harness import eventually, ready_for, running_operator, service_manifest
from spec_helpers import spec_of

from kvledger.engine.errors import BadInput
from kvledger.operator.api.resource import API_VERSION, PLURAL, SLEEP_LEVEL_FILE
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.cluster.kube import typed
from kvledger.operator.render.pod import render_sleep_config_map
from kvledger.operator.render.render import labels, render_deployment

MODEL = {"path": "/models/m"}
SLEEPY = {"model": MODEL, "engine": {"enableSleepMode": True}}


def test_sleep_mode_mounts_the_level_for_the_engine_alone():
    deployment = render_deployment("chat", "team-a", spec_of({**SLEEPY, "sleep": 1}))
    kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), strict=True)
    typed(deployment)
    pod = deployment["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "sleep"]
    assert volume["configMap"]["name"] == "chat-sleep" and volume["configMap"]["optional"]
    [preflight], [engine] = pod["initContainers"], pod["containers"]
    args = engine["args"]
    assert args[args.index("--sleep-level-file") + 1] == SLEEP_LEVEL_FILE
    assert "--enable-sleep-mode" in args
    assert SLEEP_LEVEL_FILE.rsplit("/", 1)[0] in [m["mountPath"] for m in engine["volumeMounts"]]
    assert all(m["name"] != "sleep" for m in preflight["volumeMounts"])
    # The level is not in the pod: changing it replaces no pod.
    assert deployment == render_deployment("chat", "team-a", spec_of({**SLEEPY, "sleep": 2}))
    assert deployment == render_deployment("chat", "team-a", spec_of(SLEEPY))
    plain = render_deployment("chat", "team-a", spec_of({"model": MODEL}))
    assert "--sleep-level-file" not in plain["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(("sleep", "level"), [(None, ""), (0, "0"), (1, "1"), (2, "2")])
def test_the_config_map_holds_the_level(sleep, level):
    raw = SLEEPY if sleep is None else {**SLEEPY, "sleep": sleep}
    body = render_sleep_config_map("chat", "team-a", parse_spec(raw), labels("chat"))
    kubernetes_validate.validate(body, kubernetes_validate.latest_version(), strict=True)
    typed(body)
    assert body["metadata"]["name"] == "chat-sleep" and body["data"] == {"level": level}
    assert render_sleep_config_map("chat", "team-a", parse_spec({"model": MODEL}), {}) is None


@pytest.mark.parametrize(("raw", "message"), [
    ({"model": MODEL, "sleep": 1}, "sleep needs engine.enableSleepMode"),
    ({**SLEEPY, "gpus": 2}, "needs one process a pod"),
    ({**SLEEPY, "nodes": 2}, "needs one process a pod"),
    ({**SLEEPY, "adapters": [{"name": "sql", "uri": "/models/sql"}]}, "needs one process a pod"),
])
def test_sleep_mode_the_engine_cannot_serve_is_refused(raw, message):
    with pytest.raises(BadInput, match=message):
        parse_spec(raw)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
async def test_the_operator_writes_the_level_and_replaces_no_pod():
    async with running_operator() as cluster:
        await cluster.create(API_VERSION, PLURAL, service_manifest(
            "chat", engine={"enableSleepMode": True}))
        config_map = await eventually(
            lambda: cluster.stored("v1", "configmaps", "default", "chat-sleep"),
            what="the sleep ConfigMap")
        assert config_map["data"] == {"level": ""}
        owner = cluster.stored(API_VERSION, PLURAL, "default", "chat")
        [ref] = config_map["metadata"]["ownerReferences"]
        assert ref["uid"] == owner["metadata"]["uid"]
        deployment = await eventually(
            lambda: cluster.stored("apps/v1", "deployments", "default", "chat"),
            what="the deployment")
        template = deployment["spec"]["template"]
        await cluster.patch(API_VERSION, PLURAL, "default", "chat", {"spec": {"sleep": 1}},
                            bump_generation=True)
        await eventually(lambda: cluster.stored("v1", "configmaps", "default", "chat-sleep")
                         ["data"] == {"level": "1"}, what="level 1 written")
        ready = await ready_for(cluster, "chat", "Sleeping")
        assert "spec.sleep is 1" in ready["message"]
        assert cluster.stored("apps/v1", "deployments", "default", "chat")["spec"]["template"] \
            == template
        await cluster.patch(API_VERSION, PLURAL, "default", "chat", {"spec": {"sleep": None}},
                            bump_generation=True)
        await eventually(lambda: cluster.stored("v1", "configmaps", "default", "chat-sleep")
                         ["data"] == {"level": ""}, what="awake written")
