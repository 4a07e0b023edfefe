"""What a KServe user writes, answered the kvledger way: a GPU in resources (spec.gpus), a
name the Service cannot take, KServe's model sources and its spec's shape. Each refusal is
the same at ``kubectl apply`` (the CRD's CEL, evaluated here with a CEL interpreter), in
the operator and webhook (``parse_spec``) and in ``kvledger run`` (``validate_manifest``)."""

from __future__ import annotations

import re

import pytest
from spec_helpers import cel_refusals

from kvledger.engine.errors import BadInput
from kvledger.operator.api.crd import openapi_schema, validate_manifest
from kvledger.operator.api.model_sources import KSERVE_SHAPE, SOURCES
from kvledger.operator.api.names import NAME_MESSAGE, check_name, name_ok
from kvledger.operator.api.setting_schema import HUB_URI_PATTERN
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.api.spec_rules import GPU_IN_RESOURCES, check_rules


def _doc(name: str = "m", **spec) -> dict:
    return {"apiVersion": "kvledger.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name}, "spec": {"model": {"path": "/m"}, **spec}}


@pytest.mark.parametrize("key", ["nvidia.com/gpu", "amd.com/gpu", "gpu.intel.com/i915",
                                 "nvidia.com/mig-1g.10gb"])
@pytest.mark.parametrize("kind", ["limits", "requests"])
@pytest.mark.parametrize("gpus", [None, 0, 2])
def test_a_gpu_in_resources_is_refused_pointing_to_gpus(key, kind, gpus):
    """It was overridden by gpus (default 1): 1 GPU of 2, or a GPU held by a CPU engine."""
    spec = _doc(resources={kind: {"cpu": "4", key: "2"}},
                **({} if gpus is None else {"gpus": gpus}))["spec"]
    assert cel_refusals(spec) == []  # not the CRD's: its keys are unbounded for CEL's cost
    for check in (check_rules, parse_spec):
        with pytest.raises(BadInput, match="^" + re.escape(GPU_IN_RESOURCES) + "$"):
            check(spec)
    assert "spec.gpus" in GPU_IN_RESOURCES


def test_cpu_memory_and_other_resources_still_pass():
    resources = {"limits": {"cpu": 4, "memory": "16Gi", "ephemeral-storage": "50Gi",
                            "hugepages-2Mi": "1Gi", "example.com/gpu-driver-token": "1"},
                 "requests": {"cpu": "2"}}
    spec = _doc(resources=resources)["spec"]
    assert cel_refusals(spec) == []
    assert parse_spec(spec).resources["limits"]["cpu"] == "4"


@pytest.mark.parametrize(("uri", "says"), [
    ("hf://org/name:main", "write hf://ORG/NAME@REVISION"),
    ("hf://meta-llama/Llama-3.1-8B:v1.0", "write hf://ORG/NAME@REVISION"),
    ("https://huggingface.co/org/name", "not its web page"),
    ("http://www.huggingface.co/org/name/tree/main", "not its web page"),
    ("pvc://models/llama", "model.volume.persistentVolumeClaim.claimName"),
    ("s3://bucket/llama", "mount the checkpoint as a volume"),
    ("gs://bucket/llama", "mount the checkpoint as a volume"),
    ("oci://registry/llama:1", "mount the checkpoint as a volume"),
])
def test_kserve_model_sources_get_the_kvledger_way(uri, says):
    spec = _doc(model={"uri": uri})["spec"]
    [message] = cel_refusals(spec)  # at kubectl apply, beside the pattern's error
    assert says in message
    assert re.search(HUB_URI_PATTERN, uri) is None  # the pattern refuses it all the same
    with pytest.raises(BadInput, match="^" + re.escape(message) + "$"):
        parse_spec(spec)
    with pytest.raises(BadInput, match=re.escape(f"at spec.model.uri: {message}")):
        validate_manifest(_doc(model={"uri": uri}))


@pytest.mark.parametrize("uri", ["hf://org/m", "hf://org/m@main", "hf://org/m@refs/pr/1",
                                 "hf://org/m@0123456789abcdef0123456789abcdef01234567"])
def test_the_sources_rules_accept_every_hub_uri(uri):
    for pattern, _ in SOURCES:
        assert re.match(pattern, uri) is None
    assert cel_refusals(_doc(model={"uri": uri})["spec"]) == []


def test_a_kserve_shaped_spec_names_kvledgers_fields():
    kserve = {"predictor": {"model": {"modelFormat": {"name": "huggingface"},
                                      "storageUri": "hf://org/m", "args": ["--max-model-len=8"],
                                      "resources": {"limits": {"nvidia.com/gpu": "1"}}}}}
    for doc in ({"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
                 "metadata": {"name": "m"}, "spec": kserve},
                {**_doc(), "spec": kserve}):
        with pytest.raises(BadInput, match="^" + re.escape(KSERVE_SHAPE) + "$"):
            validate_manifest(doc)
    with pytest.raises(BadInput, match="^" + re.escape(KSERVE_SHAPE) + "$"):
        parse_spec(kserve)
    for field in ("spec.model.uri", "spec.engine", "spec.resources", "spec.gpus"):
        assert field in KSERVE_SHAPE


NAMES = [("llama-3-1-8b", True), ("m", True), ("a" * 63, True), ("a" * 64, False),
         ("llama-3.1-8b", False), ("1llama", False), ("Llama", False), ("llama-", False),
         ("llama_3", False), ("llama\n", False)]


@pytest.mark.parametrize(("name", "ok"), NAMES)
def test_a_name_the_service_cannot_take_is_refused_by_run(name, ok):
    """And by the webhook (test_webhook_names.py); not by the CRD (names.py says why)."""
    assert "x-kubernetes-validations" not in openapi_schema()
    assert name_ok(name) is ok
    if ok:
        validate_manifest(_doc(name=name))
        check_name(name)
    else:
        with pytest.raises(BadInput, match=re.escape(f"at metadata.name: {name!r}: "
                                                     f"{NAME_MESSAGE}")):
            validate_manifest(_doc(name=name))


def test_a_generate_name_is_judged_with_its_five_characters():
    check_name(None, "llama-")
    check_name("", "a" * 58)
    with pytest.raises(BadInput, match=re.escape("metadata.generateName 'llama.3-'")):
        check_name(None, "llama.3-")
    with pytest.raises(BadInput, match=r"metadata\.generateName"):
        check_name(None, "a" * 59)
    with pytest.raises(BadInput, match=r"^None: metadata\.name must be"):
        check_name(None)


def test_a_decimal_target_says_to_quote_it_in_the_crd_itself():
    """int-or-string takes no float: the API server's error is generic, the field's
    description (kubectl explain) says what to write."""
    target = openapi_schema()["properties"]["spec"]["properties"]["autoscaling"][
        "properties"]["target"]
    assert 'Write a decimal as a string (target: "0.8")' in target["description"]
