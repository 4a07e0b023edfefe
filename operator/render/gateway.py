"""Behind the Gateway API Inference Extension (``spec.inferencePool``): the InferencePool
named as the resource, pure like the other renderers.

The pool selects exactly the pods the serving Service selects (every pod, or a group's
leaders: ``render_group.serving_labels``) on the engine's port, and names the Endpoint
Picker (a Service of the same namespace, with its ext-proc port) that the gateway asks
where each request goes. The picker reads the pods' ``/metrics`` under vLLM's names
(``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info``,
``vllm:lora_requests_info``), which the engine exports as vLLM does; the serving pods
carry ``llm-d.ai/inference-serving: "true"``, the label llm-d's tooling finds model
servers by (``render.pod_template_metadata``).

The pool's ``InferenceObjective``s (``inference.networking.x-k8s.io/v1alpha2``, each naming
the pool in ``spec.poolRef``) go into the ConfigMap ``NAME-objectives`` as name and
priority, which the engines read as the file behind ``--objectives-file``: a client's
``x-gateway-inference-objective`` header then sets its request's priority in the engine's
line as in the router's (``server/objectives.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from kvledger.engine.errors import BadInput
from kvledger.operator.api.resource import (
    DEFAULT_PICKER_PORT,
    OBJECTIVES_KEY,
    objectives_config_map,
)
from kvledger.operator.api.spec import ServiceSpec
from kvledger.operator.render.render import labels
from kvledger.operator.render.render_group import serving_labels

POOL_GROUP = "inference.networking.k8s.io"
POOL_API_VERSION = f"{POOL_GROUP}/v1"
POOL_PLURAL = "inferencepools"
INFERENCE_POOLS = (POOL_API_VERSION, POOL_PLURAL)
# The router's InferenceObjective: a priority for the requests that name it.
OBJECTIVE_GROUP = "inference.networking.x-k8s.io"
OBJECTIVE_API_VERSION = f"{OBJECTIVE_GROUP}/v1alpha2"
OBJECTIVE_PLURAL = "inferenceobjectives"
INFERENCE_OBJECTIVES = (OBJECTIVE_API_VERSION, OBJECTIVE_PLURAL)
# The objectives a pool's file holds at most (by name): about 0.3 MB at the longest names,
# well inside a ConfigMap's 1 MiB and the engine's read of the file.
MAX_OBJECTIVES = 1000
# The release whose CRD tests/data/gaie vendors, and the one a refusal names.
GAIE_RELEASE = "v1.6.0"
GAIE_INSTALL = (f"kubectl apply -f https://github.com/kubernetes-sigs/"
                f"gateway-api-inference-extension/releases/download/{GAIE_RELEASE}/manifests.yaml")


def render_inference_pool(name: str, namespace: str, spec: ServiceSpec,
                          default_picker: str | None = None,
                          default_port: int = DEFAULT_PICKER_PORT) -> dict[str, Any] | None:
    """The InferencePool named as the resource, or None when the spec wants none. The
    picker is the spec's, else the admin's (``Policy.picker``: the operator's Helm value
    ``gateway.endpointPicker``); BadInput when neither names it."""
    pool = spec.inference_pool
    if pool is None:
        return None
    picker = pool.picker or default_picker
    if picker is None:
        raise BadInput("spec.inferencePool needs its Endpoint Picker: set "
                       "spec.inferencePool.endpointPicker.name (a Service in this namespace) "
                       "or the operator's Helm value gateway.endpointPicker.name")
    port = pool.picker_port if pool.picker_port is not None else default_port
    return {
        "apiVersion": POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {
            "selector": {"matchLabels": serving_labels(name, spec)},
            "targetPorts": [{"number": spec.serve.port}],
            "endpointPickerRef": {"kind": "Service", "name": picker,
                                  "port": {"number": port},
                                  "failureMode": pool.failure_mode},
        },
    }


def pool_objectives(objectives: Iterable[Mapping[str, Any]], pool: str) -> list[dict[str, Any]]:
    """The objectives of the InferencePool ``pool`` (its namespace's objectives, as listed),
    as the engine's file holds them: name and priority (unset: 0, as the router reads it),
    by name. An objective naming another pool, or another kind, is not this pool's; one
    whose priority is not a 32-bit integer is left out (GAIE v1.5.0's CRD admits any
    integer; the router's, since, int32, as the engine reads it). At most
    ``MAX_OBJECTIVES``, the first by name: a namespace that wrote more would otherwise make
    a ConfigMap the API server refuses, and the service's every reconcile with it."""
    chosen = []
    for objective in objectives:
        spec = objective.get("spec") or {}
        ref = spec.get("poolRef") or {}
        if (ref.get("name") != pool or ref.get("group", POOL_GROUP) != POOL_GROUP
                or ref.get("kind", "InferencePool") != "InferencePool"):
            continue
        name = (objective.get("metadata") or {}).get("name")
        priority = spec.get("priority", 0)
        if (not isinstance(name, str) or isinstance(priority, bool)
                or not isinstance(priority, int) or not -2**31 <= priority < 2**31):
            continue
        chosen.append({"name": name, "priority": priority})
    return sorted(chosen, key=lambda entry: entry["name"])[:MAX_OBJECTIVES]


def render_objectives_config_map(name: str, namespace: str,
                                 objectives: list[dict[str, Any]]) -> dict[str, Any]:
    """The ConfigMap the engines read their pool's ``objectives`` from (``pool_objectives``)."""
    text = yaml.safe_dump({"objectives": objectives}, sort_keys=False)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": objectives_config_map(name), "namespace": namespace,
                         "labels": labels(name)},
            "data": {OBJECTIVES_KEY: text}}
