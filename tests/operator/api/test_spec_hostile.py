"""A hostile InferenceService spec against the operator: refused in one line, or rendered, quickly.

One operator serves every namespace, so whoever may create an InferenceService in any of
them writes what it reads. Whatever the API server stores (the CRD's defaults applied, its
schema and its CEL rules passed) must end, through what a reconcile runs on it
(``parse_spec``, the admin's ``Policy.check``, the renderers of ``children._apply`` and the
pure parts of ``handlers.sync_status``), in ``BadInput`` (``PolicyDenied`` is one) of one
line of at most ``MESSAGE_LIMIT_CHARS``, or in children that the operator's client sends as
written (``kube.typed``) and can record (``kube.apply``'s JSON), within ``TIME_LIMIT_S`` and
``MEMORY_LIMIT_BYTES``: never another exception, a hang (parse_spec and the renderers run
on the event loop every tenant shares), or memory that grows with a number the spec states.

The specs mutated are the examples' and a few built here to reach every field; each
example sets, replaces or deletes up to four fields anywhere in the spec (objects and list
items made on the way), with values drawn from the field's own schema (its bounds and their
neighbours, its enum, strings its pattern takes at their longest, unicode, newlines, NULs,
lists at their most items and of one item repeated, large maps and deep objects where the
schema takes any). Only what the API server would store is kept (``stored``): the CRD's
defaults applied, its schema with patterns read as Go's RE2 reads them (``$`` the end of
the text, ``\\d`` ASCII), every CEL rule evaluated by cel-python as
tests/operator/api/test_crd.py evaluates them, integers within int64, at most 1.5 MiB of
JSON (etcd's limit) that Python's JSON reader (kopf's) can read back.
``KVLEDGER_FUZZ_EXAMPLES=N`` hunts with N examples and shrinks what fails;
``KVLEDGER_FUZZ_LOG=FILE`` with it appends each failure to FILE (a JSON line) and hunts on.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml
from _budget import Budget
from hypothesis import HealthCheck, Phase, assume, event, given, settings
from hypothesis import strategies as st
from operator_harness import PLACEMENT

from kvledger.engine.errors import BadInput
from kvledger.operator.api.cel_rule import nodes
from kvledger.operator.api.crd import openapi_schema, strict_schema
from kvledger.operator.api.spec import ServiceSpec, parse_spec
from kvledger.operator.api.spec_rules import RULES
from kvledger.operator.cluster.kube import KubeError, typed
from kvledger.operator.controller import children, status
from kvledger.operator.render import autoscaling, gateway, gateway_wiring, render, render_group
from kvledger.operator.render.gateway_wiring import GatewayWiring
from kvledger.operator.render.node_reach import repository
from kvledger.operator.render.pod import render_sleep_config_map
from kvledger.operator.render.policy import Policy
from kvledger.operator.render.render import DEFAULT_IMAGE

MiB = 2**20
TIME_LIMIT_S = 2.0  # what one spec may cost a reconcile (a few ms each)
HARD_STOP_S = 2.5  # where the alarm stops a runaway example
ALARM_REPEAT_S = 0.25  # and again, until it has stopped
MEMORY_LIMIT_BYTES = 64 * MiB  # traced peak; a 1.5 MiB spec, copied into its children, takes ~5
MESSAGE_LIMIT_CHARS = 2048  # a condition's message a person reads, one line
STORED_LIMIT_BYTES = 3 * MiB // 2  # etcd's largest object (the API server's default)
INT64 = (-(2**63), 2**63 - 1)
# The operator runs at Python's own recursion limit; cel-python raises it for the whole
# process (2500), which would hide a recursion as deep as a stored spec's nesting.
RECURSION_LIMIT = 1000
K8S_VERSION = kubernetes_validate.latest_version()

_HUNT = int(os.environ.get("KVLEDGER_FUZZ_EXAMPLES", "0"))
# While hunting: a file each finding is appended to (one JSON line), the hunt going on.
_LOG = os.environ.get("KVLEDGER_FUZZ_LOG")
FUZZ_SETTINGS = settings(
    max_examples=_HUNT or 200, deadline=None, derandomize=not _HUNT,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much, HealthCheck.large_base_example],
    phases=tuple(Phase) if _HUNT else (Phase.explicit, Phase.reuse, Phase.generate))

ROOT = Path(__file__).resolve().parents[3]
SPEC_SCHEMA = openapi_schema()["properties"]["spec"]

# --- what the API server stores ------------------------------------------------------------


@cache
def _api_regex(pattern: str) -> re.Pattern[str]:
    """A schema pattern as Go's RE2 reads it: '$' the end of the text (Python's also
    matches before a last newline), '\\d' and '\\s' ASCII's alone."""
    body = (pattern.replace(r"\d", "[0-9]").replace(r"\S", r"[^\t\n\f\r ]")
            .replace(r"\s", r"[\t\n\f\r ]"))
    return re.compile(body.removesuffix("$") + r"\Z" if body.endswith("$") else body)


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
    if validator.is_type(instance, "string") and not _api_regex(pattern).search(instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


_ApiServer = jsonschema.validators.extend(jsonschema.Draft4Validator, {"pattern": _pattern})
_VALIDATOR = _ApiServer(strict_schema(openapi_schema()["properties"]["spec"]))
_CEL = celpy.Environment()
_PROGRAMS = [(rule, _CEL.program(_CEL.compile(rule.cel))) for rule in RULES]


def _scalars(value: Any) -> list[Any]:
    """Every scalar in ``value`` (a walk with a stack of its own: a deep one too)."""
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        else:
            found.append(item)
    return found


def _depth(value: Any) -> int:
    """How many levels of maps and lists ``value`` nests (a walk, no recursion)."""
    level, depth = [value], 0
    while level:
        level = [v for node in level if isinstance(node, (dict, list))
                 for v in (node.values() if isinstance(node, dict) else node)]
        depth += 1
    return depth - 1


def _as_go_writes(value: Any) -> Any:
    """``value`` as the API server stores it: a whole float (Go's float64) written as an
    integer below 1e21, where Go's JSON stops writing every digit."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        return int(value)
    if isinstance(value, dict):
        return {k: _as_go_writes(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_go_writes(v) for v in value]
    return value


def _defaulted(schema: dict[str, Any], value: Any) -> None:
    """The CRD's defaults applied in place, and fields the schema does not name pruned, as
    the API server does before it validates (a structural schema's unknown fields are
    dropped, unless it keeps them: x-kubernetes-preserve-unknown-fields)."""
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for name, sub in properties.items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
        extra = schema.get("additionalProperties")
        if not isinstance(extra, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
            for name in [n for n in value if n not in properties]:
                del value[name]
        for name, sub_value in value.items():
            if name in properties:
                _defaulted(properties[name], sub_value)
            elif isinstance(extra, dict):
                _defaulted(extra, sub_value)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _defaulted(schema["items"], item)


def _shallow(node: Any, depth: int = 6) -> Any:
    """``node`` with what lies deeper than ``depth`` emptied: no rule reads past three
    levels, and cel-python converts a node recursively."""
    if isinstance(node, dict):
        return {k: _shallow(v, depth - 1) if depth else {} for k, v in node.items()}
    if isinstance(node, list):
        return [_shallow(v, depth - 1) if depth else [] for v in node]
    return node


@cache
def _verdict(index: int, node_json: str) -> bool:
    """Whether the CEL rule ``RULES[index]`` holds of the node (JSON): an evaluation error
    refuses, as on the API server."""
    try:
        verdict = _PROGRAMS[index][1].evaluate({"self": celpy.json_to_cel(json.loads(node_json))})
    except Exception:
        return False
    return isinstance(verdict, celpy.celtypes.BoolType) and bool(verdict)


def _cel_holds(spec: dict[str, Any]) -> bool:
    for index, (rule, _program) in enumerate(_PROGRAMS):
        for node in nodes(spec, rule.path):
            if isinstance(node, dict):  # the fields the rule names (has(self.x), self.x)
                node = {k: v for k, v in node.items() if k in rule.cel}
            if not _verdict(index, json.dumps(_shallow(node), sort_keys=True)):
                return False
    return True


@contextlib.contextmanager
def _recursion_limit(limit: int) -> Iterator[None]:
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


def stored(spec: Any) -> dict[str, Any] | None:
    """``spec`` as the API server stores it and the operator reads it back, or None where
    the API server (or kopf's JSON reader) refuses it."""
    if not isinstance(spec, dict):
        return None
    spec = _as_go_writes(spec)
    if any(isinstance(v, int) and not isinstance(v, bool) and not INT64[0] <= v <= INT64[1]
           for v in _scalars(spec)):
        return None  # past int64: the API server's JSON reader makes it a float
    try:
        text = json.dumps(spec, ensure_ascii=False, separators=(",", ":"))
        if len(text.encode("utf-8")) > STORED_LIMIT_BYTES:
            return None
        with _recursion_limit(RECURSION_LIMIT):
            spec = json.loads(text)  # what kopf hands the handlers
    except (RecursionError, UnicodeEncodeError, ValueError):
        return None  # too deep for Python's JSON (kopf's watch), or not UTF-8
    _defaulted(SPEC_SCHEMA, spec)
    if next(_VALIDATOR.iter_errors(spec), None) is not None or not _cel_holds(spec):
        return None
    return spec


# --- a reconcile, as far as it is pure -------------------------------------------------------

NAMESPACE = "team-a"
KEY_SECRET = "m-nodes-x7k2q"
GATEWAY = GatewayWiring(peers=("10.0.0.0/8",), kv_events="tcp://router.gw:5557")


def allowing(spec: ServiceSpec) -> Policy:
    """The admin's policy that allows whatever ``spec`` asks (its image, host folder,
    priority class, hub endpoint, control-plane placement, hosts, pod labels and
    annotations), with every Helm value
    that changes what is rendered set: a NetworkPolicy, a picker, the gateway's wiring."""
    return Policy(images=(repository(spec.image),) if spec.image else (), host_paths=("/",),
                  priority_classes=tuple(filter(None, [spec.pod_fields.get("priorityClassName")])),
                  control_plane=True,
                  hub_endpoints=("https://huggingface.co",
                                 *([spec.model.endpoint.rstrip("/")] if spec.model.endpoint else [])),
                  network_policy=("monitoring",), picker="epp", gateway=GATEWAY,
                  http_hosts=("*",), pod_labels=tuple(spec.pod_labels),
                  pod_annotations=tuple(spec.pod_annotations))


def reconcile(name: str, raw: dict[str, Any], policy: Policy | None,
              download_bytes: int | None = 16 * 2**30,
              start_seconds: int | None = None) -> list[dict[str, Any]]:
    """What ``children.apply_children`` and ``handlers.sync_status`` compute from the spec
    ``raw`` of the resource ``name`` under ``policy`` (None: one that allows what it asks):
    every child's body, each recorded as ``kube.apply`` records it, and the status."""
    spec = parse_spec(raw)
    policy = policy or allowing(spec)
    policy.check(spec, DEFAULT_IMAGE, name=name, namespace=NAMESPACE)
    _kind, workload = render_group.render_workload(
        name, NAMESPACE, spec, key_secret=KEY_SECRET if spec.nodes > 1 else None,
        default_image=DEFAULT_IMAGE,
        download_bytes=download_bytes if spec.model.needs_download_size else None,
        hub_endpoint=policy.hub_endpoint(spec), gateway=policy.gateway)
    optional = autoscaling.render_scaling(name, NAMESPACE, spec, start_seconds=start_seconds)
    optional[children.NETWORK_POLICY] = children.network_policy(name, NAMESPACE, spec,
                                                                policy.network_policy)
    optional[gateway.INFERENCE_POOLS] = gateway.render_inference_pool(
        name, NAMESPACE, spec, policy.picker, policy.picker_port)
    service = render_group.render_serving_service(name, NAMESPACE, spec)
    sleep = render_sleep_config_map(name, NAMESPACE, spec, render.labels(name))
    objectives = (gateway.render_objectives_config_map(name, NAMESPACE, [])
                  if gateway_wiring.objectives_wired(spec, policy.gateway) else None)
    key = (render_group.render_node_key_secret(name, NAMESPACE, b"\0" * 32)
           if spec.nodes > 1 else None)
    bodies = [body for body in (workload, service, sleep, objectives, key, *optional.values())
              if body is not None]
    for body in bodies:
        json.dumps(body, sort_keys=True, separators=(",", ":"))  # kube.apply's record
    bodies.append(status.compute_status(
        spec=spec, generation=1, old={}, pods=[], spec_error=None,
        endpoint=render.endpoint(name, NAMESPACE, spec.serve.port),
        selector=render_group.serving_selector(name, spec), now="2026-01-01T00:00:00Z"))
    return bodies


def assert_one_line(refusal: BadInput) -> None:
    message = str(refusal)
    assert message, f"{type(refusal).__name__} without a message"
    assert message.splitlines() == [message], f"refusal not one line: {message[:300]!r}"
    assert len(message) <= MESSAGE_LIMIT_CHARS, \
        f"refusal of {len(message)} chars: {message[:300]!r}"


def assert_sent_as_written(body: dict[str, Any]) -> None:
    """The client sends a built-in child as written (``kube.typed``), unless Kubernetes'
    own schema refuses it too: the pod's fields a spec passes through (placement, env,
    resources) are the API server's to check, as it would the same pod of anyone's."""
    try:
        typed(body)
    except KubeError as refused:
        try:
            kubernetes_validate.validate(body, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError:
            return
        pytest.fail(f"the client refuses a child the API server takes: {refused}")


def check(name: str, raw: dict[str, Any], policy: Policy | None = None, **options: Any
          ) -> list[dict[str, Any]] | BadInput:
    """``reconcile`` held to the contract: children the client sends as written, or
    BadInput in one short line, within the time and memory limits; anything else fails,
    named."""
    try:
        with Budget(HARD_STOP_S, ALARM_REPEAT_S, RECURSION_LIMIT) as spent:
            try:
                result: list[dict[str, Any]] | BadInput = reconcile(name, raw, policy,
                                                                    **options)
            except BadInput as exc:
                result = exc
    except Exception as exc:
        pytest.fail(f"{type(exc).__name__} (not BadInput): {str(exc)[:300]}")
    assert spent.seconds < TIME_LIMIT_S, f"took {spent.seconds:.2f} s"
    assert spent.peak_bytes < MEMORY_LIMIT_BYTES, f"peak {spent.peak_bytes / MiB:.0f} MiB"
    if isinstance(result, BadInput):
        assert_one_line(result)
    else:
        for body in result[:-1]:  # the last: the status
            assert_sent_as_written(body)
    return result


def check_parse(raw: dict[str, Any]) -> ServiceSpec | BadInput:
    """``parse_spec`` alone held to the contract (``kvledger run``'s spec as written)."""
    try:
        with Budget(HARD_STOP_S, ALARM_REPEAT_S, RECURSION_LIMIT) as spent:
            try:
                result: ServiceSpec | BadInput = parse_spec(raw)
            except BadInput as exc:
                result = exc
    except Exception as exc:
        pytest.fail(f"{type(exc).__name__} (not BadInput): {str(exc)[:300]}")
    assert spent.seconds < TIME_LIMIT_S, f"took {spent.seconds:.2f} s"
    if isinstance(result, BadInput):
        assert_one_line(result)
    return result


# --- the specs mutated ---------------------------------------------------------------------

def _example(path: Path) -> tuple[str, dict[str, Any]]:
    doc = yaml.safe_load(path.read_text())
    return doc["metadata"]["name"], doc["spec"]


BUILT = {
    # Every field of a hub model, adapters from the hub, keys, tools, a pool, KEDA's add-on.
    "hub-everything": {
        "model": {"uri": "hf://Qwen/Qwen2-0.5B@main", "name": "qwen",
                  "tokenSecretRef": {"name": "hf-token", "key": "token"},
                  "endpoint": "https://huggingface.co",
                  "cache": {"persistentVolumeClaim": {"claimName": "hf-cache"}}},
        "adapters": [{"name": "sql", "uri": "hf://org/sql-lora"},
                     {"name": "chat", "uri": "hf://org/chat-lora@v1"}],
        "engine": {"maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 4,
                   "schedulingPolicy": "priority", "priorityHeadroom": 0.1,
                   "headroomPriority": -5, "seed": 7, "generationConfig": "vllm"},
        "apiKeySecretRef": {"name": "api-key", "key": "key"},
        "allowRuntimeLoraUpdating": True,
        "tools": {"toolCallParser": "hermes", "enableAutoToolChoice": True},
        "inferencePool": {"endpointPicker": {"name": "epp", "port": 9002,
                                             "failureMode": "FailOpen"}},
        "autoscaling": {"provider": "keda", "minReplicas": 0, "maxReplicas": 3,
                        "metric": "requestsWaiting", "target": 4,
                        "httpAddOn": {"hosts": ["hub-everything.team-a.svc"], "concurrency": 10,
                                      "coldStart": "retryAfter"}},
        "maxQueueWaitSeconds": 30, "maxQueueLength": 64,
    },
    # Sleep mode, tenants and the line's fields, on a claim.
    "sleep-tenants": {
        "model": {"path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "w"}}},
        "engine": {"enableSleepMode": True, "enforceEager": True, "blockSize": 32,
                   "maxNumSeqs": 4, "maxNumBatchedTokens": 4096, "admission": "reserve"},
        "memory": {"kvCacheMemoryBytes": "2Gi", "gpuMemoryUtilization": 0.9},
        "sleep": 1, "gpus": 1,
        "tenantsSecretRef": {"name": "tenants", "key": "tenants.yaml"},
        "maxQueueLengthPerTenant": 8, "tenantFairness": False, "shutdownGraceSeconds": 0,
    },
    # Every placement field, resources, adapters from the model's volume, HPA scaling.
    "placement": {
        "model": {"path": "/models/m", "name": "m",
                  "volume": {"persistentVolumeClaim": {"claimName": "w"}}},
        "adapters": [{"name": "a", "uri": "/models/adapters/a"}],
        "resources": {"requests": {"cpu": "4", "memory": "16Gi"},
                      "limits": {"memory": "32Gi", "ephemeral-storage": "10Gi"}},
        "autoscaling": {"maxReplicas": 4, "target": "800m"},
        "image": "registry.example/kvledger:1.0",
        **PLACEMENT,
    },
    # A group: 4 pods of 2 GPUs, a stage a pod.
    "group": {
        "model": {"path": "/models/m", "volume": {"hostPath": {"path": "/srv/models"}}},
        "engine": {"pipelineParallelSize": 4, "quantization": "fp8",
                   "safetensorsLoadStrategy": "prefetch"},
        "gpus": 2, "nodes": 4, "replicas": 2, "port": 9000,
        "autoscaling": {"provider": "keda", "maxReplicas": 4, "metric": "rejectionRate",
                        "prometheus": {"serverAddress": "http://prom:9090"}},
    },
}
# A base's key -> (the resource's name, its spec).
BASES = {**{path.stem: _example(path) for path in sorted((ROOT / "examples").glob("*.yaml"))},
         **{f"built-{name}": (name, spec) for name, spec in BUILT.items()}}


@pytest.mark.parametrize("base", sorted(BASES))
def test_bases_are_stored_and_render(base) -> None:
    """Each spec the fuzz starts from is one the API server stores, and renders under the
    admin's policy that allows what it asks: the fuzz cannot pass by refusing everything."""
    name, spec = BASES[base]
    raw = stored(copy.deepcopy(spec))
    assert raw is not None, "the API server would refuse it"
    assert isinstance(check(name, raw), list)


# --- values drawn from each field's schema -------------------------------------------------

ITEM, KEY = object(), object()  # a path's list item, a map's key
DELETE = object()  # a mutation that removes the field

_LONG = 100_000
HOSTILE_STRINGS = (
    "", " ", "a", "x\n", "\n", "a\nb", "\r", "\x00", "\t", "\u2028", "é", "日本語", "🙂" * 64,
    "-", "--help", "--model=/etc", "-x", "$(HOSTNAME)", "${HOME}", "{name}", "a=b", "a b",
    "..", "/", "//", "/..", "/../etc", "/models/../etc", "/models/", "/models/a/../..",
    "/models" + "/." * 2000, "/" + "a" * 4095, "/" + "é" * 4095, "/" + "a/" * 2047,
    "/\n", "/a\nb", "/\x00",
    "hf://a/b", "hf://a/b@", "hf://a/b@\n", "hf://a/b@x\ny", "hf://-a/b", "hf://a/b@..",
    "hf://" + "a" * 96 + "/" + "b" * 96 + "@" + "r" * 300, "hf://a/b@" + "r" * 4000,
    "hf://a/b@" + "\n" * 500,
    "http://a", "https://a", "https://[", "https://[::1", "http://" + "a" * 2041,
    "https://" + "%" * 2040, "http://a/\x0b", "https://huggingface.co/",
    "0", "1", "00", "0.0", ".5", "1.", "1.5", "1m", "0m", "1001m", "9" * 32, "0" * 32,
    "0." + "0" * 29 + "1", "1" * 400, "0" * 5000, "9" * 5000, "1" * 400 + "Ei",
    "0" * 5000 + "1", "0" * 5000 + "1Gi", "0" * 5000 + ".5", "1e" + "9" * 5000,
    "1e" + "0" * 5000 + "5", "1." + "0" * 5000 + "1Ki", "0" * 64 + "1Gi",
    "8Ei", "7.99Ei", "1E", "1e30", "1e31", "1e-30", "-1", "+1", "1Gi",
    "0.5", "1.5Gi", "40GiB", "1Ki", "1000000000000000000000000Gi",
    "9" * _LONG, "0." + "0" * _LONG + "1", "1" + "0" * _LONG + "Ki", "9" * 1_000_000,
    "5m", "1h30m", "0s", "1" * 31 + "h", "0.000000000000000000000000001ms",
    "*", "*.", "*.a", "a.b", "A", "a-", "-a", "a" * 63, "a" * 64, "a" * 253, "a" * 254,
    "a" + "." * 251 + "a", "." * 253, "-" * 253, "A" * 128, "a:b/c@d+e", "a" * 128,
    "node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master",
    "kvledger.dev/inferenceservice", "nvidia.com/gpu", "memory", "cpu",
    "x" * _LONG, "x\n" * 20_000, "é" * _LONG,
)
_EDGE_INTS = (0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 63, 64, 65, 100, 255, 256, 257, 511,
              512, 1023, 1024, 1025, 3600, 3601, 65535, 65536, 100000, 100001,
              2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1)
_EDGE_FLOATS = (5e-324, 1e-300, 1e-9, 0.1, 0.5, 0.9, 0.99, 0.9999999999999999, 1e-7, 1.5,
                2.5, 1e20, 1e21, 1e300, 1.7976931348623157e308)


def _pick(strings: tuple[str, ...] | list[str]) -> st.SearchStrategy[str]:
    """One of ``strings`` (drawn by index: a strategy's repr, which Hypothesis prints,
    would hold them all, megabytes)."""
    return st.integers(0, len(strings) - 1).map(strings.__getitem__)


def _keeps_string(schema: dict[str, Any], text: str) -> bool:
    if not schema.get("minLength", 0) <= len(text) <= schema.get("maxLength", len(text)):
        return False
    if "enum" in schema and text not in schema["enum"]:
        return False
    return "pattern" not in schema or _api_regex(schema["pattern"]).search(text) is not None


def _ints(schema: dict[str, Any]) -> st.SearchStrategy[int]:
    low, high = schema.get("minimum", INT64[0]), schema.get("maximum", INT64[1])
    low = max(INT64[0], low + 1 if schema.get("exclusiveMinimum") else low)
    high = min(INT64[1], high - 1 if schema.get("exclusiveMaximum") else high)
    edges = sorted({v for e in (*_EDGE_INTS, low, high, low + 1, high - 1, -1, -(2**63))
                    for v in (e,) if low <= v <= high})
    return st.sampled_from(edges) | st.integers(low, min(high, low + 300))


def _numbers(schema: dict[str, Any]) -> st.SearchStrategy[float | int]:
    low, high = schema.get("minimum"), schema.get("maximum")
    floats = st.floats(low, high, exclude_min=bool(schema.get("exclusiveMinimum")),
                       exclude_max=bool(schema.get("exclusiveMaximum")),
                       allow_nan=False, allow_infinity=False)
    edges = [v for v in (*_EDGE_FLOATS, *(1 - e for e in _EDGE_FLOATS if e < 1), 0, 1, 0.0)
             if (low is None or v > low or (v == low and not schema.get("exclusiveMinimum")))
             and (high is None or v < high
                  or (v == high and not schema.get("exclusiveMaximum")))]
    return (st.sampled_from(edges) | floats) if edges else floats


def _strings(schema: dict[str, Any]) -> st.SearchStrategy[str]:
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kept = [s for s in HOSTILE_STRINGS if _keeps_string(schema, s)]
    out = st.text(max_size=12).filter(lambda s: _keeps_string(schema, s))
    if "pattern" in schema:
        out = st.from_regex(_api_regex(schema["pattern"]), fullmatch=True).filter(
            lambda s: _keeps_string(schema, s))
    return (_pick(kept) | out) if kept else out


def _json_value() -> st.SearchStrategy[Any]:
    """Any small JSON value, of hostile strings and numbers."""
    scalars = st.none() | st.booleans() | st.sampled_from((0, -1, 2**63 - 1, 1.5)) \
        | _pick(HOSTILE_STRINGS[:60])
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(_pick(HOSTILE_STRINGS[:40]), inner,
                                          max_size=3), max_leaves=8)


def _nested(depth: int, shape: str) -> Any:
    """An object about ``depth`` levels deep: maps, lists, or maps of one-item lists (as
    Kubernetes' own terms nest)."""
    value: Any = {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}
    for level in range(depth):
        if shape == "map" or (shape == "mixed" and level % 2):
            value = {"matchExpressions" if level % 3 == 0 else "a": value}
        else:
            value = [value]
    return value if isinstance(value, dict) else {"a": value}


_OPEN_OBJECTS = (
    st.builds(_nested, st.sampled_from((8, 64, 200, 330, 400, 480, 600, 900)),
              st.sampled_from(("map", "list", "mixed")))
    | st.builds(lambda n: {f"k{i}": {"v": [i]} for i in range(n)},
                st.sampled_from((1000, 20_000)))
    | st.dictionaries(_pick(HOSTILE_STRINGS[:60]), _json_value(), max_size=4)
    | st.just({"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": [1], "operator": {"a": 1}, "values": None}]}]},
        "secretKeyRef": {"name": "", "key": None}, "fieldRef": {"fieldPath": "a" * 1000}})
)


