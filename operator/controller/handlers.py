"""kopf handlers: thin, level-based, idempotent.

- create/update/resume and a periodic timer: render the Deployment (a LeaderWorkerSet
  with ``spec.nodes`` above 1) and Service (and the HPA or ScaledObject, the
  PodDisruptionBudget and the NetworkPolicy, when the spec wants them), apply them (owned
  by the resource; ``children.py``), delete those it no longer wants, then recompute the
  status. Each apply reads the resource afresh under a per-resource lock, so the timer
  and the update handler never apply an older ``spec.replicas`` (which the autoscaler
  writes through the scale subresource) over a newer one.
- pod, Deployment and LeaderWorkerSet events (label ``kvledger.dev/inferenceservice``):
  recompute the owner's status from every pod it has and its Deployment's (indexes) or
  LeaderWorkerSet's status, so status is a function of what they report now.
- InferenceObjective events: the objectives ConfigMap of the service whose InferencePool
  the objective names, written again (``children.apply_objectives``).
- the resource's DELETED event: delete its children. In a cluster the garbage collector
  does this through the owner references anyway; this needs no deletion handler (and so
  no finalizer of ours) and covers API servers without a garbage collector. kopf adds
  its own finalizer for the timer, to stop it cleanly.
- a hub model cached in an emptyDir: the pod's ``sizeLimit`` comes from the checkpoint's
  download size, asked of the hub once per uri, with no token, at the hub endpoint the
  admin allows, and kept in ``status.model``. When the hub cannot answer, no pod is
  rendered: ``Ready=False/ModelUnavailable``, asked again in 60 s. A model that needs a
  token (``spec.model.tokenSecretRef``) is sized in its pod: the operator reads no Secret
  (it would otherwise hand whoever may create a resource every Secret of the namespace),
  and its emptyDir gets no ``sizeLimit`` (``spec.model.cache``, a claim, sizes it).
- what only the cluster admin may choose (``policy.py``: images, host folders, priority
  classes, control-plane nodes, hub endpoints) is checked before anything is applied:
  ``Ready=False/PolicyDenied`` naming the Helm value, and nothing rendered.

kopf's settings and the cluster's credentials are ``setup.py``'s. Shared state travels in
``memo`` (set by ``main`` or ``setup.configure``, or a test): ``kube`` (KubeApi),
``default_image``, ``prometheus_url``, ``policy``, ``status_locks`` and ``apply_locks``.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import re
from typing import Any, cast

import kopf

from kvledger.engine.errors import BadInput, clip
from kvledger.engine.settings.serve_config import ServeConfig
from kvledger.operator.api.resource import API_VERSION, GROUP, PLURAL, VERSION
from kvledger.operator.api.spec import ServiceSpec, parse_spec
from kvledger.operator.api.status_types import (
    DeploymentEntry,
    ModelRecord,
    PodEntry,
    PodStatus,
    ServiceStatus,
)
from kvledger.operator.cluster.kube import KubeApi, KubeError, object_path
from kvledger.operator.cluster.merge_patch import contains
from kvledger.operator.cluster.ownership import ChildTaken, delete_owned, owned_by
from kvledger.operator.controller import setup, status
from kvledger.operator.controller.children import (
    CHILDREN,
    ModelUnavailable,
    apply_children,
    apply_objectives,
)
from kvledger.operator.controller.missing_apis import (
    ApiMissing,
    lws_missing,
    lws_served,
    missing_api,
)
from kvledger.operator.controller.rollout import APPLIED_GENERATION
from kvledger.operator.render import gateway, render, render_group
from kvledger.operator.render.policy import PolicyDenied

# The operator's start and end (kopf's settings, credentials: setup.py) register with these.
find_credentials, REPORTING_COMPONENT = setup.find_credentials, setup.REPORTING_COMPONENT
ISVC = (GROUP, VERSION, PLURAL)
RECONCILE_INTERVAL_S = 60.0
RETRY_DELAY_S = 10.0
_POD_FILTER = {render.LABEL: kopf.PRESENT}
_DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a resource's name
# The hub down, a gated model without a token, a Secret not created yet: each is fixed
# outside the spec, so it is asked again (and the resource does not change meanwhile).
HUB_RETRY_DELAY_S = 60.0


@kopf.index("pods", labels=_POD_FILTER)
def pods_by_service(namespace: str, name: str, labels: kopf.Labels,
                    status: kopf.Status, **_: Any) -> dict[tuple[str, str], PodEntry]:
    """(namespace, InferenceService name) -> each of its pods' name and status, and where
    a LeaderWorkerSet made it, its group's and its own index in the group."""
    return {(namespace, labels[render.LABEL]): {
        "name": name, "status": cast(PodStatus, dict(status)),
        "group": labels.get(render_group.GROUP_INDEX_LABEL),
        "worker": labels.get(render_group.WORKER_INDEX_LABEL)}}


