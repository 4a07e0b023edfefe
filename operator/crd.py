"""The InferenceService CustomResourceDefinition, as one Python dict.

This dict is the single source of truth for the schema: ``crds/inferenceservice.yaml``
and the chart's ``charts/kvledger/crds/inferenceservice.yaml`` are rendered from it
(``python -m kvledger.operator.crd``; a test checks both files match), and
``kvledger run`` validates manifests against it directly.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import jsonschema
import yaml

from kvledger.engine.config import DTYPES, KV_CACHE_DTYPES
from kvledger.engine.errors import BadInput

GROUP = "kvledger.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
# KServe owns "isvc"; ours must not clash with it.
SHORT_NAMES = ["kvis"]
API_VERSION = f"{GROUP}/{VERSION}"
DEFAULT_MOUNT_PATH = "/models"
DEFAULT_PORT = 8000

# Kubernetes-quantity-like sizes, the same set engine.config.parse_size accepts.
SIZE_PATTERN = r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?B?|[kKMGTPE]B?|B)?$"


def _int(minimum: int, description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "description": description, **extra}


_SIZE = {"type": "string", "pattern": SIZE_PATTERN}
# Structural int-or-string: the anyOf must be exactly these two bare types; value checks
# sit beside it (minimum applies to the integer, pattern to the string), as for Quantity.
_INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]
_SIZE_OR_BYTES = {
    "x-kubernetes-int-or-string": True,
    "anyOf": _INT_OR_STRING,
    "minimum": 1,
    "pattern": SIZE_PATTERN,
}

_MODEL = {
    "type": "object",
    "required": ["path"],
    "description": "The checkpoint (config.json, safetensors, tokenizer.json).",
    "properties": {
        "path": {"type": "string", "pattern": "^/", "maxLength": 4096,
                 "description": "Checkpoint directory as the pod sees it (under volume.mountPath)."},
        "name": {"type": "string", "minLength": 1,
                 "description": "Served model name (--served-model-name)."},
        "volume": {
            "type": "object",
            "description": "Where the checkpoint lives; mounted read-only at mountPath.",
            "properties": {
                "persistentVolumeClaim": {
                    "type": "object", "required": ["claimName"],
                    "properties": {"claimName": {"type": "string", "minLength": 1}},
                },
                "hostPath": {
                    "type": "object", "required": ["path"],
                    "properties": {"path": {"type": "string", "pattern": "^/",
                                            "maxLength": 4096}},
                },
                "mountPath": {"type": "string", "pattern": "^/", "maxLength": 4096,
                              "default": DEFAULT_MOUNT_PATH},
            },
            "x-kubernetes-validations": [{
                "rule": "has(self.persistentVolumeClaim) != has(self.hostPath)",
                "message": "set exactly one of persistentVolumeClaim and hostPath",
            }],
        },
    },
    "x-kubernetes-validations": [{
        # Checked as strings, so a '..' could climb out of the mount: refuse the segment.
        "rule": "!self.path.matches('(^|/)[.][.](/|$)')",
        "message": "model.path must not contain a '..' segment",
    }, {
        "rule": "!has(self.volume) || self.path == self.volume.mountPath"
                " || self.path.startsWith(self.volume.mountPath + '/')",
        "message": "model.path must lie under model.volume.mountPath",
    }],
}

_ENGINE = {
    "type": "object",
    "description": "Workload flags, named as vLLM names them (camelCase).",
    "properties": {
        "maxModelLen": _int(1, "context limit in tokens (--max-model-len)"),
        "maxNumSeqs": _int(1, "concurrent sequences (--max-num-seqs)"),
        "maxNumBatchedTokens": _int(1, "tokens per engine step (--max-num-batched-tokens)"),
        "blockSize": _int(1, "tokens per KV block (--block-size)", maximum=1024),
        "dtype": {"type": "string", "enum": list(DTYPES)},
        "kvCacheDtype": {"type": "string", "enum": list(KV_CACHE_DTYPES)},
        "enforceEager": {"type": "boolean"},
        "seed": {"type": "integer", "minimum": 0},
    },
    "x-kubernetes-validations": [{
        "rule": "!has(self.maxNumBatchedTokens) || !has(self.maxNumSeqs)"
                " || self.maxNumBatchedTokens >= self.maxNumSeqs",
        "message": "maxNumBatchedTokens must be at least maxNumSeqs (every running sequence decodes one token per step)",
    }],
}

_MEMORY = {
    "type": "object",
    "description": "Memory caps; the smallest one given wins. None: auto-size to the workload.",
    "properties": {
        "limit": {**_SIZE, "description": "hard limit on device memory, e.g. 40Gi (--memory-limit)"},
        "gpuMemoryUtilization": {
            "type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1,
            "description": "cap as a fraction of the device's total memory, in (0, 1]",
        },
        "numGpuBlocksOverride": _int(1, "exact KV pool size in blocks"),
        "kvCacheMemoryBytes": {**_SIZE_OR_BYTES, "description": "KV pool size, e.g. 4Gi"},
    },
}

_QUANTITY = {"x-kubernetes-int-or-string": True, "anyOf": _INT_OR_STRING}

_SPEC = {
    "type": "object",
    "required": ["model"],
    "properties": {
        "model": _MODEL,
        "engine": _ENGINE,
        "memory": _MEMORY,
        "gpus": _int(0, "GPUs per replica (nvidia.com/gpu)", default=1),
        "replicas": _int(0, "pods serving this model", default=1),
        "image": {"type": "string", "minLength": 1,
                  "description": "kvledger image (default: the operator's configured image)"},
        "port": _int(1, "HTTP port of the engine and the Service", maximum=65535,
                     default=DEFAULT_PORT),
        "resources": {
            "type": "object",
            "description": "CPU and host memory of the engine container (GPUs come from gpus).",
            "properties": {
                "limits": {"type": "object", "additionalProperties": _QUANTITY},
                "requests": {"type": "object", "additionalProperties": _QUANTITY},
            },
        },
    },
}

_CONDITION = {
    "type": "object",
    "required": ["type", "status"],
    "properties": {
        "type": {"type": "string"},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "observedGeneration": {"type": "integer"},
    },
}

_STATUS = {
    "type": "object",
    "properties": {
        "conditions": {
            "type": "array", "items": _CONDITION,
            "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"],
        },
        "plan": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                 "description": "the pre-flight plan's numbers (bytes) and human sizes"},
        "observedGeneration": {"type": "integer"},
        "readyReplicas": {"type": "integer"},
        "endpoint": {"type": "string"},
    },
}


def _ready(field: str) -> str:
    return '.status.conditions[?(@.type=="Ready")].' + field


PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string", "jsonPath": _ready("status")},
    {"name": "Reason", "type": "string", "jsonPath": _ready("reason")},
    {"name": "Fits", "type": "boolean", "jsonPath": ".status.plan.fits"},
    {"name": "Required", "type": "string", "jsonPath": ".status.plan.required"},
    {"name": "Limit", "type": "string", "jsonPath": ".status.plan.limit"},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition object (a fresh copy each call)."""
    return copy.deepcopy({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": SINGULAR,
                      "shortNames": SHORT_NAMES, "categories": ["kvledger"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "An LLM served by kvledger, memory planned before start.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": _SPEC,
                        "status": _STATUS,
                    },
                }},
            }],
        },
    })


