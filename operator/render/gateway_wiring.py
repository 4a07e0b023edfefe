"""What a service behind an InferencePool tells its engines (the Gateway API Inference
Extension's and llm-d's conventions): whom to believe a fairness or objective header from
(the gateway's addresses the admin lists, ``GatewayWiring.peers``), the pool's objectives
file, and where to publish KV-cache events (the router's address, its key hash, a topic
naming the pod's IP and model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvledger.operator.api.resource import OBJECTIVES_FILE
from kvledger.operator.api.spec import ServiceSpec


@dataclass(frozen=True)
class GatewayWiring:
    """What the admin's Helm values ``gateway`` give the engines of a service behind an
    InferencePool: the gateway's addresses (``peers``: its fairness header is believed from
    them alone), and the router's KV-events address (``kv_events``: the engines connect
    to it and publish their blocks, keyed with ``hash_algo``)."""

    peers: tuple[str, ...] = ()
    kv_events: str | None = None
    hash_algo: str = "sha256_cbor"


NO_GATEWAY = GatewayWiring()


# The header the Gateway API Inference Extension names a request's fairness group in.
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
# The header a client names its InferenceObjective in (the router's; its priority).
OBJECTIVE_HEADER = "x-gateway-inference-objective"


def objectives_wired(spec: ServiceSpec, gateway: GatewayWiring) -> bool:
    """Whether the engines read the pool's objectives: behind an InferencePool whose
    gateway's addresses the admin gave (a header from anyone else sets nothing)."""
    return spec.inference_pool is not None and bool(gateway.peers)


def gateway_flags(spec: ServiceSpec, gateway: GatewayWiring) -> list[str]:
    """``serve``'s flags for a service behind an InferencePool: the fairness header as the
    tenant and the objective header as the priority (the pool's objectives, mounted:
    ``objectives_wired``), from ``gateway.peers`` alone (none listed: nobody's to set); KV events sent to
    ``gateway.kv_events`` under llm-d's topic ``kv@<pod IP>@<model>`` (the kubelet puts the
    pod's IP in ``$(POD_IP)``: ``gateway_env``). None for a service not behind one."""
    if spec.inference_pool is None:
        return []
    flags = []
    if objectives_wired(spec, gateway):
        flags += ["--tenant-header", FAIRNESS_HEADER, "--tenant-header-from", *gateway.peers,
                  "--objective-header", OBJECTIVE_HEADER, "--objectives-file", OBJECTIVES_FILE]
    if gateway.kv_events:
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": gateway.kv_events,
                  "topic": f"kv@$(POD_IP)@{spec.engine.served_model_name}"}
        flags += ["--kv-events-config", json.dumps(config, separators=(",", ":")),
                  "--prefix-caching-hash-algo", gateway.hash_algo]
    return flags


def gateway_env(spec: ServiceSpec, gateway: GatewayWiring) -> list[dict[str, Any]]:
    """The engine's ``POD_IP`` (the downward API) where its KV events' topic names it."""
    if spec.inference_pool is None or not gateway.kv_events:
        return []
    return [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
