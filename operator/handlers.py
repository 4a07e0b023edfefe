"""kopf handlers: thin, level-based, idempotent.

- create/update/resume and a periodic timer: render the Deployment and Service, apply
  them (owned by the resource), then recompute the status.
- pod events (label ``kvledger.dev/inferenceservice``): recompute the owner's status from
  every pod it has (an index), so status is a function of what the pods report now.
- the resource's DELETED event: delete its children. In a cluster the garbage collector
  does this through the owner references anyway; this needs no deletion handler (and so
  no finalizer of ours) and covers API servers without a garbage collector. kopf adds
  its own finalizer for the timer, to stop it cleanly.

Shared state travels in ``memo`` (set by ``main`` or a test): ``kube`` (KubeApi),
``default_image`` and ``status_locks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from typing import Any

import kopf
import yaml

from kvledger.engine.errors import BadInput
from kvledger.operator import render, status
from kvledger.operator.crd import API_VERSION, GROUP, PLURAL, VERSION
from kvledger.operator.kube import KubeApi, KubeError, contains, object_path

ISVC = (GROUP, VERSION, PLURAL)
RECONCILE_INTERVAL_S = 60.0
RETRY_DELAY_S = 10.0
_POD_FILTER = {render.LABEL: kopf.PRESENT}


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Progress and diff-base in annotations: the status belongs to kvledger alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    # Only the events we post on purpose, never handler logs.
    settings.posting.loggers = False
    settings.posting.level = logging.INFO
    # The CRD is installed before the operator (Helm's crds/), so no runtime CRD scan:
    # that keeps the RBAC to what the handlers use.
    settings.scanning.disabled = True
    memo.setdefault("default_image", render.DEFAULT_IMAGE)
    memo.setdefault("status_locks", {})
    memo.setdefault("kube", KubeApi())


def find_credentials(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """In-cluster service account first, then $KUBECONFIG / ~/.kube/config; BadInput if none."""
    try:
        info = (kopf.login_with_service_account(settings=settings)
                or kopf.login_with_kubeconfig(settings=settings))
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError, kopf.LoginError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BadInput(f"cannot read the Kubernetes credentials: {detail}") from None
    if info is None:
        raise BadInput("no Kubernetes credentials: not in a pod, and no $KUBECONFIG "
                       "or ~/.kube/config")
    return info


@kopf.on.login()
def login(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    try:
        info = find_credentials(settings)
    except BadInput as exc:
        raise kopf.PermanentError(str(exc)) from None
    memo.kube.connect(info)
    return info


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    await memo.kube.close()


@kopf.index("pods", labels=_POD_FILTER)
def pods_by_service(namespace: str, name: str, labels: kopf.Labels,
                    status: kopf.Status, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """(namespace, InferenceService name) -> each of its pods' name and status."""
    return {(namespace, labels[render.LABEL]): {"name": name, "status": dict(status)}}


@kopf.on.create(*ISVC)
@kopf.on.update(*ISVC)
@kopf.on.resume(*ISVC)
async def reconcile(name: str, namespace: str, spec: kopf.Spec, body: kopf.Body,
                    memo: kopf.Memo, pods_by_service: kopf.Index, **_: Any) -> None:
    try:
        await apply_children(memo, name, namespace, dict(spec), body)
    except BadInput as exc:  # can never work: say so once, do not retry
        await sync_status(memo, namespace, name, pods_by_service)
        raise kopf.PermanentError(f"invalid spec: {exc}") from None
    except KubeError as exc:  # the API server refused or failed: try again soon
        raise kopf.TemporaryError(f"applying the children failed: {exc}",
                                  delay=RETRY_DELAY_S) from None
    await sync_status(memo, namespace, name, pods_by_service)


@kopf.timer(*ISVC, interval=RECONCILE_INTERVAL_S, initial_delay=RECONCILE_INTERVAL_S)
async def resync(name: str, namespace: str, spec: kopf.Spec, body: kopf.Body,
                 memo: kopf.Memo, pods_by_service: kopf.Index, **_: Any) -> None:
    """Repair drift (a child edited or deleted by hand) and refresh the status."""
    # A BadInput spec is reported as InvalidSpec by sync_status; the spec must change first.
    with contextlib.suppress(BadInput):
        await apply_children(memo, name, namespace, dict(spec), body)
    await sync_status(memo, namespace, name, pods_by_service)


@kopf.on.event("pods", labels=_POD_FILTER)
async def pod_changed(labels: kopf.Labels, namespace: str, memo: kopf.Memo,
                      pods_by_service: kopf.Index, **_: Any) -> None:
    await sync_status(memo, namespace, labels[render.LABEL], pods_by_service)


@kopf.on.event(*ISVC)
async def isvc_event(type: str, name: str, namespace: str, memo: kopf.Memo,
                     logger: logging.Logger, **_: Any) -> None:
    if type != "DELETED":
        return
    memo.status_locks.pop((namespace, name), None)
    for api_version, plural in (("apps/v1", "deployments"), ("v1", "services")):
        if await memo.kube.delete(object_path(api_version, plural, namespace, name)):
            logger.info(f"deleted {plural[:-1]} {namespace}/{name}")


async def apply_children(memo: kopf.Memo, name: str, namespace: str, spec: dict[str, Any],
                         owner: kopf.Body) -> None:
    """Render and apply the Deployment and Service; BadInput if the spec can never work."""
    deployment = render.render_deployment(name, namespace, spec,
                                          default_image=memo.default_image)
    service = render.render_service(name, namespace, spec)
    kopf.adopt([deployment, service], owner=owner)
    await memo.kube.apply("apps/v1", "deployments", deployment)
    await memo.kube.apply("v1", "services", service)


async def sync_status(memo: kopf.Memo, namespace: str, name: str,
                      pods_index: kopf.Index) -> None:
    """Recompute the resource's status from its pods and patch it if it changed."""
    lock = memo.status_locks.setdefault((namespace, name), asyncio.Lock())
    async with lock:
        path = object_path(API_VERSION, PLURAL, namespace, name)
        obj = await memo.kube.get(path)
        if obj is None or obj.get("metadata", {}).get("deletionTimestamp"):
            return
        spec = obj.get("spec") or {}
        try:
            render.engine_flags(spec)
            spec_error = None
        except BadInput as exc:
            spec_error = str(exc)
        old = obj.get("status") or {}
        pods = [entry["status"] for entry in pods_index.get((namespace, name), [])]
        new = status.compute_status(
            spec=spec, generation=obj.get("metadata", {}).get("generation"), old=old,
            pods=pods, spec_error=spec_error, endpoint=render.endpoint(name, namespace, spec),
            now=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        if not contains(old, new):
            await memo.kube.patch(path + "/status", {"status": new})
        for kind, reason, message in status.transition_events(
                old.get("conditions") or [], new["conditions"]):
            kopf.event(obj, type=kind, reason=reason, message=message)
