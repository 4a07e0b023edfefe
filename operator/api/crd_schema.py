"""The InferenceService's ``spec`` schema (OpenAPI v3, as the CRD writes it), one dict.

Its cross-field rules come from ``spec_rules``, its defaults from ``resource``, and what a
declared setting is in OpenAPI from ``setting_schema`` (with the grammars shared with the
engine: a SIZE, a hub uri). ``spec.engine`` and ``spec.memory`` are generated
from the engine's settings (``EngineConfig``'s declarations, ``engine/settings/declare.py``), and
serve's own fields (``spec.port``, ``spec.shutdownGraceSeconds``, the line's, ``spec.tools``,
...) from serve's (``ServeConfig``'s, ``engine/settings/serve_config.py``).
"""

from __future__ import annotations

from typing import Any

from kvledger.engine.settings.lora_config import LORA_NAME_RE
from kvledger.engine.settings.serve_config import ServeConfig
from kvledger.operator.api.crd_autoscaling import AUTOSCALING
from kvledger.operator.api.crd_pod import PLACEMENT
from kvledger.operator.api.resource import (
    DEFAULT_GPUS,
    DEFAULT_MOUNT_PATH,
    DEFAULT_NODES,
    DEFAULT_PICKER_FAILURE_MODE,
    DEFAULT_REPLICAS,
    MAX_NODES,
    PICKER_FAILURE_MODES,
)
from kvledger.operator.api.setting_schema import (
    HUB_URI_PATTERN,
    INT_OR_STRING,
    integer,
    setting_properties,
)
from kvledger.operator.api.spec_rules import ruled

# serve's fields of spec itself (port, drain, the line, ...), in ServeConfig's order; the
# spec's own fields sit between them where the CRD has always listed them (_served).
_SERVED = {name: ruled(schema, name)
           for name, schema in setting_properties("", ServeConfig).items()}


def _served(after: str | None = None, through: str | None = None) -> dict[str, Any]:
    """serve's fields of ``spec`` declared after ``after`` up to ``through`` (None: from the
    first, to the last): a field declared anew lands without an edit here."""
    names = list(_SERVED)
    start = 0 if after is None else names.index(after) + 1
    stop = len(names) if through is None else names.index(through) + 1
    return {name: _SERVED[name] for name in names[start:stop]}


# A Secret's name is a DNS-1123 subdomain; a key is letters, digits, '-', '_' and '.'.
_SECRET_NAME = {"type": "string", "minLength": 1, "maxLength": 253,
                "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"}
_SECRET_KEY = {"type": "string", "minLength": 1, "maxLength": 253,
               "pattern": r"^[-._a-zA-Z0-9]+$"}
_CLAIM = {"type": "object", "required": ["claimName"],
          "properties": {"claimName": {"type": "string", "minLength": 1, "maxLength": 253}}}

_MODEL = ruled({
    "type": "object",
    "description": "The checkpoint (config.json, safetensors, tokenizer.json): a directory "
                   "(path) or a Hugging Face Hub repository (uri); exactly one of the two.",
    "properties": {
        "path": {"type": "string", "pattern": "^/", "maxLength": 4096,
                 "description": "Checkpoint directory as the pod sees it (under volume.mountPath)."},
        "uri": {"type": "string", "pattern": HUB_URI_PATTERN, "maxLength": 512,
                "description": "hf://ORG/NAME[@REVISION]: planned from its headers over HTTP, "
                               "then downloaded by the fetch init container into the cache. "
                               "The Hub alone: a checkpoint on a claim (or a bucket a CSI "
                               "driver mounts) is path, with volume."},
        # At most 256 characters, none a leading '-' (the engine's parser would read the
        # name as a flag, and the pod would never start).
        "name": {"type": "string", "minLength": 1, "maxLength": 256, "pattern": "^[^-]",
                 "description": "Served model name (--served-model-name)."},
        "volume": ruled({
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
        }, "model.volume"),
        "tokenSecretRef": {
            "type": "object", "required": ["name", "key"],
            "description": "The Secret key holding the Hub token (HF_TOKEN of the preflight "
                           "and fetch containers; the operator never reads it, so the model "
                           "is sized in the pod and an emptyDir cache has no sizeLimit).",
            "properties": {"name": _SECRET_NAME, "key": _SECRET_KEY},
        },
        "endpoint": {"type": "string", "pattern": r"^https?://\S+$", "maxLength": 2048,
                     "description": "A Hub mirror (HF_ENDPOINT of the pod's containers), one "
                                    "of those the operator's Helm value hub.endpoints allows; "
                                    "https with a token"},
        "cache": {
            "type": "object", "required": ["persistentVolumeClaim"],
            "description": "Where the download goes, shared by replicas and restarts (default: "
                           "an emptyDir per pod, sized from the checkpoint).",
            "properties": {"persistentVolumeClaim": _CLAIM},
        },
    },
}, "model")

_ENGINE = ruled({
    "type": "object",
    "description": "Workload flags, named as vLLM names them (camelCase).",
    "properties": setting_properties("engine"),
}, "engine")

_ADAPTER = {
    "type": "object", "required": ["name", "uri"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 128,
                 "pattern": LORA_NAME_RE.pattern,
                 "description": "the name requests give in `model`"},
        "uri": {"type": "string", "maxLength": 4096,
                "pattern": f"^(/.*|{HUB_URI_PATTERN[1:-1]})$",
                "description": "hf://ORG/NAME[@REVISION] (with a hub model: downloaded by the "
                               "fetch init container into its cache) or a PEFT adapter "
                               "directory as the pod sees it (e.g. on model.volume)"},
    },
}

