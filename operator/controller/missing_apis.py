"""Kinds a spec needs that the cluster may not serve, and what to install for each.

A LeaderWorkerSet (``spec.nodes`` above 1) needs ``leaderworkerset.x-k8s.io/v1``; where it
is not served, nothing is applied or deleted (a Deployment still serves) and
``LeaderWorkerSetMissing`` says what to install; so does ``InferencePoolMissing`` for a
``spec.inferencePool`` on a cluster that does not serve ``inference.networking.k8s.io/v1``,
and ``HttpAddOnMissing`` for an ``autoscaling.httpAddOn`` without KEDA's HTTP add-on
(``ApiMissing``, all three). Each is found from the API server's discovery.
"""

from __future__ import annotations

from kvledger.operator.api.spec import ServiceSpec
from kvledger.operator.cluster.kube import KubeApi
from kvledger.operator.render import autoscaling, gateway
from kvledger.operator.render.render_group import LWS_API_VERSION, LWS_RELEASE

LWS_INSTALL = (f"kubectl apply --server-side -f https://github.com/kubernetes-sigs/lws/"
               f"releases/download/{LWS_RELEASE}/manifests.yaml")


class ApiMissing(Exception):
    """A kind the spec needs that the cluster does not serve: nothing is applied, the
    status says what to install (``Ready=False`` with ``reason``), asked again slowly."""

    reason = "ApiMissing"


class LeaderWorkerSetMissing(ApiMissing):
    """``spec.nodes`` above 1 on a cluster that does not serve LeaderWorkerSet (one line)."""

    reason = "LeaderWorkerSetMissing"


class InferencePoolMissing(ApiMissing):
    """``spec.inferencePool`` on a cluster that does not serve InferencePool (one line)."""

    reason = "InferencePoolMissing"


class HttpAddOnMissing(ApiMissing):
    """``autoscaling.httpAddOn`` on a cluster without KEDA's HTTP add-on (one line)."""

    reason = "KedaHttpAddOnMissing"


async def served(kube: KubeApi, api_version: str) -> bool:
    """Whether the API server serves ``api_version`` (its discovery)."""
    return await kube.get(f"/apis/{api_version}") is not None


async def pool_served(kube: KubeApi) -> bool:
    """Whether the API server serves ``inference.networking.k8s.io/v1`` (its discovery)."""
    return await served(kube, gateway.POOL_API_VERSION)


async def missing_api(kube: KubeApi, spec: ServiceSpec) -> ApiMissing | None:
    """What the spec needs beside LeaderWorkerSet that the cluster does not serve: the
    InferencePool, or KEDA's HTTP add-on."""
    if spec.inference_pool is not None and not await pool_served(kube):
        return InferencePoolMissing(pool_missing())
    scaling = spec.autoscaling
    if (scaling is not None and scaling.http_add_on is not None
            and not await served(kube, autoscaling.HTTP_ADD_ON_API_VERSION)):
        return HttpAddOnMissing(http_add_on_missing())
    return None


def http_add_on_missing() -> str:
    return (f"autoscaling.httpAddOn needs KEDA's HTTP add-on "
            f"({autoscaling.HTTP_ADD_ON_API_VERSION}), which this cluster does not serve: "
            f"install it (helm install http-add-on kedacore/keda-add-ons-http --namespace "
            f"keda, release {autoscaling.HTTP_ADD_ON_RELEASE} or later); the operator applies "
            f"the route within a minute")


def pool_missing() -> str:
    return (f"spec.inferencePool needs the InferencePool CRD ({gateway.POOL_API_VERSION}), "
            f"which this cluster does not serve: install the Gateway API Inference Extension "
            f"(release {gateway.GAIE_RELEASE}: {gateway.GAIE_INSTALL}); the operator applies "
            f"the pool within a minute")


async def lws_served(kube: KubeApi) -> bool:
    """Whether the API server serves ``leaderworkerset.x-k8s.io/v1`` (its discovery)."""
    return await served(kube, LWS_API_VERSION)


def lws_missing(spec: ServiceSpec) -> str:
    return (f"nodes {spec.nodes} needs LeaderWorkerSet ({LWS_API_VERSION}), which this cluster "
            f"does not serve: install it (kubernetes-sigs/lws, release {LWS_RELEASE}: "
            f"{LWS_INSTALL}); the operator applies the group within a minute")