# A map's keys: what Kubernetes and the operator read in one (a resource, a label the
# operator sets, a control-plane selector), then anything.
KEYS = ("memory", "cpu", "nvidia.com/gpu", "ephemeral-storage", "hugepages-2Mi",
        "kvledger.dev/inferenceservice", "app.kubernetes.io/name",
        "node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master",
        "leaderworkerset.sigs.k8s.io/worker-index", "llm-d.ai/inference-serving")


def _map_keys() -> st.SearchStrategy[str]:
    return (st.sampled_from(KEYS) | _pick(HOSTILE_STRINGS)
            | st.text(max_size=8))


def _fitting(value: Any, count: int) -> int:
    """How many of ``value`` (at most ``count``) a list or map may repeat and still be
    stored (``STORED_LIMIT_BYTES``): a larger one is refused anyway, and a thousand copies
    of a large map would take the test gigabytes before ``stored`` could say so."""
    try:
        size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()) + 1
    except (RecursionError, ValueError):
        return 1
    return max(1, min(count, STORED_LIMIT_BYTES // size))


@cache
def values(node_id: int) -> st.SearchStrategy[Any]:
    """Values the schema node (by ``id``, in ``_NODES``) takes, and hostile ones near it."""
    schema = _NODES[node_id]
    if schema.get("x-kubernetes-int-or-string"):
        return _ints(schema) | _strings(schema)
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return _OPEN_OBJECTS
    kind = schema.get("type")
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if kind == "integer":
        return _ints(schema)
    if kind == "number":
        return _numbers(schema)
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return _strings(schema)
    if kind == "array":
        item = st.deferred(lambda: values(id(schema["items"])))
        most = schema.get("maxItems", 64)
        return (st.lists(item, min_size=schema.get("minItems", 0), max_size=min(most, 4))
                | st.builds(lambda v, n: [copy.deepcopy(v) for _ in range(_fitting(v, n))], item,
                            st.sampled_from(sorted({2, most}))))
    if kind == "object":
        if isinstance(schema.get("additionalProperties"), dict):
            value = st.deferred(lambda: values(id(schema["additionalProperties"])))
            return (st.dictionaries(_map_keys(), value, max_size=4)
                    | st.builds(lambda v, n: {f"k{i}.example/x": copy.deepcopy(v)
                                              for i in range(_fitting(v, n))}, value,
                                st.sampled_from((100, 5000))))
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        lazy = {name: st.deferred(lambda sub=sub: values(id(sub))) for name, sub in properties.items()}
        return st.fixed_dictionaries({n: s for n, s in lazy.items() if n in required},
                                     optional={n: s for n, s in lazy.items() if n not in required})
    return _json_value()


def _fields(schema: dict[str, Any], path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], dict]]:
    """(path, schema) of every node under ``spec``: a field's name, ITEM, KEY."""
    out = [(path, schema)]
    for name, sub in schema.get("properties", {}).items():
        out += _fields(sub, (*path, name))
    if isinstance(schema.get("items"), dict):
        out += _fields(schema["items"], (*path, ITEM))
    if isinstance(schema.get("additionalProperties"), dict):
        out += _fields(schema["additionalProperties"], (*path, KEY))
    return out


