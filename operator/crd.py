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
DEFAULT_SHUTDOWN_GRACE_S = 30  # serve's own default
# The engine runs on one device: a second GPU would be requested and sit idle.
GPUS_MESSAGE = ("gpus must be 0 or 1: kvledger has no tensor parallelism yet, so the engine "
                "would use one GPU of those requested")

# Autoscaling: what the HPA or KEDA scales the InferenceService on (operator/autoscaling.py
# names the Prometheus series), and who does it.
AUTOSCALING_METRICS = ("kvReservedRatio", "requestsWaiting", "rejectionRate")
AUTOSCALING_PROVIDERS = ("hpa", "keda")
# A per-pod target: a whole number, a decimal, or thousandths ("800m"), as a quantity.
TARGET_PATTERN = r"^([0-9]+([.][0-9]+)?|[.][0-9]+|[0-9]+m)$"
MIN_REPLICAS_MESSAGE = ("autoscaling.minReplicas 0 (scale to zero) needs provider keda: an "
                        "HPA cannot scale to zero")
MIN_MAX_MESSAGE = "autoscaling.minReplicas must be at most autoscaling.maxReplicas"
PROMETHEUS_MESSAGE = ("autoscaling.prometheus applies to provider keda only (an HPA reads its "
                      "Pods metric through prometheus-adapter)")
TARGET_POSITIVE_MESSAGE = "autoscaling.target must be more than 0"
RATIO_MESSAGE = ("autoscaling.target of kvReservedRatio is a share of the KV pool: at most 1 "
                 "(e.g. \"0.8\")")

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

# hf://ORG/NAME[@REVISION], as the engine parses it (engine/planner/hub/repo.py): each name is
# letters, digits, '_', with single '-' or '.' between them; the revision is a branch, tag
# or commit ('/' between parts, as refs/pr/1). The engine also caps a name at 96 characters.
_HUB_NAME = r"[A-Za-z0-9_]([-.]?[A-Za-z0-9_])*"
HUB_URI_PATTERN = (rf"^hf://{_HUB_NAME}/{_HUB_NAME}"
                   r"(@[A-Za-z0-9_.][-A-Za-z0-9_.]*(/[-A-Za-z0-9_.]+)*)?$")
# A Secret's name is a DNS-1123 subdomain; a key is letters, digits, '-', '_' and '.'.
_SECRET_NAME = {"type": "string", "minLength": 1, "maxLength": 253,
                "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"}
_SECRET_KEY = {"type": "string", "minLength": 1, "maxLength": 253,
               "pattern": r"^[-._a-zA-Z0-9]+$"}
_CLAIM = {"type": "object", "required": ["claimName"],
          "properties": {"claimName": {"type": "string", "minLength": 1, "maxLength": 253}}}

