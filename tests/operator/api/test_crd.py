"""The CRD: one source of truth (operator/api/crd.py, crd_schema.py, spec_rules.py), generated
into both copies by one command, structural, examples valid, CEL rules evaluated by a CEL
interpreter and matched rule by rule by the Python checks the operator and ``kvledger run``
use, and the grammars it shares with the engine derived from the engine's own."""

from __future__ import annotations

import json
import re
from pathlib import Path

import celpy
import pytest
import yaml
from operator_harness import PLACEMENT
from spec_helpers import cel_refusals

from kvledger.engine.checkpoint.hub.repo import HUB_URI_RE, parse_uri
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.kinds import SIZE_RE, parse_size
from kvledger.operator.api import crd
from kvledger.operator.api.crd import (
    CRD_FILES,
    crd_manifest,
    crd_yaml,
    openapi_schema,
    validate_manifest,
)
from kvledger.operator.api.setting_schema import HUB_URI_PATTERN, SIZE_PATTERN
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.api.spec_rules import RULES, check_rules

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("copy", CRD_FILES)
def test_both_crd_files_are_generated_from_the_python(copy):
    text = (ROOT / copy).read_text()
    assert text == crd_yaml(), f"{copy} is stale: run make crd"
    assert yaml.safe_load(text) == crd_manifest()
    assert CRD_FILES == ("crds/inferenceservice.yaml",
                         "charts/kvledger/crds/inferenceservice.yaml")
    assert crd.stale_files(ROOT) == []


