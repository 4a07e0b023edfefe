"""A resource's children, applied as its spec wants them now (the handlers call this).

The pods' owner is a Deployment, or with ``spec.nodes`` above 1 a LeaderWorkerSet
(``render_group``), and the other kind is deleted, so changing ``nodes`` swaps them. Where
the cluster does not serve a kind the spec needs, nothing is applied or deleted and an
``ApiMissing`` (missing_apis.py) says what to install. A group's control-channel key is a
Secret the operator creates and never reads back (it may create Secrets, never read them), under a name the API server
generates in that very create and that ``status.nodeKeySecret`` keeps: a fixed name could
be taken first by anyone who may create Secrets in the namespace, with a key of their own,
and the operator, which cannot read a Secret's owner, would point the group at it.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, cast

import kopf

from kvledger.engine.errors import BadInput
from kvledger.operator.api.propagation import with_metadata
from kvledger.operator.api.resource import API_VERSION, PLURAL
from kvledger.operator.api.spec import ServiceSpec, parse_spec
from kvledger.operator.api.status_types import ModelRecord, ServiceStatus
from kvledger.operator.cluster.kube import KubeApi, KubeError, object_path
from kvledger.operator.cluster.ownership import delete_owned
from kvledger.operator.controller.missing_apis import (
    LeaderWorkerSetMissing,
    lws_missing,
    lws_served,
    missing_api,
)
from kvledger.operator.controller.rollout import APPLIED_GENERATION
from kvledger.operator.controller.startup import cold_start_seconds
from kvledger.operator.render import autoscaling, gateway, render_group
from kvledger.operator.render.gateway_wiring import GatewayWiring, objectives_wired
from kvledger.operator.render.network_policy import render_network_policy
from kvledger.operator.render.pod import render_sleep_config_map
from kvledger.operator.render.render import labels
from kvledger.operator.render.render_group import DEPLOYMENTS, LEADER_WORKER_SETS

# Every child, in the order they go when the resource does (the key Secret goes with its
# owner through the garbage collector: the operator has no right to delete Secrets).
NETWORK_POLICY = ("networking.k8s.io/v1", "networkpolicies")
CONFIG_MAPS = ("v1", "configmaps")  # spec.sleep's (NAME-sleep), the objectives' (NAME-objectives)
CHILDREN = (DEPLOYMENTS, LEADER_WORKER_SETS, ("v1", "services"), *autoscaling.OPTIONAL_CHILDREN,
            NETWORK_POLICY, gateway.INFERENCE_POOLS)


class ModelUnavailable(Exception):
    """The hub model's download size cannot be had now; the message is one line, no token."""


async def apply_children(memo: kopf.Memo, name: str, namespace: str) -> ModelRecord | None:
    """Render and apply the resource's children as it is now: the Deployment or
    LeaderWorkerSet, the Service, the HPA or ScaledObject and the PodDisruptionBudget where
    the spec wants them, the NetworkPolicy (the admin's, or a group's) and a group's key
    Secret; the others are deleted. Returns the ``status.model`` the pods were sized with
    (None unless they cache a hub model in an emptyDir).

    The resource is read afresh, under a lock per resource: a handler that waited for the
    lock applies what the resource says now, never the body of an older event, so the
    replicas never step back to a count the autoscaler already replaced.

    Raises BadInput if the spec can never work, ModelUnavailable if the hub model's size
    cannot be had now, ApiMissing (LeaderWorkerSet, InferencePool, the HTTP add-on), KubeError if the API
    server fails.
    """
    lock = memo.apply_locks.setdefault((namespace, name), asyncio.Lock())
    async with lock:
        owner = await memo.kube.get(object_path(API_VERSION, PLURAL, namespace, name))
        if owner is None or owner.get("metadata", {}).get("deletionTimestamp"):
            return None  # going: the garbage collector (or isvc_event) removes the children
        # Parsed once: an invalid spec is refused before anything is asked or applied.
        spec = with_metadata(parse_spec(owner.get("spec") or {}), owner.get("metadata"))
        # PolicyDenied: nothing is applied.
        memo.policy.check(spec, memo.default_image, name=name, namespace=namespace)
        spec = memo.policy.pod_metadata(spec)  # the resource's own labels the admin allows
        if spec.nodes > 1 and not await lws_served(memo.kube):
            raise LeaderWorkerSetMissing(lws_missing(spec))
        missing = await missing_api(memo.kube, spec)
        if missing is not None:
            raise missing
        model = await download_size(memo, spec, cast(ServiceStatus, owner.get("status") or {}))
        await _apply(memo, name, namespace, spec, kopf.Body(owner),
                     model.get("downloadBytes") if model else None)
        return model