_MODEL = {
    "type": "object",
    "description": "The checkpoint (config.json, safetensors, tokenizer.json): a directory "
                   "(path) or a Hugging Face Hub repository (uri); exactly one of the two.",
    "properties": {
        "path": {"type": "string", "pattern": "^/", "maxLength": 4096,
                 "description": "Checkpoint directory as the pod sees it (under volume.mountPath)."},
        "uri": {"type": "string", "pattern": HUB_URI_PATTERN, "maxLength": 512,
                "description": "hf://ORG/NAME[@REVISION]: planned from its headers over HTTP, "
                               "then downloaded by the fetch init container into the cache."},
        "name": {"type": "string", "minLength": 1,
                 "description": "Served model name (--served-model-name)."},
        "volume": {
            "type": "object",
            "description": "Where the checkpoint lives; mounted read-only at mountPath.",
            "properties": {
                "persistentVolumeClaim": _CLAIM,
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
        "tokenSecretRef": {
            "type": "object", "required": ["name", "key"],
            "description": "The Secret key holding the Hub token (HF_TOKEN of the preflight "
                           "and fetch containers; the operator reads it to size the cache).",
            "properties": {"name": _SECRET_NAME, "key": _SECRET_KEY},
        },
        "endpoint": {"type": "string", "pattern": r"^https?://\S+$", "maxLength": 2048,
                     "description": "A Hub mirror (HF_ENDPOINT of the preflight and fetch "
                                    "containers), e.g. https://hf-mirror.example.com"},
        "cache": {
            "type": "object", "required": ["persistentVolumeClaim"],
            "description": "Where the download goes, shared by replicas and restarts (default: "
                           "an emptyDir per pod, sized from the checkpoint).",
            "properties": {"persistentVolumeClaim": _CLAIM},
        },
    },
    "x-kubernetes-validations": [{
        "rule": "has(self.path) != has(self.uri)",
        "message": "set exactly one of model.path and model.uri",
    }, {
        # Checked as strings, so a '..' could climb out of the mount: refuse the segment.
        "rule": "!has(self.path) || !self.path.matches('(^|/)[.][.](/|$)')",
        "message": "model.path must not contain a '..' segment",
    }, {
        "rule": "!has(self.volume) || !has(self.path) || self.path == self.volume.mountPath"
                " || self.path.startsWith(self.volume.mountPath + '/')",
        "message": "model.path must lie under model.volume.mountPath",
    }, {
        "rule": "!has(self.uri) || !has(self.volume)",
        "message": "model.volume holds a model.path checkpoint; a model.uri is downloaded "
                   "into model.cache",
    }, {
        "rule": "has(self.uri) || !(has(self.tokenSecretRef) || has(self.endpoint)"
                " || has(self.cache))",
        "message": "model.tokenSecretRef, model.endpoint and model.cache apply to a model.uri "
                   "only",
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
        "enablePrefixCaching": {"type": "boolean", "description": "share computed prompt "
                                "blocks between requests (default true)"},
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

_AUTOSCALING = {
    "type": "object",
    "description": "Scale spec.replicas on a per-pod metric: the operator owns an HPA (provider "
                   "hpa) or a KEDA ScaledObject (provider keda) whose target is this resource's "
                   "scale subresource.",
    "required": ["maxReplicas"],
    "properties": {
        "minReplicas": _int(0, "fewest pods (0 only with provider keda)", default=1),
        "maxReplicas": _int(1, "most pods"),
        "metric": {"type": "string", "enum": list(AUTOSCALING_METRICS),
                   "default": AUTOSCALING_METRICS[0],
                   "description": "kvReservedRatio (share of KV blocks reserved, 0..1), "
                                  "requestsWaiting (requests queued for a reservation) or "
                                  "rejectionRate (429s for a full KV cache per second)"},
        "target": {
            "x-kubernetes-int-or-string": True, "anyOf": _INT_OR_STRING,
            "minimum": 1, "pattern": TARGET_PATTERN, "maxLength": 32,
            "description": "per-pod average of the metric to hold, a quantity (4, \"0.8\", "
                           "\"800m\"); default 0.8 for kvReservedRatio, 4 for "
                           "requestsWaiting, 1 for rejectionRate",
        },
        "provider": {"type": "string", "enum": list(AUTOSCALING_PROVIDERS),
                     "default": AUTOSCALING_PROVIDERS[0]},
        "prometheus": {
            "type": "object",
            "description": "provider keda: where KEDA queries the metric (default: the "
                           "operator's --prometheus-url)",
            "properties": {"serverAddress": {"type": "string", "pattern": r"^https?://\S+$",
                                             "maxLength": 2048}},
        },
    },
    "x-kubernetes-validations": [{
        "rule": "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
        "message": MIN_MAX_MESSAGE,
    }, {
        "rule": "!has(self.minReplicas) || self.minReplicas >= 1"
                " || has(self.provider) && self.provider == 'keda'",
        "message": MIN_REPLICAS_MESSAGE,
    }, {
        "rule": "!has(self.prometheus) || has(self.provider) && self.provider == 'keda'",
        "message": PROMETHEUS_MESSAGE,
    }, {
        "rule": "!has(self.target) || type(self.target) != string"
                " || !self.target.matches('^[0.]*m?$')",
        "message": TARGET_POSITIVE_MESSAGE,
    }, {
        # The metric defaults to kvReservedRatio (the API server defaults before it validates).
        "rule": "(has(self.metric) ? self.metric : 'kvReservedRatio') != 'kvReservedRatio'"
                " || !has(self.target) || (type(self.target) == int ? self.target <= 1"
                " : self.target.matches('^(0*([.][0-9]+)?|0*1([.]0+)?|0*[0-9]{1,3}m|0*1000m)$'))",
        "message": RATIO_MESSAGE,
    }],
}

# Pod placement and environment, passed to the pod template as Kubernetes names them.
# What is simple is typed; what Kubernetes' own schema makes huge (affinity terms, an env
# var's valueFrom) keeps its unknown fields, and the API server checks it in the pod.
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_OPEN_OBJECT = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
_NAME_REF = {"type": "object", "required": ["name"],
             "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 253}}}
_TOLERATION = {
    "type": "object",
    "properties": {
        "key": {"type": "string", "maxLength": 317},
        "operator": {"type": "string", "enum": ["Exists", "Equal"]},
        "value": {"type": "string", "maxLength": 63},
        "effect": {"type": "string", "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
        "tolerationSeconds": {"type": "integer", "format": "int64"},
    },
    # What the API server would refuse in the pod, refused at `kubectl apply` instead.
    "x-kubernetes-validations": [{
        "rule": "has(self.key) && self.key != '' || has(self.operator) && self.operator == 'Exists'",
        "message": "a toleration without a key must have operator Exists",
    }, {
        "rule": "!has(self.operator) || self.operator != 'Exists' || !has(self.value)"
                " || self.value == ''",
        "message": "a toleration with operator Exists takes no value",
    }, {
        "rule": "!has(self.tolerationSeconds) || has(self.effect) && self.effect == 'NoExecute'",
        "message": "tolerationSeconds applies to effect NoExecute only",
    }],
}
_ENV_VAR = {
    "type": "object", "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 4096},
        "value": {"type": "string"},
        "valueFrom": {**_OPEN_OBJECT, "description": "as in a container's env "
                      "(secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef)"},
    },
    "x-kubernetes-validations": [{
        "rule": "!has(self.value) || !has(self.valueFrom)",
        "message": "an env var takes value or valueFrom, not both",
    }],
}
_ENV_SOURCE_REF = {"type": "object", "required": ["name"],
                   "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 253},
                                  "optional": {"type": "boolean"}}}
_ENV_FROM = {
    "type": "object",
    "properties": {"prefix": {"type": "string"}, "configMapRef": _ENV_SOURCE_REF,
                   "secretRef": _ENV_SOURCE_REF},
    "x-kubernetes-validations": [{
        "rule": "has(self.configMapRef) != has(self.secretRef)",
        "message": "an envFrom entry takes exactly one of configMapRef and secretRef",
    }],
}
_PLACEMENT = {
    "nodeSelector": {**_STRING_MAP, "description": "the pod's nodeSelector"},
    "tolerations": {"type": "array", "items": _TOLERATION, "maxItems": 64,
                    "description": "the pod's tolerations (default with gpus > 0: "
                                   "nvidia.com/gpu Exists NoSchedule)"},
    "affinity": {
        "type": "object", "description": "the pod's affinity, as Kubernetes writes it",
        "properties": {"nodeAffinity": _OPEN_OBJECT, "podAffinity": _OPEN_OBJECT,
                       "podAntiAffinity": _OPEN_OBJECT},
    },
    "priorityClassName": {"type": "string", "minLength": 1, "maxLength": 253},
    "runtimeClassName": {"type": "string", "minLength": 1, "maxLength": 253},
    "imagePullSecrets": {"type": "array", "items": _NAME_REF, "maxItems": 64},
    "serviceAccountName": {"type": "string", "minLength": 1, "maxLength": 253,
                           "description": "the pods' service account (its token is still not "
                                          "mounted: neither container calls the API server)"},
    "env": {"type": "array", "items": _ENV_VAR, "maxItems": 1024,
            "description": "env of every container (preflight, fetch, engine); the "
                           "operator's own HF_* variables win over the same names"},
    "envFrom": {"type": "array", "items": _ENV_FROM, "maxItems": 64,
                "description": "envFrom of every container"},
    "podAnnotations": {**_STRING_MAP, "description": "annotations of the pod template"},
    "podLabels": {**_STRING_MAP, "description": "labels of the pod template; the operator's "
                  "own labels win over the same keys"},
}

_SPEC = {
    "type": "object",
    "required": ["model"],
    "properties": {
        "model": _MODEL,
        "engine": _ENGINE,
        "memory": _MEMORY,
        "gpus": _int(0, "GPUs per replica (nvidia.com/gpu); at most 1 until kvledger has "
                        "tensor parallelism", default=1, **{"x-kubernetes-validations": [{
                            "rule": "self <= 1",
                            "message": GPUS_MESSAGE,
                        }]}),
        "replicas": _int(0, "pods serving this model (the scale subresource's; with "
                            "autoscaling, the autoscaler writes it)", default=1),
        "image": {"type": "string", "minLength": 1,
                  "description": "kvledger image (default: the operator's configured image)"},
        "port": _int(1, "HTTP port of the engine and the Service", maximum=65535,
                     default=DEFAULT_PORT),
        "shutdownGraceSeconds": _int(0, "on SIGTERM (scale-down, rollout, eviction), how "
                                        "long in-flight requests may finish before they are "
                                        "aborted (--shutdown-grace); the pod's grace is 20 s "
                                        "more", maximum=3600, default=DEFAULT_SHUTDOWN_GRACE_S),
        "maxQueueWaitSeconds": _int(0, "how long a request may wait in line for its KV "
                                       "reservation before a 429 (--max-queue-wait; 0: "
                                       "refused at once); what requestsWaiting autoscaling "
                                       "counts", maximum=600, default=0),
        "resources": {
            "type": "object",
            "description": "CPU and host memory of the engine container (GPUs come from gpus).",
            "properties": {
                "limits": {"type": "object", "additionalProperties": _QUANTITY},
                "requests": {"type": "object", "additionalProperties": _QUANTITY},
            },
        },
        **_PLACEMENT,
        "autoscaling": _AUTOSCALING,
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
        "model": {
            "type": "object",
            "description": "the hub model's download size, asked once per uri to size the "
                           "emptyDir cache",
            "properties": {"uri": {"type": "string"},
                           "downloadBytes": {"type": "integer", "format": "int64"}},
        },
        "observedGeneration": {"type": "integer"},
        "replicas": {"type": "integer",
                     "description": "pods the Deployment has (the scale subresource's)"},
        "readyReplicas": {"type": "integer"},
        "selector": {"type": "string",
                     "description": "label selector of the pods (the scale subresource's: "
                                    "the HPA reads its Pods metrics with it)"},
        "endpoint": {"type": "string"},
    },
}


SCALE_SUBRESOURCE = {"specReplicasPath": ".spec.replicas",
                     "statusReplicasPath": ".status.replicas",
                     "labelSelectorPath": ".status.selector"}


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
                # kubectl scale and autoscalers write spec.replicas through "scale".
                "subresources": {"status": {}, "scale": SCALE_SUBRESOURCE},
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


class _NoAliases(yaml.SafeDumper):
    """Shared sub-schemas written out in full each time, not as YAML anchors (&id001)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def crd_yaml() -> str:
    header = ("# Generated from operator/crd.py: do not edit; regenerate with\n"
              "#   python -m kvledger.operator.crd > crds/inferenceservice.yaml\n")
    return header + yaml.dump(crd_manifest(), Dumper=_NoAliases, sort_keys=False, width=100)


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
        hint = " (write a decimal as a string, e.g. \"0.8\")" if isinstance(
            error.instance, float) else ""
        return f"{error.instance!r} is neither an integer nor a string{hint}"
    return error.message


if __name__ == "__main__":
    sys.stdout.write(crd_yaml())
