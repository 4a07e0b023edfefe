"""The operator's own start and end: kopf's settings (annotations for its progress, the
events it posts and who posts them, the admission server), the memo's defaults, the
cluster's credentials (in a pod, else a kubeconfig) and the connection's close."""

from __future__ import annotations

import logging
import socket
from typing import Any

import kopf
import yaml

from kvledger.engine.errors import BadInput
from kvledger.operator.api.resource import GROUP
from kvledger.operator.cluster.hub_models import HubModels
from kvledger.operator.cluster.kube import KubeApi
from kvledger.operator.render import autoscaling, render
from kvledger.operator.render.policy import Policy

REPORTING_COMPONENT = "kvledger-operator"  # as the children's managed-by label


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Progress and diff-base in annotations: the status belongs to kvledger alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    # Only the events we post on purpose, never handler logs.
    settings.posting.loggers = False
    settings.posting.level = logging.INFO
    # `kubectl describe`'s "From" column (the events' source.component): this operator,
    # not the framework; the instance is the operator's pod.
    settings.posting.reporting_component = REPORTING_COMPONENT
    settings.posting.reporting_instance = socket.gethostname() or REPORTING_COMPONENT
    # The CRD is installed before the operator (Helm's crds/), so no runtime CRD scan:
    # that keeps the RBAC to what the handlers use.
    settings.scanning.disabled = True
    if memo.get("webhook_server") is not None:  # kvledger operator --webhook-port
        settings.admission.server = memo.webhook_server
        settings.admission.managed = None  # the chart renders the configuration
    memo.setdefault("default_image", render.DEFAULT_IMAGE)
    memo.setdefault("prometheus_url", autoscaling.DEFAULT_PROMETHEUS_URL)
    memo.setdefault("http_scaler", autoscaling.DEFAULT_HTTP_SCALER)
    memo.setdefault("policy", Policy())
    memo.setdefault("status_locks", {})
    memo.setdefault("apply_locks", {})
    memo.setdefault("kube", KubeApi())
    memo.setdefault("hub_models", HubModels())


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
