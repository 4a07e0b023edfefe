"""Every LeaderWorkerSet the operator renders is valid against LWS's own CRD schema (the
vendored release's ``openAPIV3Schema``), embedded pod templates included, and strictly so:
a field the schema does not name is an error here (the API server would drop it)."""

from __future__ import annotations

import jsonschema
import pytest
from spec_helpers import spec_of
from vendored_crds import DATA, check_release, strict_version_schema

from kvledger.operator.cluster.kube import typed
from kvledger.operator.render.render_group import (
    LWS_API_VERSION,
    LWS_RELEASE,
    render_leader_worker_set,
)

CRD = DATA / "lws" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
MODEL = {"path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "models"},
                                         "mountPath": "/models"}}
SPECS = {
    "two nodes of two GPUs": {"model": MODEL, "gpus": 2, "nodes": 2},
    "four nodes, two stages a pod": {"model": MODEL, "gpus": 4, "nodes": 4, "replicas": 3,
                                     "engine": {"pipelineParallelSize": 8,
                                                "maxModelLen": 8192}},
    "hub model with token, placement and env": {
        "model": {"uri": "hf://org/big@v1", "tokenSecretRef": {"name": "hf", "key": "t"}},
        "gpus": 8, "nodes": 2, "nodeSelector": {"pool": "h100"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
        "podLabels": {"team": "a"}, "podAnnotations": {"note": "x"},
        "resources": {"limits": {"memory": "64Gi", "cpu": "16"}},
        "apiKeySecretRef": {"name": "api", "key": "k"}, "replicas": 0},
    "one GPU a pod": {"model": MODEL, "gpus": 1, "nodes": 3, "image": "kvledger:dev",
                      "adapters": [{"name": "sql", "uri": "/models/sql"}]},
}


@pytest.fixture(scope="module")
def lws_schema() -> dict:
    return strict_version_schema(CRD, LWS_API_VERSION.split("/")[1])


def test_the_vendored_crd_is_the_release_file_its_header_names():
    check_release(CRD, LWS_RELEASE)


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_rendered_leader_worker_sets_are_valid_against_the_lws_crd(spec, lws_schema):
    body = render_leader_worker_set("svc", "team-a", spec_of(spec), key_secret="svc-nodes-abcde",
                                    download_bytes=None)
    errors = sorted(jsonschema.Draft4Validator(lws_schema).iter_errors(body),
                    key=lambda e: list(e.absolute_path))
    assert not errors, [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                        for e in errors[:5]]
    # Its pod templates are the client's typed V1PodTemplateSpec, sent unchanged.
    group = body["spec"]["leaderWorkerTemplate"]
    for template in (group["leaderTemplate"], group["workerTemplate"]):
        typed({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
               "template": template})


def test_the_strict_schema_catches_a_misplaced_field(lws_schema):
    body = render_leader_worker_set("svc", "team-a", spec_of(SPECS["two nodes of two GPUs"]),
                                    key_secret="svc-nodes-abcde")
    body["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0][
        "startupPolicy"] = "LeaderCreated"
    body["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    errors = {".".join(map(str, e.absolute_path))
              for e in jsonschema.Draft4Validator(lws_schema).iter_errors(body)}
    assert errors == {"spec.leaderWorkerTemplate.workerTemplate.spec.containers.0",
                      "spec.leaderWorkerTemplate.restartPolicy"}
