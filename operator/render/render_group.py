"""Pure renderers for ``spec.nodes`` above 1: each replica is a LeaderWorkerSet group of
``nodes`` pods, ``gpus`` GPUs each, that start, serve and restart together.

- The leader (worker index 0) is the pod ``render.render_pod_spec`` renders for a
  Deployment: the pre-flight init container (which plans one GPU of each stage, the same
  ``-tp T -pp P``), the engine with its HTTP port and probes; it also declares the
  rendezvous port (torch.distributed's store) and kvledger's control channel.
- A worker is the same pod without the pre-flight and without HTTP: its engine runs
  ``--headless``, no port, no probe (a hub model's ``fetch`` stays: each pod loads its own
  stages from its own cache).
- Every engine adds ``--nnodes N --node-rank $(LWS_WORKER_INDEX) --master-addr
  $(LWS_LEADER_ADDRESS) --master-port 29500`` (LWS sets those variables in every container,
  and the kubelet expands ``$(VAR)`` in args) and ``KVLEDGER_NODE_KEY``, the control
  channel's key, from a Secret the operator created itself under a name the API
  server generated (``<name>-nodes-XXXXX``; ``children.py`` keeps it in
  ``status.nodeKeySecret``), so nobody could have made it first.
- ``RecreateGroupOnPodRestart``: a worker exits when its leader is gone and the leader when
  a worker is, so a group is recreated whole.
- The Service selects the leaders only; the NetworkPolicy admits the group's own pods on
  every port and other pods on the HTTP port only.

Each group gets its own headless Service for the pods' DNS names
(``subdomainPolicy: UniquePerReplica``, named as the leader pod): with LWS's default, one
headless Service named as the LeaderWorkerSet, it would collide with the Service that is
named as the resource too.
"""

from __future__ import annotations

import base64
import copy
from typing import Any

from kvledger.operator.api.spec import ServiceSpec
from kvledger.operator.render.network_policy import render_network_policy
from kvledger.operator.render.render import (
    DEFAULT_IMAGE,
    LABEL,
    NO_GATEWAY,
    GatewayWiring,
    labels,
    pod_template_metadata,
    render_deployment,
    render_pod_spec,
    render_service,
    selector_labels,
    workload_labels,
)

LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_API_VERSION = f"{LWS_GROUP}/v1"
LWS_PLURAL = "leaderworkersets"
# The release docs/operator.md installs and tests/data/ holds the CRD of.
LWS_RELEASE = "v0.10.0"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
RENDEZVOUS_PORT = 29500  # torch.distributed's store, on the leader
CONTROL_PORT = 29501  # kvledger's control channel, on the leader
NODE_KEY_ENV = "KVLEDGER_NODE_KEY"
NODE_KEY_FIELD = "key"
NODE_KEY_BYTES = 32
DEPLOYMENTS = ("apps/v1", "deployments")
LEADER_WORKER_SETS = (LWS_API_VERSION, LWS_PLURAL)


def node_key_secret_prefix(name: str) -> str:
    """The ``generateName`` of a multi-node service's control-channel key Secret: the API
    server appends five random characters when the operator creates it."""
    return f"{name}-nodes-"


def group_flags(spec: ServiceSpec, *, worker: bool) -> list[str]:
    """What an engine of a group adds to the Deployment's engine args."""
    flags = ["--nnodes", str(spec.nodes), "--node-rank", "$(LWS_WORKER_INDEX)",
             "--master-addr", "$(LWS_LEADER_ADDRESS)", "--master-port", str(RENDEZVOUS_PORT)]
    return [*flags, "--headless"] if worker else flags


def serving_labels(name: str, spec: ServiceSpec) -> dict[str, str]:
    """The labels of the pods that serve HTTP: every pod, or a group's leaders."""
    if spec.nodes > 1:
        return {**selector_labels(name), WORKER_INDEX_LABEL: "0"}
    return selector_labels(name)


def serving_selector(name: str, spec: ServiceSpec) -> str:
    """``serving_labels`` as a label selector (``status.selector``: the HPA averages the
    metrics of these pods, and only those serving HTTP export any)."""
    return ",".join(f"{k}={v}" for k, v in sorted(serving_labels(name, spec).items()))


def _engine(pod: dict[str, Any]) -> dict[str, Any]:
    [engine] = [c for c in pod["containers"] if c["name"] == "engine"]
    return engine


def _join_group(pod: dict[str, Any], key_secret: str, spec: ServiceSpec, *,
                worker: bool) -> None:
    engine = _engine(pod)
    engine["args"] += group_flags(spec, worker=worker)
    engine.setdefault("env", []).append({"name": NODE_KEY_ENV, "valueFrom": {"secretKeyRef": {
        "name": key_secret, "key": NODE_KEY_FIELD}}})