FIELDS = _fields(SPEC_SCHEMA)[1:]
_NODES = {id(schema): schema for _path, schema in _fields(SPEC_SCHEMA)}


class Change:
    """One field of the spec set to ``value`` (or DELETE), at ``path``'s ``slots`` (a list
    item's index, past the end: a new one; a map's key); the objects and list items on its
    way made where missing or of another type. Printed short: a failing example's change
    may hold megabytes."""

    def __init__(self, path: tuple[Any, ...], slots: list[Any], value: Any) -> None:
        self.path, self.slots, self.value = path, slots, value

    def __repr__(self) -> str:
        shown = "DELETE" if self.value is DELETE else repr(self.value)
        where = ".".join(f"[{s}]" if p is ITEM else repr(s) if p is KEY else p
                         for p, s in zip(self.path, self.slots, strict=True))
        return f"Change({where} = {shown[:200]}{'...' if len(shown) > 200 else ''})"

    def __call__(self, spec: dict[str, Any]) -> None:
        node: Any = spec
        value = self.value
        for i, (part, slot) in enumerate(zip(self.path, self.slots, strict=True)):
            if part is ITEM:
                slot = min(slot, len(node))
            if i == len(self.path) - 1:
                if value is DELETE:
                    if part is not ITEM:
                        node.pop(slot, None)
                    elif slot < len(node):
                        del node[slot]
                elif part is ITEM and slot == len(node):
                    node.append(copy.deepcopy(value))
                else:
                    node[slot] = copy.deepcopy(value)
                return
            if part is ITEM and slot == len(node):
                node.append(None)
            want: Any = [] if self.path[i + 1] is ITEM else {}
            if type(node[slot] if part is ITEM else node.get(slot)) is not type(want):
                node[slot] = want
            node = node[slot]


