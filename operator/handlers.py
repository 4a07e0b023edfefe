"""kopf handlers: thin, level-based, idempotent.

- create/update/resume and a periodic timer: render the Deployment and Service (and the
  HPA or ScaledObject, and the PodDisruptionBudget, when the spec wants them), apply them
  (owned by the resource), delete the optional ones it no longer wants, then recompute
  the status. Each apply reads the resource afresh under a per-resource lock, so the timer
  and the update handler never apply an older ``spec.replicas`` (which the autoscaler
  writes through the scale subresource) over a newer one.
- pod and Deployment events (label ``kvledger.dev/inferenceservice``): recompute the
  owner's status from every pod it has and its Deployment's (indexes), so status is a
  function of what the pods and the Deployment report now.
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

Shared state travels in ``memo`` (set by ``main`` or a test): ``kube`` (KubeApi),
``default_image``, ``prometheus_url``, ``policy``, ``status_locks`` and ``apply_locks``.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import Any

import kopf
import yaml

from kvledger.engine.errors import BadInput
from kvledger.operator import autoscaling, render, status
from kvledger.operator.kube import KubeApi, KubeError, contains, object_path
from kvledger.operator.policy import Policy, PolicyDenied, render_network_policy
from kvledger.operator.resource import API_VERSION, DEFAULT_PORT, GROUP, PLURAL, VERSION
from kvledger.operator.spec import ServiceSpec, parse_spec

ISVC = (GROUP, VERSION, PLURAL)
RECONCILE_INTERVAL_S = 60.0
RETRY_DELAY_S = 10.0
_POD_FILTER = {render.LABEL: kopf.PRESENT}
# The hub down, a gated model without a token, a Secret not created yet: each is fixed
# outside the spec, so it is asked again (and the resource does not change meanwhile).
HUB_RETRY_DELAY_S = 60.0


class ModelUnavailable(Exception):
    """The hub model's download size cannot be had now; the message is one line, no token."""


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
    if memo.get("webhook_server") is not None:  # kvledger operator --webhook-port
        settings.admission.server = memo.webhook_server
        settings.admission.managed = None  # the chart renders the configuration
    memo.setdefault("default_image", render.DEFAULT_IMAGE)
    memo.setdefault("prometheus_url", autoscaling.DEFAULT_PROMETHEUS_URL)
    memo.setdefault("policy", Policy())
    memo.setdefault("status_locks", {})
    memo.setdefault("apply_locks", {})
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


