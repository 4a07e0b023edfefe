"""The operator's small REST client against the emulator: apply is idempotent, 404s are
None, credentials go in the headers kopf would send."""

from __future__ import annotations

import kopf
import pytest
from operator_harness import emulated_cluster

from kvledger.operator.cluster.kube import (
    KubeApi,
    KubeError,
    model_class,
    object_path,
    typed,
)
from kvledger.operator.cluster.merge_patch import contains, removals

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")


def config_map(data: dict) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "cm", "namespace": "ns"}, "data": data}


async def test_apply_creates_then_leaves_alone_then_patches():
    async with emulated_cluster() as cluster:
        api = cluster.api
        assert await api.apply("v1", "configmaps", config_map({"a": "1"})) == "created"
        assert await api.apply("v1", "configmaps", config_map({"a": "1"})) == "unchanged"
        assert await api.apply("v1", "configmaps", config_map({"a": "2"})) == "updated"
        assert cluster.stored("v1", "configmaps", "ns", "cm")["data"] == {"a": "2"}
        patches = [r for r in cluster.emulator if r.method == "PATCH"]
        assert len(patches) == 1
        assert patches[0].headers["Content-Type"] == "application/merge-patch+json"


async def test_apply_removes_what_it_set_before_and_only_that():
    async with emulated_cluster() as cluster:
        api, path = cluster.api, object_path("v1", "configmaps", "ns", "cm")
        first = config_map({"a": "1", "b": "2"})
        first["metadata"]["labels"] = {"mine": "x"}
        assert await api.apply("v1", "configmaps", first) == "created"
        # Another writer adds a label and a key of its own.
        await api.patch(path, {"metadata": {"labels": {"theirs": "y"}}, "data": {"c": "3"}})
        assert await api.apply("v1", "configmaps", config_map({"a": "1"})) == "updated"
        stored = cluster.stored("v1", "configmaps", "ns", "cm")
        assert stored["data"] == {"a": "1", "c": "3"}
        assert stored["metadata"]["labels"] == {"theirs": "y"}
        assert await api.apply("v1", "configmaps", config_map({"a": "1"})) == "unchanged"


def test_removals_name_only_dropped_keys_the_live_object_still_has():
    last = {"spec": {"nodeSelector": {"pool": "a"}, "affinity": {"x": 1}, "keep": 1},
            "metadata": {"annotations": {"ours": "1"}}}
    desired = {"spec": {"keep": 1}, "metadata": {}}
    live = {"spec": {"nodeSelector": {"pool": "a"}, "keep": 1, "default": 2},
            "metadata": {"annotations": {"ours": "1", "restartedAt": "t"}}}
    assert removals(last, desired, live) == {"spec": {"nodeSelector": None},
                                             "metadata": {"annotations": {"ours": None}}}
    assert removals({}, desired, live) == {}


async def test_absent_objects_and_conflicts():
    async with emulated_cluster() as cluster:
        api = cluster.api
        path = object_path("apps/v1", "deployments", "ns", "nope")
        assert path == "/apis/apps/v1/namespaces/ns/deployments/nope"
        assert await api.get(path) is None
        assert await api.delete(path) is False
        await api.create(object_path("v1", "configmaps", "ns"), config_map({}))
        with pytest.raises(KubeError) as error:
            await api.create(object_path("v1", "configmaps", "ns"), config_map({}))
        assert error.value.status == 409
        assert await api.delete(object_path("v1", "configmaps", "ns", "cm")) is True


async def test_bearer_token_is_sent_and_login_is_required():
    async with emulated_cluster() as cluster:
        api = KubeApi(kopf.ConnectionInfo(server=cluster.url, token="s3cret"))
        try:
            await api.get(object_path("v1", "configmaps", "ns", "cm"))
        finally:
            await api.close()
        assert list(cluster.emulator)[-1].headers["Authorization"] == "Bearer s3cret"
    with pytest.raises(KubeError, match="not logged in"):
        await KubeApi().get("/api/v1/namespaces")


def test_contains_ignores_server_defaults_but_not_changes():
    live = {"spec": {"replicas": 1, "revisionHistoryLimit": 10,
                     "containers": [{"name": "a", "imagePullPolicy": "Always"}]}}
    assert contains(live, {"spec": {"replicas": 1, "containers": [{"name": "a"}]}})
    assert not contains(live, {"spec": {"replicas": 2}})
    assert not contains(live, {"spec": {"containers": [{"name": "a"}, {"name": "b"}]}})
    assert contains({"limits": {"nvidia.com/gpu": "1"}}, {"limits": {"nvidia.com/gpu": 1}})


def deployment(limits: dict) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "d", "namespace": "ns"},
            "spec": {"selector": {"matchLabels": {"app": "d"}},
                     "template": {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": [
                         {"name": "engine", "image": "kvledger:test",
                          "resources": {"limits": limits}}]}}}}


async def test_a_built_in_child_goes_as_its_typed_model_and_a_bad_one_never_leaves():
    """What the operator sends of a built-in kind is the official client's model of it: a
    quantity as an int (which the API server would coerce) or a field the model does not
    know (which it would drop) is refused, naming it, before any request; a custom
    resource goes as written."""
    assert type(typed(deployment({"nvidia.com/gpu": "1"}))).__name__ == "V1Deployment"
    with pytest.raises(KubeError, match=r"HTTP 422: Deployment d is not a valid V1Deployment: "
                                        r"limits\.nvidia\.com/gpu: Input should be a valid string"):
        typed(deployment({"nvidia.com/gpu": 1}))
    unknown = deployment({})
    unknown["spec"]["template"]["spec"]["containers"][0]["gpuCount"] = 1
    with pytest.raises(KubeError, match="would not send it as written"):
        typed(unknown)
    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "p"}, "spec": {"anything": 1}}
    assert typed(pool) is pool
    assert model_class("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet") is None
    async with emulated_cluster() as cluster:
        with pytest.raises(KubeError):
            await cluster.api.apply("apps/v1", "deployments", deployment({"nvidia.com/gpu": 1}))
        assert not [r for r in cluster.emulator if r.method != "GET"]
        assert await cluster.api.apply("apps/v1", "deployments",
                                       deployment({"nvidia.com/gpu": "1"})) == "created"