@st.composite
def mutations(draw: Callable[..., Any]) -> Change:
    """A field anywhere in the spec set to a value its schema takes (or near it), or
    deleted."""
    path, schema = draw(st.sampled_from(FIELDS))
    value = draw(st.just(DELETE) | values(id(schema)) | values(id(schema)))
    slots = [draw(st.integers(0, 3)) if part is ITEM else draw(_map_keys()) if part is KEY
             else part for part in path]
    return Change(path, slots, value)


@FUZZ_SETTINGS
@given(base=st.sampled_from(sorted(BASES)), changes=st.lists(mutations(), min_size=1, max_size=4),
       as_written=st.booleans(), default_policy=st.booleans(),
       download_bytes=st.sampled_from((None, 0, 1, 16 * 2**30, 2**63 - 1)),
       start_seconds=st.sampled_from((None, 0, 60, 10**6)))
def test_hostile_spec_is_refused_or_rendered(base, changes, as_written, default_policy,
                                             download_bytes, start_seconds) -> None:
    """Any base spec with up to four fields set anywhere to values its schema takes (or
    deleted), as the API server stores it: BadInput in one short line, or children the
    client sends as written, within the limits, under the admin's default policy and one
    that allows what it asks; ``parse_spec`` alike on the spec as written, without the
    CRD's defaults (``kvledger run``'s)."""
    name, spec = BASES[base]
    spec = copy.deepcopy(spec)
    for change in changes:
        change(spec)
    raw = stored(spec)
    assume(raw is not None)
    try:
        result = check(name, raw, Policy() if default_policy else None,
                       download_bytes=download_bytes, start_seconds=start_seconds)
        event(type(result).__name__ if isinstance(result, BadInput) else "rendered")
        if as_written:  # kvledger run's: the spec as written, no defaults
            check_parse(json.loads(json.dumps(_as_go_writes(spec))))
    except (AssertionError, pytest.fail.Exception) as exc:
        if not _LOG:
            raise
        with open(_LOG, "a") as log:  # the hunt goes on; each finding a line
            log.write(json.dumps({"finding": str(exc).splitlines()[0][:300], "base": base,
                                  "changes": [repr(c) for c in changes]}) + "\n")


