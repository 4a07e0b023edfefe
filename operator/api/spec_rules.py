"""The spec's cross-field rules, each once: where it applies, its CEL, its message, its check.

The CRD carries each rule as an ``x-kubernetes-validations`` entry (``validations``), so
the API server refuses a spec at ``kubectl apply``; ``check_rules`` applies the same rules
in Python with the same message, for ``kvledger run`` (no API server) and for the
operator (an API server older than CEL validation skips them). A test evaluates every CEL
expression with a CEL interpreter and checks that the two halves of each rule agree.

A rule (``cel_rule.Rule``) sits on a schema node under ``spec``. The CEL sees the node
after the API server applied the CRD's defaults; a Python check is given the node as written, so it takes the
CRD's default where the CEL relies on one (``mountPath``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kvledger.engine.errors import BadInput
from kvledger.operator.api import model_sources
from kvledger.operator.api.cel_rule import Rule, nodes
from kvledger.operator.api.env_policy import (
    ENV_CEL,
    ENV_FROM_MESSAGE,
    ENV_FROM_SOURCE_CEL,
    ENV_MESSAGE,
    ENV_SECRET_CEL,
    ENV_SECRET_MESSAGE,
    env_allowed,
    env_from_source,
    env_secret_free,
    env_subject,
)
from kvledger.operator.api.parallel import MAX_GPUS
from kvledger.operator.api.quantity import target_value
from kvledger.operator.api.resource import (
    AUTOSCALING_METRICS,
    DEFAULT_GPUS,
    DEFAULT_MOUNT_PATH,
    DEFAULT_NODES,
)

BARE_HUB_ID = ("model.uri is a hub uri, hf://ORG/NAME[@REVISION]: for the hub id ORG/NAME "
               "write hf://ORG/NAME (the bare id is a launch line's shorthand, not a "
               "manifest's)")


# A GPU is spec.gpus: the operator requests it (nvidia.com/gpu) and the engine is planned
# and sharded for it. One in resources was overridden by gpus (default 1): the engine ran
# on 1 GPU of 2, or on the CPU of a pod that held one. Vendors' names: nvidia.com/gpu,
# amd.com/gpu, gpu.intel.com/i915, NVIDIA's MIG slices.
GPU_KEY_RE = r"/gpu$|^([^/]*[.])?gpu[.][^/]*/|^nvidia[.]com/mig-"
GPU_IN_RESOURCES = (
    "resources.limits and resources.requests take no GPU (nvidia.com/gpu, amd.com/gpu, "
    "...): set spec.gpus, the GPUs per pod, which the operator requests and which sets the "
    "engine's device and tensor parallelism (gpus: 0 runs on the CPU)")


def _no_gpu_key(resources: Mapping[str, Any]) -> bool:
    return not any(re.search(GPU_KEY_RE, str(key)) for kind in ("limits", "requests")
                   for key in (resources.get(kind) or {}))


def _under_mount(model: Mapping[str, Any]) -> bool:
    if "volume" not in model or "path" not in model:
        return True
    mount = model["volume"].get("mountPath", DEFAULT_MOUNT_PATH)
    path = model["path"]
    return path == mount or path.startswith(mount if mount.endswith("/") else mount + "/")


def _target_above_zero(scaling: Mapping[str, Any]) -> bool:
    return "target" not in scaling or target_value(scaling["target"]) > 0


def _ratio_at_most_one(scaling: Mapping[str, Any]) -> bool:
    return (scaling.get("metric", AUTOSCALING_METRICS[0]) != "kvReservedRatio"
            or "target" not in scaling or target_value(scaling["target"]) <= 1)


def _group_stages_fit(spec: Mapping[str, Any]) -> bool:
    stages = (spec.get("engine") or {}).get("pipelineParallelSize")
    nodes = spec.get("nodes", DEFAULT_NODES)
    if stages is None or nodes == 1:
        return True
    return stages % nodes == 0 and spec.get("gpus", DEFAULT_GPUS) % (stages // nodes) == 0


RULES: tuple[Rule, ...] = (
    Rule("", "!has(self.allowRuntimeLoraUpdating) || !self.allowRuntimeLoraUpdating"
         " || has(self.apiKeySecretRef) || has(self.tenantsSecretRef)",
         "allowRuntimeLoraUpdating needs apiKeySecretRef (or tenantsSecretRef): loading "
         "adapters at run time is for clients that hold an API key",
         lambda spec: not spec.get("allowRuntimeLoraUpdating") or "apiKeySecretRef" in spec
         or "tenantsSecretRef" in spec),
    # An allow-list, and envFrom refused whole: why, in env_policy.
    Rule("env[]", ENV_CEL, ENV_MESSAGE, env_allowed, subject=("'env ' + self.name", env_subject)),
    Rule("env[]", ENV_SECRET_CEL, ENV_SECRET_MESSAGE, env_secret_free,
         subject=("'env ' + self.name", env_subject)),
    Rule("envFrom[]", "false", ENV_FROM_MESSAGE, lambda source: False,
         subject=(ENV_FROM_SOURCE_CEL, env_from_source)),
    # One pod, one node: a pod's model shard is sharded over its node's GPUs (tensor
    # parallelism); spec.nodes spans nodes with pods of a LeaderWorkerSet group.
    Rule("gpus", f"self <= {MAX_GPUS}",
         f"gpus must be at most {MAX_GPUS}: kvledger serves a model on the GPUs of one node "
         "per pod (tensor parallelism, and pipeline stages: engine.pipelineParallelSize); to "
         "serve across nodes, set nodes (a LeaderWorkerSet group of pods of gpus GPUs each)",
         lambda gpus: gpus <= MAX_GPUS),
    Rule("", "!has(self.engine) || !has(self.engine.pipelineParallelSize)"
         " || has(self.nodes) && self.nodes != 1"
         f" || (has(self.gpus) ? self.gpus : {DEFAULT_GPUS})"
         " % self.engine.pipelineParallelSize == 0",
         "engine.pipelineParallelSize must divide gpus: each stage is gpus / "
         "pipelineParallelSize GPUs of the pod",
         lambda spec: "pipelineParallelSize" not in (spec.get("engine") or {})
         or spec.get("nodes", DEFAULT_NODES) != 1
         or spec.get("gpus", DEFAULT_GPUS) % spec["engine"]["pipelineParallelSize"] == 0),
    # A group of nodes: P stages over gpus * nodes GPUs, P / nodes of them in each pod.
    Rule("", "!has(self.engine) || !has(self.engine.pipelineParallelSize)"
         " || !has(self.nodes) || self.nodes == 1"
         " || self.engine.pipelineParallelSize % self.nodes == 0"
         f" && (has(self.gpus) ? self.gpus : {DEFAULT_GPUS})"
         " % (self.engine.pipelineParallelSize / self.nodes) == 0",
         "with nodes above 1, engine.pipelineParallelSize must be a multiple of nodes, and "
         "pipelineParallelSize / nodes must divide gpus: each pod holds pipelineParallelSize "
         "/ nodes stages of its gpus (default: pipelineParallelSize = nodes, one stage a pod)",
         _group_stages_fit),
    Rule("engine",
         "!has(self.maxNumBatchedTokens) || !has(self.maxNumSeqs)"
         " || self.maxNumBatchedTokens >= self.maxNumSeqs",
         "maxNumBatchedTokens must be at least maxNumSeqs (every running sequence decodes one "
         "token per step)",
         lambda engine: "maxNumBatchedTokens" not in engine or "maxNumSeqs" not in engine
         or engine["maxNumBatchedTokens"] >= engine["maxNumSeqs"]),
    Rule("model.volume", "has(self.persistentVolumeClaim) != has(self.hostPath)",
         "set exactly one of persistentVolumeClaim and hostPath",
         lambda volume: ("persistentVolumeClaim" in volume) != ("hostPath" in volume)),
    Rule("model", "has(self.path) != has(self.uri)",
         "set exactly one of model.path and model.uri",
         lambda model: ("path" in model) != ("uri" in model)),
    # `vllm serve ORG/NAME` takes a bare hub id; a manifest names the scheme.
    Rule("model", "!has(self.uri) || self.uri.contains('://')", BARE_HUB_ID,
         lambda model: "uri" not in model or "://" in str(model["uri"])),
    # Checked as strings, so a '..' could climb out of the mount: refuse the segment.
    Rule("model", "!has(self.path) || !self.path.matches('(^|/)[.][.](/|$)')",
         "model.path must not contain a '..' segment",
         lambda model: ".." not in model.get("path", "").split("/")),
    # A mountPath written with a trailing '/' holds the paths under it all the same.
    Rule("model",
         "!has(self.volume) || !has(self.path) || self.path == self.volume.mountPath"
         " || self.path.startsWith(self.volume.mountPath.endsWith('/')"
         " ? self.volume.mountPath : self.volume.mountPath + '/')",
         "model.path must lie under model.volume.mountPath",
         _under_mount),
    # KServe's sources (hf://ORG/NAME:REV, pvc://, s3://, ...), each with kvledger's way.
    *(Rule("model", model_sources.cel(pattern), message, model_sources.holds(pattern))
      for pattern, message in model_sources.SOURCES),
    Rule("model", "!has(self.uri) || !has(self.volume)",
         "model.volume holds a model.path checkpoint; a model.uri is downloaded into "
         "model.cache",
         lambda model: "uri" not in model or "volume" not in model),
    Rule("model",
         "has(self.uri) || !(has(self.tokenSecretRef) || has(self.endpoint)"
         " || has(self.cache))",
         "model.tokenSecretRef, model.endpoint and model.cache apply to a model.uri only",
         lambda model: "uri" in model
         or not {"tokenSecretRef", "endpoint", "cache"} & model.keys()),
    # What the API server would refuse in the pod, refused at `kubectl apply` instead.
    Rule("tolerations[]",
         "has(self.key) && self.key != '' || has(self.operator) && self.operator == 'Exists'",
         "a toleration without a key must have operator Exists",
         lambda toleration: bool(toleration.get("key"))
         or toleration.get("operator") == "Exists"),
    Rule("tolerations[]",
         "!has(self.operator) || self.operator != 'Exists' || !has(self.value)"
         " || self.value == ''",
         "a toleration with operator Exists takes no value",
         lambda toleration: toleration.get("operator") != "Exists"
         or not toleration.get("value")),
    Rule("tolerations[]",
         "!has(self.tolerationSeconds) || has(self.effect) && self.effect == 'NoExecute'",
         "tolerationSeconds applies to effect NoExecute only",
         lambda toleration: "tolerationSeconds" not in toleration
         or toleration.get("effect") == "NoExecute"),
    Rule("env[]", "!has(self.value) || !has(self.valueFrom)",
         "an env var takes value or valueFrom, not both",
         lambda var: not ("value" in var and "valueFrom" in var)),
    Rule("tools", "!has(self.enableAutoToolChoice) || !self.enableAutoToolChoice"
         " || has(self.toolCallParser)",
         "tools.enableAutoToolChoice needs tools.toolCallParser (the format \"auto\" parses)",
         lambda tools: not tools.get("enableAutoToolChoice") or "toolCallParser" in tools),
    # vLLM's StructuredOutputsConfig validator, its words.
    Rule("structuredOutputs", "!has(self.disableAnyWhitespace) || !self.disableAnyWhitespace"
         " || has(self.backend) && (self.backend == 'xgrammar' || self.backend == 'guidance')",
         "structuredOutputs.disableAnyWhitespace is only supported for backend xgrammar or "
         "guidance (vLLM's rule)",
         lambda outputs: not outputs.get("disableAnyWhitespace")
         or outputs.get("backend") in ("xgrammar", "guidance")),
    Rule("structuredOutputs", "!has(self.disableAdditionalProperties)"
         " || !self.disableAdditionalProperties"
         " || has(self.backend) && self.backend == 'guidance'",
         "structuredOutputs.disableAdditionalProperties is only supported for backend "
         "guidance (vLLM's rule)",
         lambda outputs: not outputs.get("disableAdditionalProperties")
         or outputs.get("backend") == "guidance"),
    Rule("autoscaling", "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
         "autoscaling.minReplicas must be at most autoscaling.maxReplicas",
         lambda scaling: "minReplicas" not in scaling
         or scaling["minReplicas"] <= scaling["maxReplicas"]),
    Rule("autoscaling",
         "!has(self.minReplicas) || self.minReplicas >= 1"
         " || has(self.provider) && self.provider == 'keda'",
         "autoscaling.minReplicas 0 (scale to zero) needs provider keda: an HPA cannot scale "
         "to zero",
         lambda scaling: scaling.get("minReplicas", 1) >= 1
         or scaling.get("provider") == "keda"),
    Rule("", "!has(self.sleep) || has(self.engine) && has(self.engine.enableSleepMode)"
         " && self.engine.enableSleepMode",
         "sleep needs engine.enableSleepMode (the pods must be started in sleep mode)",
         lambda spec: "sleep" not in spec
         or bool((spec.get("engine") or {}).get("enableSleepMode"))),
    Rule("", "!has(self.engine) || !has(self.engine.enableSleepMode)"
         " || !self.engine.enableSleepMode || (!has(self.gpus) || self.gpus <= 1)"
         " && (!has(self.nodes) || self.nodes == 1) && !has(self.adapters)",
         "engine.enableSleepMode needs one process a pod: gpus at most 1, nodes 1 and no "
         "adapters",
         lambda spec: not (spec.get("engine") or {}).get("enableSleepMode")
         or (spec.get("gpus", 0) <= 1 and spec.get("nodes", 1) == 1 and "adapters" not in spec)),
    Rule("autoscaling", "!has(self.httpAddOn) || has(self.provider) && self.provider == 'keda'",
         "autoscaling.httpAddOn applies to provider keda only (the add-on's trigger is KEDA's)",
         lambda scaling: "httpAddOn" not in scaling or scaling.get("provider") == "keda"),
    Rule("autoscaling", "!has(self.httpAddOn) || !has(self.httpAddOn.coldStart)"
         " || self.httpAddOn.coldStart != 'retryAfter' || !has(self.httpAddOn.readinessTimeout)",
         "autoscaling.httpAddOn.readinessTimeout holds requests, which coldStart retryAfter "
         "answers at once: set one or the other",
         lambda scaling: (scaling.get("httpAddOn") or {}).get("coldStart") != "retryAfter"
         or "readinessTimeout" not in (scaling.get("httpAddOn") or {})),
    Rule("autoscaling", "!has(self.prometheus) || has(self.provider) && self.provider == 'keda'",
         "autoscaling.prometheus applies to provider keda only (an HPA reads its Pods metric "
         "through prometheus-adapter)",
         lambda scaling: "prometheus" not in scaling or scaling.get("provider") == "keda"),
    Rule("autoscaling",
         "!has(self.target) || type(self.target) != string"
         " || !self.target.matches('^[0.]*m?$')",
         "autoscaling.target must be more than 0",
         _target_above_zero),
    # The metric defaults to kvReservedRatio (the API server defaults before it validates).
    Rule("autoscaling",
         f"(has(self.metric) ? self.metric : '{AUTOSCALING_METRICS[0]}') != 'kvReservedRatio'"
         " || !has(self.target) || (type(self.target) == int ? self.target <= 1"
         " : self.target.matches('^(0*([.][0-9]+)?|0*1([.]0+)?|0*[0-9]{1,3}m|0*1000m)$'))",
         "autoscaling.target of kvReservedRatio is a share of the KV pool: at most 1 "
         "(e.g. \"0.8\")",
         _ratio_at_most_one),
)


def validations(path: str) -> list[dict[str, str]]:
    """The CRD's ``x-kubernetes-validations`` of the schema node at ``path``."""
    out = []
    for rule in RULES:
        if rule.path == path:
            entry = {"rule": rule.cel, "message": rule.message}
            if (expression := rule.message_expression()) is not None:
                entry["messageExpression"] = expression
            out.append(entry)
    return out


def ruled(schema: dict[str, Any], path: str) -> dict[str, Any]:
    """``schema`` with the cross-field rules of its node, if it has any."""
    rules = validations(path)
    return {**schema, "x-kubernetes-validations": rules} if rules else schema


def check_rules(spec: Mapping[str, Any]) -> None:
    """Every rule, in Python; BadInput with the first broken rule's refusal. Then those
    the CRD cannot hold (the webhook's and ``kvledger run``'s alone): a GPU in resources,
    whose keys the schema cannot bound for CEL's cost."""
    for rule in RULES:
        for node in nodes(spec, rule.path):
            if not rule.holds(node):
                raise BadInput(rule.refusal(node))
    resources = spec.get("resources")
    if isinstance(resources, Mapping) and not _no_gpu_key(resources):
        raise BadInput(GPU_IN_RESOURCES)