def crd_yaml() -> str:
    header = ("# Generated from operator/crd.py: do not edit; regenerate with\n"
              "#   python -m kvledger.operator.crd > crds/inferenceservice.yaml\n")
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=100)


def openapi_schema() -> dict[str, Any]:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Reject unknown fields, as kubectl's default ``--validate=strict`` does."""
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    for value in schema.get("properties", {}).values():
        _strict(value)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            _strict(schema[key])
    return schema


def validate_manifest(doc: Any) -> dict[str, Any]:
    """Check an InferenceService manifest against the CRD schema; return it.

    OpenAPI 3.0 schemas are JSON Schema draft 4 (boolean ``exclusiveMinimum``). The CEL
    rules are checked by ``spec.engine_config`` with the same wording.
    Raises BadInput naming the first offending field.
    """
    if not isinstance(doc, dict):
        raise BadInput("manifest must be a YAML mapping (an InferenceService)")
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        raise BadInput(f"manifest must be apiVersion: {API_VERSION}, kind: {KIND}; "
                       f"got {doc.get('apiVersion')!r}, {doc.get('kind')!r}")
    schema = _strict(openapi_schema())
    # The Deployment and Service are named as the resource, and a Service name must be a
    # DNS-1035 label; the API server checks that, so `kvledger run` does it here.
    schema["properties"]["metadata"] = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "maxLength": 63,
                 "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$"}}}
    errors = sorted(jsonschema.Draft4Validator(schema).iter_errors(doc),
                    key=lambda e: list(e.absolute_path))
    if errors:
        error = errors[0]
        where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
        raise BadInput(f"invalid InferenceService at {where}: {_short(error)}")
    return doc


def _short(error: jsonschema.ValidationError) -> str:
    if error.validator == "additionalProperties":
        return error.message.replace("Additional properties are not allowed", "unknown field(s)")
    if error.validator == "anyOf":
        return f"{error.instance!r} is neither an integer nor a string"
    return error.message


if __name__ == "__main__":
    sys.stdout.write(crd_yaml())