# --- what the fuzz found: each a plain test that fails until it is fixed -------------------

def _spec(**fields: Any) -> dict[str, Any]:
    return {"model": {"path": "/models/m", "volume": {"persistentVolumeClaim": {
        "claimName": "w"}}}, **fields}


def _hub(**fields: Any) -> dict[str, Any]:
    return {"model": {"uri": "hf://org/m"}, **fields}


def _stored(spec: dict[str, Any]) -> dict[str, Any]:
    raw = stored(spec)
    assert raw is not None, "the API server would not store it: no tenant can write it"
    return raw


# Hundreds of levels, as a cluster stores them where the CRD keeps a field open: this
# project's CRD did (affinity, an env var's valueFrom) until 2026-12-07, and Helm never
# upgrades a CRD, so a cluster keeps the open one until its admin applies the new.
DEEP = [
    pytest.param("affinity", {"nodeAffinity": _nested(400, "map")}, id="affinity-400-maps"),
    pytest.param("affinity", {"podAntiAffinity": _nested(330, "mixed")},
                 id="affinity-330-maps-and-lists"),
    pytest.param("env", [{"name": "NCCL_DEBUG", "valueFrom": _nested(600, "list")}],
                 id="env-valueFrom-600-lists"),
]


@pytest.mark.parametrize(("field", "value"), DEEP)
def test_a_field_nested_hundreds_deep_never_reaches_the_operator(field, value) -> None:
    """affinity and an env var's valueFrom are typed to their last field (Kubernetes' own
    schemas, operator/api/pod_schemas.json): what nests past them is no field of theirs,
    pruned by the API server, so no tenant can store an object deeper than Kubernetes'
    own (about ten levels; kopf's JSON reader stops at ~990, for every tenant's watch)."""
    raw = _stored(_spec(**{field: value}))
    assert _depth(raw[field]) <= 12