@kopf.index("deployments", labels=_POD_FILTER)
def deployments_by_service(namespace: str, labels: kopf.Labels, status: kopf.Status,
                           **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """(namespace, InferenceService name) -> its Deployment's status."""
    return {(namespace, labels[render.LABEL]): dict(status)}


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
    except KubeError as exc:  # the API server refused or failed: try again soon
        raise kopf.TemporaryError(f"applying the children failed: {exc}",
                                  delay=RETRY_DELAY_S) from None
    await sync_status(memo, namespace, name, *indexes, model=model)


@kopf.timer(*ISVC, interval=RECONCILE_INTERVAL_S, initial_delay=RECONCILE_INTERVAL_S)
async def resync(name: str, namespace: str, memo: kopf.Memo, pods_by_service: kopf.Index,
                 deployments_by_service: kopf.Index | None = None, **_: Any) -> None:
    """Repair drift (a child edited or deleted by hand) and refresh the status."""
    model, model_error = None, None
    try:
        model = await apply_children(memo, name, namespace)
    except BadInput:
        pass  # reported as InvalidSpec by sync_status; the spec must change first
    except ModelUnavailable as exc:
        model_error = str(exc)
    await sync_status(memo, namespace, name, pods_by_service, deployments_by_service,
                      model=model, model_error=model_error)


@kopf.on.event("pods", labels=_POD_FILTER)
async def pod_changed(labels: kopf.Labels, namespace: str, memo: kopf.Memo,
                      pods_by_service: kopf.Index, deployments_by_service: kopf.Index,
                      **_: Any) -> None:
    await sync_status(memo, namespace, labels[render.LABEL], pods_by_service,
                      deployments_by_service)


@kopf.on.event("deployments", labels=_POD_FILTER)
async def deployment_changed(labels: kopf.Labels, namespace: str, memo: kopf.Memo,
                             pods_by_service: kopf.Index, deployments_by_service: kopf.Index,
                             **_: Any) -> None:
    """The Deployment's status (its pod count) is ``status.replicas``."""
    await sync_status(memo, namespace, labels[render.LABEL], pods_by_service,
                      deployments_by_service)


# Every child, in the order they go when the resource does.
CHILDREN = (("apps/v1", "deployments"), ("v1", "services"), *autoscaling.OPTIONAL_CHILDREN)
NETWORK_POLICY = ("networking.k8s.io/v1", "networkpolicies")  # with networkPolicy.enabled


@kopf.on.event(*ISVC)
async def isvc_event(type: str, name: str, namespace: str, memo: kopf.Memo,
                     logger: logging.Logger, **_: Any) -> None:
    if type != "DELETED":
        return
    memo.status_locks.pop((namespace, name), None)
    memo.apply_locks.pop((namespace, name), None)
    children = (*CHILDREN, NETWORK_POLICY) if memo.policy.network_policy is not None else CHILDREN
    for api_version, plural in children:
        if await memo.kube.delete(object_path(api_version, plural, namespace, name)):
            logger.info(f"deleted {plural[:-1]} {namespace}/{name}")


async def apply_children(memo: kopf.Memo, name: str, namespace: str) -> dict[str, Any] | None:
    """Render and apply the resource's children as it is now: the Deployment and Service,
    and the HPA or ScaledObject and the PodDisruptionBudget where the spec wants them (the
    others are deleted). Returns the ``status.model`` the pod was sized with (None unless
    it caches a hub model in an emptyDir).

    The resource is read afresh, under a lock per resource: a handler that waited for the
    lock applies what the resource says now, never the body of an older event, so the
    Deployment's replicas never step back to a count the autoscaler already replaced.

    Raises BadInput if the spec can never work, ModelUnavailable if the hub model's size
    cannot be had now, KubeError if the API server fails.
    """
    lock = memo.apply_locks.setdefault((namespace, name), asyncio.Lock())
    async with lock:
        owner = await memo.kube.get(object_path(API_VERSION, PLURAL, namespace, name))
        if owner is None or owner.get("metadata", {}).get("deletionTimestamp"):
            return None  # going: the garbage collector (or isvc_event) removes the children
        # Parsed once: an invalid spec is refused before anything is asked or applied.
        spec = parse_spec(owner.get("spec") or {})
        memo.policy.check(spec, memo.default_image)  # PolicyDenied: nothing is applied
        optional = autoscaling.render_scaling(name, namespace, spec,
                                              prometheus_url=memo.prometheus_url)
        model = await download_size(memo, spec, owner.get("status") or {})
        deployment = render.render_deployment(
            name, namespace, spec, default_image=memo.default_image,
            download_bytes=model.get("downloadBytes") if model else None,
            hub_endpoint=memo.policy.hub_endpoint(spec))
        service = render.render_service(name, namespace, spec)
        wanted = [body for body in optional.values() if body is not None]
        allowed = memo.policy.network_policy
        if allowed is not None:  # the admin's networkPolicy.enabled
            wanted.append(render_network_policy(name, namespace, spec, allowed))
        kopf.adopt([deployment, service, *wanted], owner=kopf.Body(owner))
        # Unwanted first: an HPA and a ScaledObject never scale the resource together.
        for (api_version, plural), body in optional.items():
            if body is None:
                await memo.kube.delete(object_path(api_version, plural, namespace, name))
        await memo.kube.apply("apps/v1", "deployments", deployment)
        await memo.kube.apply("v1", "services", service)
        for (api_version, plural), body in optional.items():
            if body is not None:
                await memo.kube.apply(api_version, plural, body)
        if allowed is not None:
            await memo.kube.apply(*NETWORK_POLICY, wanted[-1])
        return model


async def download_size(memo: kopf.Memo, spec: ServiceSpec,
                        status: dict[str, Any]) -> dict[str, Any] | None:
    """``{uri, downloadBytes}`` when the pod's emptyDir cache must be sized, else None:
    from ``status.model`` when this uri was asked before, else from the hub, with no token,
    at the endpoint the admin allows (a thread: the client blocks). A model that needs a
    token is sized in its pod: ``{uri}`` alone, and the emptyDir gets no limit. Raises
    ModelUnavailable with a one-line reason."""
    if not spec.model.needs_download_size:
        return None
    uri = spec.model.uri
    if spec.model.token_secret is not None:
        return {"uri": uri}  # the operator reads no Secret: the pod's fetch sizes it
    known = status.get("model") or {}
    if known.get("uri") == uri and isinstance(known.get("downloadBytes"), int):
        return {"uri": uri, "downloadBytes": known["downloadBytes"]}
    # Torch-free, and imported here so that the operator starts without reading it.
    from kvledger.engine.checkpoint.hub import repo as hub

    try:
        size = await asyncio.to_thread(hub.download_bytes, uri,
                                       endpoint=memo.policy.hub_endpoint(spec))
    except (BadInput, OSError) as exc:
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if "HF_TOKEN" in message:  # the engine's hint, in the resource's words
            message += " (on the cluster: spec.model.tokenSecretRef)"
        raise ModelUnavailable(f"cannot size {uri} from the hub: {message}") from None
    return {"uri": uri, "downloadBytes": size}


async def sync_status(memo: kopf.Memo, namespace: str, name: str, pods_index: kopf.Index,
                      deployments_index: kopf.Index | None = None, *,
                      model: dict[str, Any] | None = None,
                      model_error: str | None = None) -> None:
    """Recompute the resource's status from its pods and its Deployment's status, and patch
    it if it changed.

    ``model``: a download size just had (``status.model``); ``model_error``: why it could
    not be had (``Ready=False/ModelUnavailable``)."""
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
            memo.policy.check(spec, memo.default_image)
        except PolicyDenied as exc:
            spec, spec_error, spec_reason = None, str(exc), "PolicyDenied"
        except BadInput as exc:
            spec_error = str(exc)
        old = obj.get("status") or {}
        pods = [entry["status"] for entry in pods_index.get((namespace, name), [])]
        deployments = list((deployments_index or {}).get((namespace, name), []))
        new = status.compute_status(
            spec=spec, generation=obj.get("metadata", {}).get("generation"), old=old,
            pods=pods, spec_error=spec_error, spec_reason=spec_reason,
            endpoint=render.endpoint(name, namespace,
                                     spec.port if spec else raw.get("port", DEFAULT_PORT)),
            model=model, model_error=model_error,
            replicas=deployments[0].get("replicas", 0) if deployments else 0,
            selector=render.pod_selector(name),
            now=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        if not contains(old, new):
            await memo.kube.patch(path + "/status", {"status": new})
        for kind, reason, message in status.transition_events(
                old.get("conditions") or [], new["conditions"]):
            kopf.event(obj, type=kind, reason=reason, message=message)