@kopf.index("deployments", labels=_POD_FILTER)
def deployments_by_service(namespace: str, labels: kopf.Labels, meta: kopf.Meta,
                           annotations: kopf.Annotations, status: kopf.Status,
                           **_: Any) -> dict[tuple[str, str], DeploymentEntry]:
    """(namespace, InferenceService name) -> its Deployment's generation, the resource's
    generation it was applied from, and its status (``rollout.rollout_of`` reads them)."""
    return {(namespace, labels[render.LABEL]): {
        "generation": meta.get("generation"),
        "applied": annotations.get(APPLIED_GENERATION), "status": dict(status)}}


@kopf.on.create(*ISVC)
@kopf.on.update(*ISVC)
@kopf.on.resume(*ISVC)
async def reconcile(name: str, namespace: str, memo: kopf.Memo, pods_by_service: kopf.Index,
                    deployments_by_service: kopf.Index | None = None, **_: Any) -> None:
    indexes = (pods_by_service, deployments_by_service)
    try:
        model = await apply_children(memo, name, namespace)
    except BadInput as exc:  # can never work: say so once, do not retry
        await sync_status(memo, namespace, name, *indexes)
        raise kopf.PermanentError(f"invalid spec: {exc}") from None
    except ModelUnavailable as exc:
        await sync_status(memo, namespace, name, *indexes, model_error=str(exc))
        raise kopf.TemporaryError(f"model unavailable: {exc}", delay=HUB_RETRY_DELAY_S) from None
    except ApiMissing as exc:  # an install fixes it:
        # asked again, slowly
        await sync_status(memo, namespace, name, *indexes)
        raise kopf.TemporaryError(str(exc), delay=HUB_RETRY_DELAY_S) from None
    except (KubeError, ChildTaken) as exc:  # refused, failed, or another's: try again soon
        await sync_status(memo, namespace, name, *indexes, apply_error=exc)
        raise kopf.TemporaryError(f"applying the children failed: {exc}",
                                  delay=RETRY_DELAY_S) from None
    await sync_status(memo, namespace, name, *indexes, model=model)


@kopf.timer(*ISVC, interval=RECONCILE_INTERVAL_S, initial_delay=RECONCILE_INTERVAL_S)
async def resync(name: str, namespace: str, memo: kopf.Memo, pods_by_service: kopf.Index,
                 deployments_by_service: kopf.Index | None = None, **_: Any) -> None:
    """Repair drift (a child edited or deleted by hand) and refresh the status."""
    model, model_error, apply_error = None, None, None
    try:
        model = await apply_children(memo, name, namespace)
    except (BadInput, ApiMissing):
        pass  # reported by sync_status (InvalidSpec, the missing API's reason)
    except ModelUnavailable as exc:
        model_error = str(exc)
    except (KubeError, ChildTaken) as exc:
        apply_error = exc
    await sync_status(memo, namespace, name, pods_by_service, deployments_by_service,
                      model=model, model_error=model_error, apply_error=apply_error)


@kopf.on.event("pods", labels=_POD_FILTER)
async def pod_changed(labels: kopf.Labels, namespace: str, memo: kopf.Memo,
                      pods_by_service: kopf.Index, deployments_by_service: kopf.Index,
                      **_: Any) -> None:
    await sync_status(memo, namespace, labels[render.LABEL], pods_by_service,
                      deployments_by_service)


@kopf.on.event("deployments", labels=_POD_FILTER)
@kopf.on.event(render_group.LWS_GROUP, "v1", render_group.LWS_PLURAL, labels=_POD_FILTER)
async def deployment_changed(labels: kopf.Labels, namespace: str, memo: kopf.Memo,
                             pods_by_service: kopf.Index, deployments_by_service: kopf.Index,
                             **_: Any) -> None:
    """The Deployment's or LeaderWorkerSet's status (its count) is ``status.replicas``. A
    LeaderWorkerSet is watched where LWS was served when the operator started; elsewhere
    its status is read at each pod event and every 60 s."""
    await sync_status(memo, namespace, labels[render.LABEL], pods_by_service,
                      deployments_by_service)


@kopf.on.event(gateway.OBJECTIVE_GROUP, "v1alpha2", gateway.OBJECTIVE_PLURAL)
async def objective_changed(spec: kopf.Spec, namespace: str, memo: kopf.Memo,
                            logger: logging.Logger, **_: Any) -> None:
    """An InferenceObjective created, changed or deleted: the objectives file of the service
    whose pool it names is written again now (every 60 s anyway, by ``resync``: also for a
    pool an objective no longer names). Watched where the router's CRD was served when the
    operator started."""
    pool = (spec.get("poolRef") or {}).get("name")
    if not isinstance(pool, str) or not _DNS_NAME.fullmatch(pool):
        return
    try:
        await apply_objectives(memo, pool, namespace)
    except (KubeError, ChildTaken) as exc:
        logger.warning(f"writing the objectives of {namespace}/{pool} failed: {exc}")