_TOOLS = ruled({
    "type": "object",
    "description": "OpenAI tool calling on /v1/chat/completions: \"required\" and named "
                   "calls always work; \"auto\" needs these (vLLM's flags).",
    "properties": setting_properties("tools", ServeConfig),
}, "tools")

_MEMORY = {
    "type": "object",
    "description": "Memory caps; the smallest one given wins. None: auto-size to the workload.",
    "properties": setting_properties("memory"),
}

_QUANTITY = {"x-kubernetes-int-or-string": True, "anyOf": INT_OR_STRING}

_INFERENCE_POOL = {
    "type": "object",
    "description": "serve behind the Gateway API Inference Extension: the operator renders "
                   "an InferencePool (inference.networking.k8s.io/v1) of the serving pods "
                   "(a group's leaders), which an HTTPRoute names as its backend; needs the "
                   "InferencePool CRD installed",
    "properties": {
        "endpointPicker": {
            "type": "object", "required": ["name"],
            "description": "the Endpoint Picker's Service in this namespace (default: the "
                           "operator's Helm value gateway.endpointPicker)",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 63,
                         "pattern": r"^[a-z]([-a-z0-9]*[a-z0-9])?$"},
                "port": integer(1, "its ext-proc port (default: the Helm value's, 9002)",
                             maximum=65535),
                "failureMode": {"type": "string", "enum": list(PICKER_FAILURE_MODES),
                                "default": DEFAULT_PICKER_FAILURE_MODE,
                                "description": "when the picker does not answer: FailClose "
                                               "refuses the request, FailOpen routes it "
                                               "anyway"},
            },
        },
    },
}

SPEC_SCHEMA = ruled({
    "type": "object",
    "required": ["model"],
    "properties": {
        "model": _MODEL,
        "engine": _ENGINE,
        "memory": _MEMORY,
        "gpus": ruled(integer(0, "GPUs per replica (nvidia.com/gpu), on one node: more than 1 "
                               "shards the model over them (--tensor-parallel-size, planned "
                               "per GPU, a memory-backed /dev/shm)",
                            default=DEFAULT_GPUS), "gpus"),
        "nodes": integer(1, "pods per replica, on as many nodes, gpus GPUs each: above 1, each "
                         "replica is a LeaderWorkerSet group (the leader serves HTTP, the "
                         "workers run later pipeline stages; engine.pipelineParallelSize "
                         "defaults to nodes); needs LeaderWorkerSet installed",
                      maximum=MAX_NODES, default=DEFAULT_NODES),
        "replicas": integer(0, "pods (groups, with nodes above 1) serving this model (the scale "
                            "subresource's; with "
                            "autoscaling, the autoscaler writes it)", default=DEFAULT_REPLICAS),
        "image": {"type": "string", "minLength": 1,
                  "description": "kvledger image (default: the operator's configured image)"},
        **_served(through="maxQueueWaitSeconds"),
        "tools": _TOOLS,
        "adapters": {"type": "array", "items": _ADAPTER, "maxItems": 256,
                     "description": "LoRA adapters served beside the model (--enable-lora "
                                    "--lora-modules NAME=URI); the pre-flight plans their "
                                    "slots (engine.maxLoras x engine.maxLoraRank)"},
        **_served(after="maxQueueWaitSeconds", through="tenantFairness"),
        "sleep": {"type": "integer", "minimum": 0, "maximum": 2,
                  "description": "with engine.enableSleepMode: the sleep level the pods "
                                 "should be at (0, 1: weights to host memory, 2: weights "
                                 "dropped); unset: awake. Changed without a restart: the "
                                 "operator writes it into the ConfigMap NAME-sleep, which "
                                 "each engine reads"},
        "tenantsSecretRef": {
            "type": "object", "required": ["name", "key"],
            "description": "A Secret key holding the tenants file (YAML: each tenant's name, "
                           "API keys, weight, maxQueued, priority and minPriority), mounted "
                           "read-only for the engine alone (--tenants-file); its keys open "
                           "/v1/* as apiKeySecretRef's does",
            "properties": {"name": _SECRET_NAME, "key": _SECRET_KEY},
        },
        "resources": ruled({
            "type": "object",
            "description": "CPU and host memory of the engine container. GPUs come from gpus "
                           "alone: a GPU key here (nvidia.com/gpu, amd.com/gpu, ...) is "
                           "refused.",
            "properties": {
                "limits": {"type": "object", "additionalProperties": _QUANTITY},
                "requests": {"type": "object", "additionalProperties": _QUANTITY},
            },
        }, "resources"),
        "apiKeySecretRef": {
            "type": "object", "required": ["name", "key"],
            "description": "The Secret key holding the API key /v1/* requires (the engine's "
                           "KVLEDGER_API_KEY; clients send 'Authorization: Bearer KEY')",
            "properties": {"name": _SECRET_NAME, "key": _SECRET_KEY},
        },
        **_served(after="tenantFairness"),
        **PLACEMENT,
        "autoscaling": AUTOSCALING,
        "inferencePool": _INFERENCE_POOL,
    },
}, "")
