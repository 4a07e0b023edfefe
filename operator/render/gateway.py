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
"""

from __future__ import annotations

from typing import Any

from kvledger.engine.errors import BadInput
from kvledger.operator.api.resource import DEFAULT_PICKER_PORT
from kvledger.operator.api.spec import ServiceSpec
from kvledger.operator.render.render import labels
from kvledger.operator.render.render_group import serving_labels

POOL_GROUP = "inference.networking.k8s.io"
POOL_API_VERSION = f"{POOL_GROUP}/v1"
POOL_PLURAL = "inferencepools"
INFERENCE_POOLS = (POOL_API_VERSION, POOL_PLURAL)
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