def group_pod_specs(key_secret: str, spec: ServiceSpec, pod: dict[str, Any]
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(leader, worker) pod specs from the Deployment's pod spec ``pod``, their engines'
    key from the Secret ``key_secret``."""
    leader, worker = copy.deepcopy(pod), copy.deepcopy(pod)
    _join_group(leader, key_secret, spec, worker=False)
    _engine(leader)["ports"] += [
        {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"},
        {"name": "control", "containerPort": CONTROL_PORT, "protocol": "TCP"}]
    _join_group(worker, key_secret, spec, worker=True)
    worker["initContainers"] = [c for c in worker["initContainers"] if c["name"] != "preflight"]
    if not worker["initContainers"]:
        del worker["initContainers"]
    engine = _engine(worker)
    for key in ("ports", "startupProbe", "livenessProbe", "readinessProbe"):
        engine.pop(key)
    return leader, worker


def render_leader_worker_set(name: str, namespace: str, spec: ServiceSpec, *,
                             key_secret: str, default_image: str = DEFAULT_IMAGE,
                             download_bytes: int | None = None,
                             hub_endpoint: str | None = None,
                             gateway: GatewayWiring = NO_GATEWAY) -> dict[str, Any]:
    """The LeaderWorkerSet named as the resource: ``spec.replicas`` groups of ``spec.nodes``
    pods, whose engines read the control channel's key from the Secret ``key_secret``.
    ``download_bytes``, ``hub_endpoint`` and ``gateway``: see ``render.render_pod_spec``."""
    pod = render_pod_spec(spec, default_image=default_image, download_bytes=download_bytes,
                          hub_endpoint=hub_endpoint, gateway=gateway)
    leader, worker = group_pod_specs(key_secret, spec, pod)
    meta = pod_template_metadata(name, spec)  # the leader serves HTTP, the workers not
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": workload_labels(name, spec)},
        "spec": {
            "replicas": spec.replicas,
            "startupPolicy": "LeaderCreated",
            "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
            "leaderWorkerTemplate": {
                "size": spec.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {"metadata": meta, "spec": leader},
                "workerTemplate": {"metadata": pod_template_metadata(name, spec, serving=False),
                                   "spec": worker},
            },
        },
    }


def render_workload(name: str, namespace: str, spec: ServiceSpec, *,
                    key_secret: str | None = None, **pod_options: Any
                    ) -> tuple[tuple[str, str], dict[str, Any]]:
    """((apiVersion, plural), body) of the pods' owner: a Deployment, or a LeaderWorkerSet
    for ``nodes`` above 1, its key in the Secret ``key_secret`` (required then).
    ``pod_options``: ``render_deployment``'s keywords."""
    if spec.nodes > 1:
        if key_secret is None:
            raise ValueError("a group's pods need the name of their key Secret")
        return LEADER_WORKER_SETS, render_leader_worker_set(
            name, namespace, spec, key_secret=key_secret, **pod_options)
    return DEPLOYMENTS, render_deployment(name, namespace, spec, **pod_options)


def render_serving_service(name: str, namespace: str, spec: ServiceSpec) -> dict[str, Any]:
    """The Service named as the resource, in front of the pods that serve HTTP."""
    service = render_service(name, namespace, spec)
    service["spec"]["selector"] = serving_labels(name, spec)
    return service


def render_group_network_policy(name: str, namespace: str, spec: ServiceSpec,
                                allow_namespaces: tuple[str, ...] | None) -> dict[str, Any]:
    """The NetworkPolicy named as the resource for ``nodes`` above 1: the pods of its
    LeaderWorkerSet admit each other on every port (the rendezvous, the control channel,
    the ranks' own connections) and others on the HTTP port only: from anywhere, or with
    the admin's ``networkPolicy.enabled`` (``allow_namespaces`` not None) from those
    ``network_policy.render_network_policy`` admits."""
    body = render_network_policy(name, namespace, spec, allow_namespaces or ())
    [http] = body["spec"]["ingress"]
    if allow_namespaces is None:
        del http["from"]  # every source, on this port only
    group = {"podSelector": {"matchLabels": {LABEL: name, LWS_NAME_LABEL: name}}}
    body["spec"]["ingress"] = [{"from": [group]}, http]
    return body


def render_node_key_secret(name: str, namespace: str, key: bytes,
                           secret_name: str | None = None) -> dict[str, Any]:
    """The Secret with the control channel's key: ``key`` (``NODE_KEY_BYTES`` random bytes
    the caller draws) in hex, since it reaches the engine as an env var, text; named
    ``secret_name``, else by the API server from ``node_key_secret_prefix``; created, never
    rewritten, owned by the resource."""
    naming = ({"name": secret_name} if secret_name is not None
              else {"generateName": node_key_secret_prefix(name)})
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {**naming, "namespace": namespace, "labels": labels(name)},
        "type": "Opaque",
        "data": {NODE_KEY_FIELD: base64.b64encode(key.hex().encode("ascii")).decode("ascii")},
    }
