"""The CRD: one source of truth (operator/crd.py), structural, examples valid, CEL rules
evaluated by a CEL interpreter and matched by the Python checks ``kvledger run`` uses."""

from __future__ import annotations

from pathlib import Path

import celpy
import pytest
import yaml

from kvledger.engine.errors import BadInput
from kvledger.operator.crd import crd_manifest, crd_yaml, openapi_schema, validate_manifest
from kvledger.operator.spec import check_rules

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("copy", ["crds/inferenceservice.yaml",
                                  "charts/kvledger/crds/inferenceservice.yaml"])
def test_crd_files_are_rendered_from_the_dict(copy):
    text = (ROOT / copy).read_text()
    assert text == crd_yaml(), f"{copy} is stale: python -m kvledger.operator.crd > {copy}"
    assert yaml.safe_load(text) == crd_manifest()


def test_crd_names_columns_and_status_subresource():
    crd = crd_manifest()
    assert crd["metadata"]["name"] == "inferenceservices.kvledger.dev"
    assert "isvc" not in crd["spec"]["names"]["shortNames"]  # KServe's
    [version] = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Reason", "Fits", "Required", "Limit", "Endpoint", "Age"]


def _walk(schema: dict, path: str = ""):
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    """The API server's structural rules that this schema could break: every node has a
    type unless it is int-or-string or preserves unknown fields; an int-or-string anyOf is
    exactly [{type: integer}, {type: string}] (value checks beside it, never inside)."""
    for path, node in _walk(openapi_schema()):
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
            assert "anyOf" not in node and "allOf" not in node, path


def test_kv_cache_memory_bytes_takes_bytes_or_a_size():
    doc = {"apiVersion": "kvledger.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "m"}, "spec": {"model": {"path": "/m"}, "memory": {}}}
    for ok in (4294967296, "4Gi", "512MiB"):
        doc["spec"]["memory"]["kvCacheMemoryBytes"] = ok
        validate_manifest(doc)
    for bad in (0, "lots", 1.5):
        doc["spec"]["memory"]["kvCacheMemoryBytes"] = bad
        with pytest.raises(BadInput, match="kvCacheMemoryBytes"):
            validate_manifest(doc)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates(example):
    doc = yaml.safe_load(example.read_text())
    validate_manifest(doc)
    check_rules(doc["spec"])


def _rules():
    """(schema path, rule, message) for every CEL rule in the CRD."""
    for path, node in _walk(openapi_schema()):
        for rule in node.get("x-kubernetes-validations", []):
            yield path, rule["rule"], rule["message"]


def _node(spec: dict, path: str):
    node = {"spec": spec}
    for part in path.strip(".").split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


CASES = [
    ({"model": {"path": "/models/m", "volume": {"hostPath": {"path": "/srv"},
                                                "mountPath": "/models"}}}, True),
    ({"model": {"path": "/data/m", "volume": {"hostPath": {"path": "/srv"},
                                              "mountPath": "/models"}}}, False),
    ({"model": {"path": "/models2/m", "volume": {"hostPath": {"path": "/srv"},
                                                 "mountPath": "/models"}}}, False),
    ({"model": {"path": "/models/m", "volume": {"mountPath": "/models"}}}, False),
    ({"model": {"path": "/models/m", "volume": {
        "hostPath": {"path": "/srv"}, "persistentVolumeClaim": {"claimName": "c"},
        "mountPath": "/models"}}}, False),
    ({"model": {"path": "/m"}, "engine": {"maxModelLen": 4096, "maxNumBatchedTokens": 1024}}, True),
    ({"model": {"path": "/m"}, "engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 64}}, True),
    ({"model": {"path": "/m"}, "engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 63}}, False),
    ({"model": {"path": "/m"}, "engine": {"maxNumBatchedTokens": 16}}, True),
    # A '..' segment could climb out of the mount, which the string checks cannot see.
    ({"model": {"path": "/models/../etc", "volume": {"hostPath": {"path": "/srv"},
                                                     "mountPath": "/models"}}}, False),
    ({"model": {"path": "/models/a/../m", "volume": {"hostPath": {"path": "/srv"},
                                                     "mountPath": "/models"}}}, False),
    ({"model": {"path": "/models/m/..", "volume": {"hostPath": {"path": "/srv"},
                                                   "mountPath": "/models"}}}, False),
    ({"model": {"path": "/m/.."}}, False),
    ({"model": {"path": "/models/..m/m..", "volume": {"hostPath": {"path": "/srv"},
                                                      "mountPath": "/models"}}}, True),
    ({"model": {"path": "/models/./m/", "volume": {"hostPath": {"path": "/srv"},
                                                   "mountPath": "/models"}}}, True),
]


@pytest.mark.parametrize(("spec", "valid"), CASES)
def test_cel_rules_and_python_checks_agree(spec, valid):
    env = celpy.Environment()
    cel_ok = True
    for path, rule, _ in _rules():
        node = _node(spec, path)
        if node is None:
            continue  # the API server evaluates a rule only where its field is set
        result = env.program(env.compile(rule)).evaluate({"self": celpy.json_to_cel(node)})
        cel_ok = cel_ok and bool(result)
    assert cel_ok is valid
    if valid:
        check_rules(spec)
    else:
        with pytest.raises(BadInput):
            check_rules(spec)