@pytest.mark.parametrize(("field", "value"), DEEP)
def test_a_field_nested_hundreds_deep_is_refused_in_one_line(field, value) -> None:
    """Where a cluster's CRD still keeps the field open: ``parse_spec``'s copy.deepcopy
    raised RecursionError past a few hundred levels, in every reconcile and status sync of
    the resource. Refused in one line naming the field."""
    result = check("m", _spec(**{field: value}))
    assert isinstance(result, BadInput)
    assert str(result).startswith(f"spec.{field} nests deeper than 64 levels")


def test_an_affinity_of_hundreds_of_thousands_of_values_is_refused_at_once() -> None:
    """1.5 MiB of empty node selector terms in an affinity (what etcd stores) is half a
    million values, which ``parse_spec`` and the renderers copied four times over: seconds
    of the event loop every tenant's reconcile shares, at every reconcile and status sync.
    Refused in one line past MAX_SPEC_VALUES (a pod's own fields take a few thousand)."""
    terms = [{} for _ in range(480_000)]
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": terms}}}
    result = check("m", _stored(_spec(affinity=affinity)))
    assert isinstance(result, BadInput) and "more than 20000 values" in str(result)


def test_a_spec_as_deep_and_large_as_kubernetes_own_fields_is_rendered() -> None:
    """The bounds are far past what Kubernetes' fields need: every affinity field at its
    deepest, and env at the CRD's most variables, each from a ConfigMap, parse and render."""
    env = [{"name": "NCCL_DEBUG", "valueFrom": {"configMapKeyRef": {"name": f"s{i}", "key": "k"}}}
           for i in range(1024)]
    term = {"labelSelector": {"matchExpressions": [
                {"key": "app", "operator": "In", "values": [f"v{i}" for i in range(50)]}],
                "matchLabels": {"tier": "gpu"}},
            "namespaceSelector": {"matchLabels": {"team": "a"}},
            "topologyKey": "kubernetes.io/hostname", "matchLabelKeys": ["pod-template-hash"]}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}],
                 "matchFields": [{"key": "metadata.name", "operator": "NotIn",
                                  "values": ["n1"]}]}]},
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 10, "preference": {
                "matchExpressions": [{"key": "zone", "operator": "Exists"}]}}]},
        "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]},
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": term}]},
    }
    raw = _stored(_spec(affinity=affinity, env=env,
                        podAnnotations={f"a{i}": "x" for i in range(1000)}))
    assert raw["affinity"] == affinity  # nothing Kubernetes names is pruned
    assert isinstance(check("m", raw), list)