@kopf.on.event(*ISVC)
async def isvc_event(type: str, name: str, namespace: str, memo: kopf.Memo, body: kopf.Body,
                     logger: logging.Logger, **_: Any) -> None:
    if type != "DELETED":
        return
    memo.status_locks.pop((namespace, name), None)
    memo.apply_locks.pop((namespace, name), None)
    uid = body.get("metadata", {}).get("uid")
    for api_version, plural in CHILDREN:  # its own only: another's of its name stays
        if uid and await delete_owned(memo.kube, object_path(api_version, plural, namespace,
                                                             name), uid):
            logger.info(f"deleted {plural[:-1]} {namespace}/{name}")


async def sync_status(memo: kopf.Memo, namespace: str, name: str, pods_index: kopf.Index,
                      deployments_index: kopf.Index | None = None, *,
                      model: ModelRecord | None = None,
                      model_error: str | None = None,
                      apply_error: KubeError | ChildTaken | None = None) -> None:
    """Recompute the resource's status from its pods and its Deployment's (or
    LeaderWorkerSet's) status, and patch it if it changed.

    ``model``: a download size just had (``status.model``); ``model_error``: why it could
    not be had (``Ready=False/ModelUnavailable``); ``apply_error``: the API server refused
    a child (``Ready=False/ApplyFailed`` with its words, where it will not pass on a retry
    alone: a 4xx but a conflict, a rate limit or a missing object)."""
    lock = memo.status_locks.setdefault((namespace, name), asyncio.Lock())
    async with lock:
        path = object_path(API_VERSION, PLURAL, namespace, name)
        obj = await memo.kube.get(path)
        if obj is None or obj.get("metadata", {}).get("deletionTimestamp"):
            return
        raw = obj.get("spec") or {}
        spec, spec_error, spec_reason = None, None, "InvalidSpec"
        try:
            spec = parse_spec(raw)
            memo.policy.check(spec, memo.default_image, name=name, namespace=namespace)
        except PolicyDenied as exc:
            spec, spec_error, spec_reason = None, str(exc), "PolicyDenied"
        except BadInput as exc:
            spec_error = str(exc)
        old = cast(ServiceStatus, obj.get("status") or {})
        entries = list(pods_index.get((namespace, name), []))
        deployments = list((deployments_index or {}).get((namespace, name), []))
        workload = (await _group_state(memo.kube, namespace, name, spec, entries,
                                       obj.get("metadata", {}).get("uid"))
                    if spec is not None and spec.nodes > 1 else
                    {"replicas": (deployments[0].get("status") or {}).get("replicas", 0)
                     if deployments else 0,
                     "deployment": deployments[0] if deployments else None})
        missing = (await missing_api(memo.kube, spec)
                   if spec is not None and "blocked" not in workload else None)
        if missing is not None:
            workload["blocked"] = (missing.reason, str(missing))
        elif isinstance(apply_error, ChildTaken):
            workload["blocked"] = (ChildTaken.reason, clip(str(apply_error)))
        elif apply_error is not None and apply_error.refused:
            workload["blocked"] = ("ApplyFailed", f"the API server refused a child: "
                                                  f"{clip(str(apply_error))}")
        new = status.compute_status(
            spec=spec, generation=obj.get("metadata", {}).get("generation"), old=old,
            pods=[entry["status"] for entry in entries], spec_error=spec_error,
            spec_reason=spec_reason,
            endpoint=render.endpoint(name, namespace,
                                     spec.serve.port if spec
                                     else raw.get("port", ServeConfig.port)),
            model=model, model_error=model_error,
            selector=(render_group.serving_selector(name, spec) if spec
                      else render.pod_selector(name)),
            now=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            **workload)
        if not contains(old, new):
            await memo.kube.patch(path + "/status", {"status": new})
        for kind, reason, message in status.transition_events(
                old.get("conditions") or [], new["conditions"]):
            kopf.event(obj, type=kind, reason=reason, message=message)


async def _group_state(kube: KubeApi, namespace: str, name: str, spec: ServiceSpec,
                       entries: list[PodEntry], uid: str | None) -> dict[str, Any]:
    """``compute_status``'s keywords for a multi-node service: its LeaderWorkerSet's counts
    of groups (its own: another's of its name counts nothing), every pod of them, or what
    blocks it (LWS not served)."""
    lws = await kube.get(object_path(*render_group.LEADER_WORKER_SETS, namespace, name))
    if lws is not None and not (uid and owned_by(lws, uid)):
        lws = {}
    if lws is None and not await lws_served(kube):
        return {"replicas": 0, "blocked": ("LeaderWorkerSetMissing", lws_missing(spec))}
    counts = (lws or {}).get("status") or {}
    return {"replicas": counts.get("replicas", 0),
            "ready_replicas": counts.get("readyReplicas", 0),
            "group_pods": status.group_pod_status(entries)}