def test_one_command_writes_both_copies_and_check_names_a_stale_one(tmp_path, capsys):
    for name in CRD_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / CRD_FILES[1]).write_text("# an old copy\n")
    assert crd.main(["--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: {name} is stale; run: make crd" for name in CRD_FILES]
    assert crd.main(["--write", "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "".join(f"wrote {name}\n" for name in CRD_FILES)
    for name in CRD_FILES:
        assert (tmp_path / name).read_text() == crd_yaml()
    assert crd.main(["--check", "--root", str(tmp_path)]) == 0
    assert crd.main(["--write", "--root", str(tmp_path)]) == 0
    assert "up to date: crds/inferenceservice.yaml" in capsys.readouterr().out
    makefile = (ROOT / "Makefile").read_text()
    assert "\ncrd:\n\t$(BIN)/python -m kvledger.operator.api.crd --write\n" in makefile


def test_crd_names_columns_and_subresources():
    crd = crd_manifest()
    assert crd["metadata"]["name"] == "inferenceservices.kvledger.dev"
    assert "isvc" not in crd["spec"]["names"]["shortNames"]  # KServe's
    [version] = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Reason", "Fits", "Required", "Limit", "Endpoint", "Age"]


def test_the_scale_subresource_paths_are_in_the_schema_with_the_types_it_needs():
    """`kubectl scale` and autoscalers read and write these: an integer count each side and
    a string label selector (the API server refuses a CRD whose paths point elsewhere)."""
    schema = openapi_schema()["properties"]
    for path, kind in ((".spec.replicas", "integer"), (".status.replicas", "integer"),
                       (".status.selector", "string")):
        top, field = path.strip(".").split(".")
        assert schema[top]["properties"][field]["type"] == kind, path
    assert schema["spec"]["properties"]["replicas"]["default"] == 1


def test_autoscaling_fields_validate_with_their_defaults_and_types():
    scaling = openapi_schema()["properties"]["spec"]["properties"]["autoscaling"]
    assert scaling["required"] == ["maxReplicas"]
    assert {k: v.get("default") for k, v in scaling["properties"].items()} == {
        "minReplicas": 1, "maxReplicas": None, "metric": "kvReservedRatio", "target": None,
        "provider": "hpa", "prometheus": None, "httpAddOn": None}
    for ok in ({"maxReplicas": 4}, {"maxReplicas": 4, "target": "0.8"},
               {"maxReplicas": 4, "target": "800m"}, {"maxReplicas": 4, "target": ".5"},
               {"minReplicas": 0, "maxReplicas": 8, "metric": "requestsWaiting", "target": 6,
                "provider": "keda", "prometheus": {"serverAddress": "http://prom:9090"}}):
        validate_manifest(_doc(autoscaling=ok))
    for bad, expected in [
        ({}, "'maxReplicas' is a required property"),
        ({"maxReplicas": 0}, "less than the minimum of 1"),
        ({"maxReplicas": 4, "minReplicas": -1}, "less than the minimum of 0"),
        ({"maxReplicas": 4, "metric": "cpu"}, "is not one of"),
        ({"maxReplicas": 4, "provider": "knative"}, "is not one of"),
        ({"maxReplicas": 4, "target": 0}, "less than the minimum of 1"),
        ({"maxReplicas": 4, "target": "80%"}, "does not match"),
        ({"maxReplicas": 4, "target": "1e3"}, "does not match"),
        # A decimal is a quantity string, as in every custom resource (and the HPA's own).
        ({"maxReplicas": 4, "target": 0.8},
         '0.8 is neither an integer nor a string (write a decimal as a string, e.g. "0.8")'),
        ({"maxReplicas": 4, "prometheus": {"serverAddress": "prom:9090"}}, "does not match"),
        ({"maxReplicas": 4, "behavior": {}}, "unknown field(s)"),
    ]:
        with pytest.raises(BadInput, match=re.escape(expected)):
            validate_manifest(_doc(autoscaling=bad))


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


def _doc(**spec) -> dict:
    return {"apiVersion": "kvledger.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "m"}, "spec": {"model": {"path": "/m"}, **spec}}


def test_placement_fields_validate_and_simple_ones_are_typed():
    validate_manifest(_doc(**PLACEMENT))
    check_rules(_doc(**PLACEMENT)["spec"])
    for field, bad, expected in [
        ("nodeSelector", {"pool": 1}, "is not of type 'string'"),
        ("tolerations", [{"effect": "Sometimes", "operator": "Exists"}], "is not one of"),
        ("tolerations", [{"operator": "Exists", "tolerationSeconds": "60"}],
         "is not of type 'integer'"),
        ("tolerations", [{"key": "k", "weight": 1}], "unknown field(s)"),
        ("imagePullSecrets", [{}], "'name' is a required property"),
        ("imagePullSecrets", ["registry"], "is not of type 'object'"),
        ("priorityClassName", 7, "is not of type 'string'"),
        ("env", [{"value": "x"}], "'name' is a required property"),
        ("affinity", {"nodeAffinty": {}}, "unknown field(s)"),
        ("podLabels", {"team": ["ml"]}, "is not of type 'string'"),
    ]:
        with pytest.raises(BadInput, match=re.escape(expected)):
            validate_manifest(_doc(**{field: bad}))


GOOD_URIS = ("hf://meta-llama/Llama-3.1-8B-Instruct", "hf://Qwen/Qwen2-0.5B@main",
             "hf://org/m@refs/pr/1", "hf://org_x/m@0123456789abcdef0123456789abcdef01234567")
BAD_URIS = ("hf://org", "hf://org/m/x", "hf://-org/m", "hf://org./m", "hf://o..rg/m",
            "hf://org/m@", "hf://org/m@x/", "hf://org/m@x y", "hf://org/m@a@b", "s3://org/m",
            "org/m", f"hf://{'o' * 97}/m", "hf://org/m\n")


def _api_server_matches(pattern: str, text: str) -> bool:
    """A schema pattern as the API server reads it (Go's RE2: '$' is the end of the text,
    where Python's also matches before a last newline)."""
    return re.search(pattern.removesuffix("$") + r"\Z", text) is not None


def test_the_uri_pattern_is_the_engines_regex_and_run_applies_the_engines_parser():
    """The CRD's pattern accepts exactly what the engine's regex matches; what parse_uri
    checks beyond it, `kvledger run` refuses at spec.model.uri with the engine's words."""
    for uri in (*GOOD_URIS, *BAD_URIS):
        assert _api_server_matches(HUB_URI_PATTERN, uri) == bool(HUB_URI_RE.fullmatch(uri)), uri
    for uri in GOOD_URIS:
        validate_manifest(_doc(model={"uri": uri}))
        parse_uri(uri)
    for uri in BAD_URIS:
        with pytest.raises(BadInput) as refused:
            parse_uri(uri)
        with pytest.raises(BadInput, match=r"spec\.model\.uri") as invalid:
            validate_manifest(_doc(model={"uri": uri}))
        if re.search(HUB_URI_PATTERN, uri):  # past the pattern: the engine's own message
            assert str(invalid.value) == f"invalid InferenceService at spec.model.uri: " \
                                         f"{refused.value}"


def test_the_size_pattern_is_the_engines_size_grammar():
    """memory.limit and kvCacheMemoryBytes: the CRD's pattern is parse_size's regex, less
    the whitespace a command line tolerates around a value and its unit."""
    for text in ("40Gi", "40GiB", "40G", "40GB", "40g", "40gb", "40kB", "40k", "512MiB",
                 "1.5Gi", "123", "7B", "1E", "1.5", "lots", "40Gib", "1.5.2G", "-1G", ".5G",
                 "40i", "40KiBB", "4e9", "Gi", ""):
        assert _api_server_matches(SIZE_PATTERN, text) == bool(SIZE_RE.match(text)), text
    assert parse_size(" 40 Gi ") == 40 * 2**30 and not re.search(SIZE_PATTERN, "40 Gi")
    # What parse_size checks past its regex is refused in its words, on the cluster too.
    with pytest.raises(BadInput, match="a byte count must be a whole number"):
        parse_spec({"model": {"path": "/m"}, "memory": {"limit": "1.5"}})


def test_a_size_is_exact_and_at_most_8_eib_wherever_it_is_read(capsys, tmp_path):
    """A SIZE reads to the byte (a float rounded 2**53 + 1 bytes down), and one past an
    int64's bytes is refused in one line: on the command line (exit 2) and in a tenant's
    spec (InvalidSpec), where 400 digits of memory.limit raised OverflowError inside the
    operator, the CRD's pattern having let them through."""
    from kvledger.engine.cli import main

    assert parse_size(str(2**53 + 1)) == 2**53 + 1
    assert parse_size("1.000000001Gi") == 2**30 + 1
    assert parse_size("7.5Ei") == 15 * 2**59 and parse_size(2**63 - 1) == 2**63 - 1
    huge = "1" * 400
    assert re.search(SIZE_PATTERN, huge)
    for text in (huge, "8Ei", "9223372036854775808", 2**63, "0" * 5000 + huge + "Gi"):
        with pytest.raises(BadInput, match="more than 8 EiB less a byte"):
            parse_size(text)
    with pytest.raises(BadInput, match=r"bad size '1111.*\(402 chars\): more than 8 EiB"):
        parse_spec({"model": {"path": "/m"}, "memory": {"limit": huge}})
    rc = main(["plan", "--model", str(tmp_path), "--device-memory", huge])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "more than 8 EiB" in err and "Traceback" not in err


def test_the_spec_is_typed_to_its_last_field_by_kubernetes_own_schemas():
    """No field of the spec keeps unknown fields (x-kubernetes-preserve-unknown-fields):
    the API server stored those however deep, and a thousand levels stop every JSON reader
    in the operator, kopf's watch of every tenant's resources included. affinity and an env
    var's valueFrom are Kubernetes' own schemas, vendored as the script writes them."""
    import importlib.util

    spec_schema = crd.openapi_schema()["properties"]["spec"]
    assert "x-kubernetes-preserve-unknown-fields" not in json.dumps(spec_schema)
    script = Path(__file__).parents[3] / "scripts" / "vendor_pod_schemas.py"
    loaded = importlib.util.spec_from_file_location("vendor_pod_schemas", script)
    vendor = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(vendor)
    assert vendor.OUT.read_text() == vendor.text(vendor.pod_schemas()), \
        "operator/api/pod_schemas.json is stale: run scripts/vendor_pod_schemas.py"


@pytest.mark.parametrize("name", ["-x", "--help", "m" * 257])
def test_a_model_name_the_pod_cannot_start_with_is_refused_at_apply(name):
    """model.name is the engine's --served-model-name: one starting with '-' read as a flag
    (the pod's parser refused it, the pod never started), and one of a megabyte made a
    Deployment the API server refuses, whose apply failed without the status saying why."""
    with pytest.raises(BadInput, match=r"spec\.model\.name"):
        validate_manifest(_doc(model={"path": "/m", "name": name}))
    validate_manifest(_doc(model={"path": "/m", "name": "org/model-8b:v1"}))


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


def test_every_rule_of_the_table_is_in_the_crd_once_where_it_applies():
    """The spec's rules, none at the root (a rule on metadata.name is costed at a request's
    whole size: names.py)."""
    in_crd = sorted(_rules())
    from_table = sorted((".spec" + (f".{rule.path}" if rule.path else ""), rule.cel,
                         rule.message) for rule in RULES)
    assert in_crd == from_table
    assert len({rule.message for rule in RULES}) == len(RULES)


def test_each_rule_message_is_written_once_in_the_operator():
    """The table owns the messages: no other module of the operator spells one out."""
    for source in sorted((ROOT / "operator").glob("*.py")):
        if source.name == "spec_rules.py":
            continue
        text = " ".join(source.read_text().split())
        for rule in RULES:
            assert rule.message[:40] not in text, (source.name, rule.message)


# Each family that changes which code runs or where secrets and traffic go: the loader and
# libc, PATH and HOME, Python, TLS and proxies (in any case), the hub, plugins that load
# shared objects, LeaderWorkerSet's and the operator's own, and case variants of allowed ones.
HOSTILE_ENV = (
    "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "GCONV_PATH", "GLIBC_TUNABLES", "MALLOC_CONF",
    "LOCPATH", "PATH", "HOME", "PYTHONPATH", "PYTHONSTARTUP", "PYTHONWARNINGS", "PYTHONHOME",
    "PYTHONUSERBASE", "PYTHONPYCACHEPREFIX", "SSL_CERT_FILE", "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "OPENSSL_CONF", "OPENSSL_MODULES", "HTTPS_PROXY",
    "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY",
    "no_proxy", "HF_HOME", "HF_HUB_CACHE", "HF_TOKEN_PATH", "HF_ENDPOINT", "HF_TOKEN",
    "HF_HUB_OFFLINE", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_HUB_CACHE", "NCCL_NET_PLUGIN",
    "NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN", "NCCL_CONF_FILE", "NCCL_BUFFSIZE",
    "CUDA_INJECTION64_PATH", "CUDA_VISIBLE_DEVICES", "OMP_TOOL_LIBRARIES",
    "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX",
    "MASTER_ADDR", "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_PP_LAYER_PARTITION",
    "KVLEDGER_API_KEY", "KVLEDGER_NODE_KEY", "nccl_debug", "NCCL_DEBUG ", "Pythonpath",
)

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
    # spec.nodes: P defaults to nodes, must be a multiple of it, and P / nodes must divide
    # gpus; with nodes 1 P must divide gpus, as before; a group needs GPUs.
    ({"model": {"path": "/m"}, "nodes": 2, "gpus": 2}, True),
    ({"model": {"path": "/m"}, "nodes": 2}, True),
    ({"model": {"path": "/m"}, "nodes": 2, "gpus": 4, "engine": {"pipelineParallelSize": 4}},
     True),
    ({"model": {"path": "/m"}, "nodes": 3, "gpus": 8, "engine": {"pipelineParallelSize": 6}},
     True),
    ({"model": {"path": "/m"}, "nodes": 2, "gpus": 4, "engine": {"pipelineParallelSize": 3}},
     False),
    ({"model": {"path": "/m"}, "nodes": 2, "gpus": 3, "engine": {"pipelineParallelSize": 4}},
     False),
    ({"model": {"path": "/m"}, "nodes": 4, "gpus": 8, "engine": {"pipelineParallelSize": 2}},
     False),
    ({"model": {"path": "/m"}, "nodes": 2, "engine": {"pipelineParallelSize": 1}}, False),
    ({"model": {"path": "/m"}, "nodes": 2, "gpus": 1, "engine": {"pipelineParallelSize": 2}},
     True),
    ({"model": {"path": "/m"}, "nodes": 1, "gpus": 4, "engine": {"pipelineParallelSize": 3}},
     False),
    ({"model": {"path": "/m"}, "nodes": 1, "gpus": 4, "engine": {"pipelineParallelSize": 2}},
     True),
    ({"model": {"path": "/m"}, "nodes": 2, "gpus": 0}, True),  # a group on the CPU: a rank a pod
    ({"model": {"path": "/m"}, "nodes": 1, "gpus": 0}, True),
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
    # A mountPath written with a trailing '/' holds what is under it.
    ({"model": {"path": "/models/m", "volume": {"hostPath": {"path": "/srv"},
                                                "mountPath": "/models/"}}}, True),
    ({"model": {"path": "/models/", "volume": {"hostPath": {"path": "/srv"},
                                               "mountPath": "/models/"}}}, True),
    ({"model": {"path": "/models", "volume": {"hostPath": {"path": "/srv"},
                                              "mountPath": "/models/"}}}, False),
    ({"model": {"path": "/modelsx/m", "volume": {"hostPath": {"path": "/srv"},
                                                 "mountPath": "/models/"}}}, False),
    # Exactly one of path and uri; the hub's fields only with a uri, the volume only without.
    ({"model": {"uri": "hf://org/m"}}, True),
    ({"model": {"uri": "hf://org/m", "tokenSecretRef": {"name": "hf", "key": "token"},
                "endpoint": "https://mirror.example", "cache": {
                    "persistentVolumeClaim": {"claimName": "c"}}}}, True),
    ({"model": {"uri": "hf://org/m", "path": "/m"}}, False),
    ({"model": {"name": "m"}}, False),
    ({"model": {"uri": "hf://org/m", "volume": {"hostPath": {"path": "/srv"},
                                                "mountPath": "/models"}}}, False),
    ({"model": {"path": "/m", "tokenSecretRef": {"name": "hf", "key": "token"}}}, False),
    ({"model": {"path": "/m", "endpoint": "https://mirror.example"}}, False),
    ({"model": {"path": "/m", "cache": {"persistentVolumeClaim": {"claimName": "c"}}}}, False),
    # Env: an allow-list of speed and log settings (operator/api/env_policy.py); the names
    # that could load code, redirect traffic or hold a secret are refused, in any case.
    *[({"model": {"path": "/m"}, "env": [{"name": name, "value": "x"}]}, True)
      for name in ("PYTORCH_CUDA_ALLOC_CONF", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
                   "OMP_NUM_THREADS", "HF_HUB_DOWNLOAD_TIMEOUT")],
    *[({"model": {"path": "/m"}, "env": [{"name": name, "value": "x"}]}, False)
      for name in HOSTILE_ENV],
    # A value from a Secret: refused (a failing container quotes it in the status); from a
    # ConfigMap or a field, taken.
    ({"model": {"path": "/m"}, "env": [{"name": "HF_HUB_ETAG_TIMEOUT", "valueFrom": {
        "secretKeyRef": {"name": "db", "key": "password"}}}]}, False),
    ({"model": {"path": "/m"}, "env": [{"name": "OMP_NUM_THREADS", "valueFrom": {
        "configMapKeyRef": {"name": "tuning", "key": "threads"}}}]}, True),
    ({"model": {"path": "/m"}, "env": [{"name": "OMP_NUM_THREADS", "valueFrom": {
        "resourceFieldRef": {"resource": "limits.cpu"}}}]}, True),
    # envFrom imports names nobody checked: refused whatever it names.
    ({"model": {"path": "/m"}, "envFrom": [{"configMapRef": {"name": "c"}}]}, False),
    ({"model": {"path": "/m"}, "envFrom": [{"secretRef": {"name": "s"}, "prefix": "X_"}]},
     False),
    # Runtime adapter loading is for clients holding the API key.
    ({"model": {"path": "/m"}, "allowRuntimeLoraUpdating": True}, False),
    ({"model": {"path": "/m"}, "allowRuntimeLoraUpdating": True,
      "apiKeySecretRef": {"name": "keys", "key": "api"}}, True),
    ({"model": {"path": "/m"}, "allowRuntimeLoraUpdating": False}, True),
    # vLLM's structured outputs validator: no whitespace with xgrammar or guidance, closed
    # objects with guidance.
    *[({"model": {"path": "/m"}, "structuredOutputs": outputs}, valid) for outputs, valid in [
        ({"backend": "guidance", "disableAnyWhitespace": True}, True),
        ({"backend": "xgrammar", "disableAnyWhitespace": True}, True),
        ({"disableAnyWhitespace": True}, False),
        ({"backend": "outlines", "disableAnyWhitespace": True}, False),
        ({"backend": "guidance", "disableAdditionalProperties": True}, True),
        ({"backend": "xgrammar", "disableAdditionalProperties": True}, False),
        ({"disableAnyWhitespace": False, "disableAdditionalProperties": False}, True),
        ({"enableInReasoning": True}, True),
    ]],
    # The GPUs of one node: the model sharded over them.
    ({"model": {"path": "/m"}, "gpus": 0}, True),
    ({"model": {"path": "/m"}, "gpus": 1}, True),
    ({"model": {"path": "/m"}, "gpus": 8}, True),
    ({"model": {"path": "/m"}, "gpus": 9}, False),
    # Tolerations as the API server would check them in the pod.
    ({"model": {"path": "/m"}, "tolerations": [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "pool", "operator": "Equal", "value": "a100"},
        {"key": "spot", "value": "true"},
        {"operator": "Exists"},
        {"key": "evict", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": 300}]}, True),
    ({"model": {"path": "/m"}, "tolerations": [{"operator": "Equal", "value": "x"}]}, False),
    ({"model": {"path": "/m"}, "tolerations": [{"effect": "NoSchedule"}]}, False),
    ({"model": {"path": "/m"}, "tolerations": [
        {"key": "k", "operator": "Exists", "value": "v"}]}, False),
    ({"model": {"path": "/m"}, "tolerations": [
        {"key": "k", "operator": "Exists", "effect": "NoSchedule",
         "tolerationSeconds": 60}]}, False),
    ({"model": {"path": "/m"}, "env": [{"name": "NCCL_DEBUG", "value": "1"}, {
        "name": "NCCL_IB_HCA", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]},
     True),
    ({"model": {"path": "/m"}, "env": [{"name": "NCCL_DEBUG", "value": "1", "valueFrom": {
        "fieldRef": {"fieldPath": "metadata.name"}}}]}, False),
    # Autoscaling: min <= max; scale to zero and a Prometheus address with KEDA only; a
    # target above 0, and for the KV reserved ratio (a share of the pool) at most 1.
    *[({"model": {"path": "/m"}, "autoscaling": {"maxReplicas": 4, **scaling}}, valid)
      for scaling, valid in [
          ({}, True),
          ({"minReplicas": 4}, True),
          ({"minReplicas": 5}, False),
          ({"minReplicas": 0}, False),
          ({"minReplicas": 0, "provider": "hpa"}, False),
          ({"minReplicas": 0, "provider": "keda"}, True),
          ({"provider": "keda", "prometheus": {"serverAddress": "http://prom:9090"}}, True),
          ({"prometheus": {"serverAddress": "http://prom:9090"}}, False),
          ({"target": "0.8"}, True),
          ({"target": "800m"}, True),
          ({"target": ".5"}, True),
          ({"target": 1}, True),
          ({"target": "1.0"}, True),
          ({"target": "1000m"}, True),
          ({"metric": "kvReservedRatio", "target": "0.95"}, True),
          ({"target": 2}, False),
          ({"target": "1.5"}, False),
          ({"target": "1001m"}, False),
          ({"target": "0"}, False),
          ({"target": "0.000"}, False),
          ({"target": "0m"}, False),
          ({"metric": "requestsWaiting", "target": 2}, True),
          ({"metric": "requestsWaiting", "target": "0.5"}, True),
          ({"metric": "requestsWaiting", "target": "0.0"}, False),
          ({"metric": "rejectionRate", "target": "2.5"}, True),
          ({"metric": "rejectionRate", "target": 20}, True),
      ]],
]


@pytest.mark.parametrize(("spec", "valid"), CASES)
def test_cel_rules_and_python_checks_agree(spec, valid):
    """Rule by rule, on every node it applies to (the API server evaluates a rule only
    where its field is set): the CEL's verdict is the Python check's, and the refusal
    the CRD's messageExpression words (naming the env variable, the envFrom source) is
    the one the operator and ``kvledger run`` give."""
    broken = cel_refusals(spec)
    assert (not broken) == valid
    if valid:
        check_rules(spec)
        parse_spec(spec)
    else:
        with pytest.raises(BadInput, match="^" + re.escape(broken[0]) + "$"):
            check_rules(spec)


@pytest.mark.parametrize("name", ["LD_PRELOAD", "https_proxy", "LWS_LEADER_ADDRESS"])
def test_a_refused_env_name_is_named_at_kubectl_apply(name):
    """The API server names only the item's index (spec.env[1]); the CRD's
    messageExpression puts the variable's name first, and the manifest's own check
    (``kvledger run``, the operator) says the same."""
    doc = _doc(env=[{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": name, "value": "x"}])
    validate_manifest(doc)  # the schema itself takes any name: the rule refuses it
    [entry] = [v for path, node in _walk(openapi_schema()) if path == ".spec.env[]"
               for v in node["x-kubernetes-validations"] if "messageExpression" in v
               and v["rule"].startswith("self.name in")]
    env = celpy.Environment()
    item = celpy.json_to_cel(doc["spec"]["env"][1])
    assert not env.program(env.compile(entry["rule"])).evaluate({"self": item})
    said = str(env.program(env.compile(entry["messageExpression"])).evaluate({"self": item}))
    assert said.startswith(f"env {name}: not a variable a resource may set")
    assert said.endswith("(the operator's Helm value policy.images)")
    with pytest.raises(BadInput, match="^" + re.escape(said) + "$"):
        check_rules(doc["spec"])


def test_an_env_value_from_a_secret_is_refused_naming_the_variable():
    """An author who may not read the namespace's Secrets named one in
    ``HF_HUB_ETAG_TIMEOUT``: fetch failed on ``int('<the value>')`` and the status quoted
    its last log line, the Secret's value. Refused at ``kubectl apply`` and by the operator."""
    var = {"name": "HF_HUB_ETAG_TIMEOUT",
           "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}}}
    spec = _doc(env=[var])["spec"]
    [said] = cel_refusals(spec)
    assert said.startswith("env HF_HUB_ETAG_TIMEOUT: valueFrom.secretKeyRef is refused")
    with pytest.raises(BadInput, match="^" + re.escape(said) + "$"):
        check_rules(spec)