async def _apply(memo: kopf.Memo, name: str, namespace: str, spec: ServiceSpec,
                 owner: kopf.Body, download_bytes: int | None) -> None:
    kube: KubeApi = memo.kube
    # Before the pods that read it.
    key_secret = await node_key_secret(kube, name, namespace, owner) if spec.nodes > 1 else None
    kind, workload = render_group.render_workload(
        name, namespace, spec, key_secret=key_secret, default_image=memo.default_image,
        download_bytes=download_bytes, hub_endpoint=memo.policy.hub_endpoint(spec),
        gateway=memo.policy.gateway)
    optional = autoscaling.render_scaling(name, namespace, spec,
                                          prometheus_url=memo.prometheus_url,
                                          http_scaler=memo.http_scaler,
                                          start_seconds=cold_start_seconds(owner))
    optional[NETWORK_POLICY] = network_policy(name, namespace, spec, memo.policy.network_policy)
    # None: deleted, as the other optional children (a 404 where the API is not served).
    optional[gateway.INFERENCE_POOLS] = gateway.render_inference_pool(
        name, namespace, spec, memo.policy.picker, memo.policy.picker_port)
    service = render_group.render_serving_service(name, namespace, spec)
    # Before the pods that read it; kept (not deleted) when sleep mode goes: it is small,
    # owned, and goes with the resource.
    sleep = render_sleep_config_map(name, namespace, spec, labels(name))
    objectives = await pool_objectives_child(kube, name, namespace, spec, memo.policy.gateway)
    wanted = [body for body in (workload, service, sleep, objectives, *optional.values())
              if body is not None]
    kopf.append_owner_reference(wanted, owner=owner)  # not adopt: it copies every label
    if kind == DEPLOYMENTS:  # which generation its pods serve (``rollout.py``)
        workload["metadata"].setdefault("annotations", {})[APPLIED_GENERATION] = str(
            owner.get("metadata", {}).get("generation", ""))
    uid = owner["metadata"]["uid"]  # only its own children are deleted (``ownership``)
    # Unwanted first: an HPA and a ScaledObject never scale the resource together.
    for (api_version, plural), body in optional.items():
        if body is None:
            await delete_owned(kube, object_path(api_version, plural, namespace, name), uid)
    for config_map in (sleep, objectives):
        if config_map is not None:
            await kube.apply(*CONFIG_MAPS, config_map)
    await kube.apply(*kind, workload)
    other = DEPLOYMENTS if kind == LEADER_WORKER_SETS else LEADER_WORKER_SETS
    await delete_owned(kube, object_path(*other, namespace, name), uid)
    await kube.apply("v1", "services", service)
    for (api_version, plural), body in optional.items():
        if body is not None:
            await kube.apply(api_version, plural, body)


async def pool_objectives_child(kube: KubeApi, name: str, namespace: str, spec: ServiceSpec,
                                wiring: GatewayWiring) -> dict[str, Any] | None:
    """The ConfigMap of the InferencePool's objectives as the namespace holds them now (none
    where the cluster does not serve InferenceObjective), or None when the engines read
    none (``gateway_wiring.objectives_wired``). Kept, not deleted, when they no longer do: small,
    owned, and it goes with the resource."""
    if not objectives_wired(spec, wiring):
        return None
    listed = await kube.list(object_path(*gateway.INFERENCE_OBJECTIVES, namespace))
    return gateway.render_objectives_config_map(name, namespace,
                                                gateway.pool_objectives(listed, name))