def test_integer_quantities_of_resources_are_sent_as_strings() -> None:
    """``cpu: 4`` and ``memory: 1073741824`` are quantities the CRD takes (int-or-string, as
    Kubernetes does); the pod was rendered with the integers, which the client's
    V1ResourceRequirements refuses (``kube.typed``: KubeError 422): every apply of the
    Deployment failed and was retried, the resource never Ready nor InvalidSpec."""
    # (A GPU is spec.gpus: one in resources is refused, test_foreign_specs.)
    raw = _stored(_spec(resources={"limits": {"cpu": 4, "memory": 2**30},
                                   "requests": {"cpu": 2, "memory": "512Mi"}}))
    children_and_status = check("m", raw)
    assert isinstance(children_and_status, list)
    deployment = children_and_status[0]
    for container in (*deployment["spec"]["template"]["spec"]["initContainers"],
                      *deployment["spec"]["template"]["spec"]["containers"]):
        assert container["resources"]["requests"] == {"cpu": "2", "memory": "512Mi"}
        assert container["resources"]["limits"]["cpu"] == "4"
    assert parse_spec(raw).container_memory_limit_bytes == 2**30


@pytest.mark.parametrize("memory", [
    pytest.param("9" * 1_000_000, id="a-million-digits-slow"),
    pytest.param("1" + "0" * 300_000 + "Ki", id="300k-digits-and-a-unit-slow"),
    pytest.param("1e" + "9" * 5000, id="exponent-of-5000-digits-ValueError"),
    pytest.param("1e" + "0" * 5000 + "5", id="exponent-with-5000-zeros-ValueError"),
])
def test_a_memory_limit_of_thousands_of_digits_is_refused_at_once(memory) -> None:
    """``resources.limits.memory`` is int-or-string with no pattern (a Kubernetes
    quantity): a million digits took ``quantity_bytes``'s exact arithmetic about 30 s, on
    the event loop every tenant's reconcile shares (and again at each status sync), and an
    exponent of 5,000 digits raised int()'s ValueError. Refused at once, in one line."""
    result = check("m", _stored(_spec(resources={"limits": {"memory": memory}})))
    assert isinstance(result, BadInput) and "is out of range" in str(result)


