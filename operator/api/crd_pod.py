"""The pod's own fields in the InferenceService's spec schema (``crd_schema``): placement
and environment, passed to the pod template as Kubernetes names them."""

from __future__ import annotations

import json
from pathlib import Path

from kvledger.operator.api.spec_rules import ruled

# Every field is typed, to its last level: what Kubernetes' own schema makes large (affinity
# terms, an env var's valueFrom) is Kubernetes' schema itself, vendored by
# scripts/vendor_pod_schemas.py. Kept open (x-kubernetes-preserve-unknown-fields), the API
# server stored them however deep, and a thousand levels stop every JSON reader in the
# operator, kopf's watch of every tenant's resources included.
POD_SCHEMAS = json.loads((Path(__file__).parent / "pod_schemas.json").read_text())
_TYPES = POD_SCHEMAS["types"]
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_NAME_REF = {"type": "object", "required": ["name"],
             "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 253}}}
_TOLERATION = ruled({
    "type": "object",
    "properties": {
        "key": {"type": "string", "maxLength": 317},
        "operator": {"type": "string", "enum": ["Exists", "Equal"]},
        "value": {"type": "string", "maxLength": 63},
        "effect": {"type": "string", "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
        "tolerationSeconds": {"type": "integer", "format": "int64"},
    },
}, "tolerations[]")
_ENV_VAR = ruled({
    "type": "object", "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 4096},
        "value": {"type": "string"},
        "valueFrom": {**_TYPES["envVarSource"], "description": "as in a container's env "
                      "(configMapKeyRef, fieldRef, resourceFieldRef; secretKeyRef is refused)"},
    },
}, "env[]")
_ENV_SOURCE_REF = {"type": "object", "required": ["name"],
                   "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 253},
                                  "optional": {"type": "boolean"}}}
_ENV_FROM = ruled({
    "type": "object",
    "properties": {"prefix": {"type": "string"}, "configMapRef": _ENV_SOURCE_REF,
                   "secretRef": _ENV_SOURCE_REF},
}, "envFrom[]")
PLACEMENT = {
    "nodeSelector": {**_STRING_MAP, "description": "the pod's nodeSelector"},
    "tolerations": {"type": "array", "items": _TOLERATION, "maxItems": 64,
                    "description": "the pod's tolerations (default with gpus > 0: "
                                   "nvidia.com/gpu Exists NoSchedule)"},
    "affinity": {
        "type": "object", "description": "the pod's affinity, as Kubernetes writes it",
        "properties": {part: _TYPES[part]
                       for part in ("nodeAffinity", "podAffinity", "podAntiAffinity")},
    },
    "priorityClassName": {"type": "string", "minLength": 1, "maxLength": 253},
    "runtimeClassName": {"type": "string", "minLength": 1, "maxLength": 253},
    "imagePullSecrets": {"type": "array", "items": _NAME_REF, "maxItems": 64},
    "serviceAccountName": {"type": "string", "minLength": 1, "maxLength": 253,
                           "description": "the pods' service account (its token is still not "
                                          "mounted: neither container calls the API server)"},
    "env": {"type": "array", "items": _ENV_VAR, "maxItems": 1024,
            "description": "env of every container (preflight, fetch, engine): only the "
                           "names of an allow-list of speed and log settings (NCCL's "
                           "network, threads, the CUDA allocator, ...); anything that could "
                           "load code or send traffic elsewhere is refused by name"},
    "envFrom": {"type": "array", "items": _ENV_FROM, "maxItems": 64,
                "description": "refused: it would import names kvledger cannot check; "
                               "name each variable in env (valueFrom.configMapKeyRef)"},
    "podAnnotations": {**_STRING_MAP, "description": "annotations of the pod template, of "
                       "the keys the operator's Helm value policy.podAnnotations allows, "
                       "over the resource's own metadata.annotations (whose allowed keys "
                       "the pods get too, less kubectl's, kopf's and kvledger.dev/ ones)"},
    "podLabels": {**_STRING_MAP, "description": "labels of the pod template, of the keys "
                  "the operator's Helm value policy.podLabels allows, over the "
                  "resource's own metadata.labels (whose allowed keys the pods get "
                  "too); the operator's own labels win over both"},
}