async def apply_objectives(memo: kopf.Memo, name: str, namespace: str) -> None:
    """Write the objectives ConfigMap of the resource ``name`` again (an objective naming
    its pool changed), under the resource's apply lock; nothing for a resource that is
    gone, invalid or not behind a gateway."""
    lock = memo.apply_locks.setdefault((namespace, name), asyncio.Lock())
    async with lock:
        owner = await memo.kube.get(object_path(API_VERSION, PLURAL, namespace, name))
        if owner is None or owner.get("metadata", {}).get("deletionTimestamp"):
            return
        try:
            spec = parse_spec(owner.get("spec") or {})
        except BadInput:
            return  # its status says so; the next valid spec writes the file
        body = await pool_objectives_child(memo.kube, name, namespace, spec,
                                           memo.policy.gateway)
        if body is not None:
            kopf.append_owner_reference(body, owner=kopf.Body(owner))
            await memo.kube.apply(*CONFIG_MAPS, body)


async def node_key_secret(kube: KubeApi, name: str, namespace: str, owner: kopf.Body) -> str:
    """The name of the group's key Secret, one the operator created itself: the one
    ``status.nodeKeySecret`` names (made again under that name, with a new key, if it is
    gone; nothing is read), else a new one whose name the API server generates, recorded
    there before any pod refers to it. The status subresource is the operator's alone, so
    neither the resource's author nor anyone who may create Secrets chooses the key."""
    key = render_group.render_node_key_secret(
        name, namespace, secrets.token_bytes(render_group.NODE_KEY_BYTES))
    kopf.append_owner_reference(key, owner=owner)
    known = (owner.get("status") or {}).get("nodeKeySecret")
    if isinstance(known, str) and known.startswith(render_group.node_key_secret_prefix(name)):
        key["metadata"].pop("generateName")
        key["metadata"]["name"] = known
        await kube.create_once("v1", "secrets", key)
        return known
    created = await kube.create(object_path("v1", "secrets", namespace), key)
    made = (created.get("metadata") or {}).get("name")
    if not made:
        raise KubeError(0, "the API server named no key Secret for the group")
    await kube.patch(object_path(API_VERSION, PLURAL, namespace, name) + "/status",
                     {"status": {"nodeKeySecret": made}})
    return made


def network_policy(name: str, namespace: str, spec: ServiceSpec,
                   allowed: tuple[str, ...] | None) -> dict[str, Any] | None:
    """The NetworkPolicy a resource owns: a group's (``render_group``), else the admin's
    ``networkPolicy.enabled`` one (``allowed``: the namespaces it admits), else none."""
    if spec.nodes > 1:
        return render_group.render_group_network_policy(name, namespace, spec, allowed)
    return None if allowed is None else render_network_policy(name, namespace, spec, allowed)


async def download_size(memo: kopf.Memo, spec: ServiceSpec,
                        status: ServiceStatus) -> ModelRecord | None:
    """``{uri, downloadBytes}`` when the pod's emptyDir cache must be sized, else None:
    from ``status.model`` when this uri was asked before, else from the hub, with no token,
    at the endpoint the admin allows (``memo.hub_models``: the operator's hub threads and
    limits, as the webhook's reads). A model that needs a
    token is sized in its pod: ``{uri}`` alone, and the emptyDir gets no limit. Raises
    ModelUnavailable with a one-line reason."""
    uri = spec.model.uri
    if not spec.model.needs_download_size or uri is None:
        return None
    if spec.model.token_secret is not None:
        return {"uri": uri}  # the operator reads no Secret: the pod's fetch sizes it
    known: ModelRecord = status.get("model") or {}
    if known.get("uri") == uri and isinstance(known.get("downloadBytes"), int):
        return {"uri": uri, "downloadBytes": known["downloadBytes"]}
    from kvledger.operator.cluster.hub_models import HubUnavailable

    try:
        size = await memo.hub_models.download_bytes(uri, memo.policy.hub_endpoint(spec))
    except (BadInput, OSError, HubUnavailable) as exc:
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if "HF_TOKEN" in message:  # the engine's hint, in the resource's words
            message += " (on the cluster: spec.model.tokenSecretRef)"
        raise ModelUnavailable(f"cannot size {uri} from the hub: {message}") from None
    return {"uri": uri, "downloadBytes": size}