@pytest.mark.parametrize("field", ["limit", "kvCacheMemoryBytes"])
def test_a_size_with_thousands_of_leading_zeros_reads_as_its_bytes(field) -> None:
    """The SIZE pattern takes any number of leading zeros; ``parse_size`` handed them all to
    Fraction, whose int() refuses more than 4,300 digits (ValueError in parse_spec): the
    previous fix bounded the digits after the zeros only."""
    result = check_parse(_stored(_spec(memory={field: "0" * 5000 + "1Gi"})))
    assert isinstance(result, ServiceSpec)
    config = result.engine
    assert (config.memory_limit_bytes if field == "limit"
            else config.kv_cache_memory_bytes) == 2**30


@pytest.mark.parametrize("spec", [
    # The admin's policy quotes what it refuses: raw, so a newline broke the line and an
    # image (no maxLength in the CRD) ran to its full length.
    pytest.param(_spec(image="registry.example/x:1\nFAKE: approved"), id="image-newline"),
    pytest.param(_spec(image="registry.example/" + "x" * 100_000), id="image-100k-chars"),
    pytest.param(_spec(priorityClassName="high\nFAKE: approved"), id="priorityClassName-newline"),
    pytest.param(_spec(model={"path": "/models/m", "volume": {
        "hostPath": {"path": "/srv\n/etc"}}}), id="hostPath-newline"),
    pytest.param(_spec(model={"path": "/models/m", "volume": {
        "hostPath": {"path": "/" + "é" * 4095}}}), id="hostPath-4096-chars"),
    pytest.param(_hub(model={"uri": "hf://org/m", "endpoint": "https://" + "a" * 2040}),
                 id="endpoint-2048-chars"),
    # parse_spec quoted an adapter's uri and directory raw, or whole.
    pytest.param(_spec(adapters=[{"name": "a", "uri": "hf://org/a@\nFAKE"}]),
                 id="hub-adapter-uri-newline"),
    pytest.param(_spec(adapters=[{"name": "a", "uri": "/" + "a" * 4095}]),
                 id="adapter-directory-4096-chars"),
    pytest.param(_spec(adapters=[{"name": "a", "uri": "/models/../" + "a" * 4000}]),
                 id="adapter-dotdot-4096-chars"),
    pytest.param(_spec(model={"path": "/" + "m" * 4095, "volume": {
        "mountPath": "/" + "m" * 4095, "persistentVolumeClaim": {"claimName": "w"}}},
                       adapters=[{"name": "a", "uri": "/" + "a" * 4095}]),
                 id="adapter-directory-and-mount-8k-chars"),
    # A size or quantity refused was quoted whole.
    pytest.param(_spec(memory={"limit": "0" * 5000}), id="memory-limit-5000-zeros"),
    pytest.param(_spec(memory={"limit": "0" * 5000 + ".5"}), id="memory-limit-fractional-bytes"),
    pytest.param(_spec(resources={"limits": {"memory": "x" * 100_000}}),
                 id="resources-memory-100k-junk"),
])
def test_a_refusal_quoting_the_spec_stays_one_short_line(spec) -> None:
    """A refusal becomes the resource's Ready condition and an event: one line a person
    reads, whatever the value it names holds (the CRD lets newlines and thousands of
    characters through where it has no pattern or a loose one)."""
    result = check("m", _stored(spec), Policy())
    assert isinstance(result, BadInput)
