"""Pure renderers for scaling: the autoscaler and the PodDisruptionBudget a resource owns.

The autoscaler's target is the InferenceService itself, through its ``scale`` subresource:
it writes ``spec.replicas``, and the operator renders the Deployment from that, so the
resource's ``spec.replicas`` stays the one source of the Deployment's count.

- provider ``hpa``: an ``autoscaling/v2`` HorizontalPodAutoscaler with one ``Pods`` metric
  (``AverageValue``), which the custom metrics API serves from Prometheus (a
  prometheus-adapter rule per metric, documented with the chart);
- provider ``keda``: a ``keda.sh/v1alpha1`` ScaledObject with one ``prometheus`` trigger
  whose query sums the metric over the resource's pods (KEDA divides by the pod count).

KEDA's query selects the series by the labels every Kubernetes scrape gives a target,
``namespace`` and ``pod`` (the Deployment's pod names: ``pod_name_pattern``), so it needs
no pod label mapped into Prometheus.

With ``autoscaling.httpAddOn`` (provider keda), KEDA's HTTP add-on fronts the service: an
``http.keda.sh/v1beta1`` InterceptorRoute sends the requests for its hosts to the
resource's Service, and the ScaledObject gains the add-on's ``external-push`` trigger
(its scaler counts the requests the interceptor holds). At zero pods the engines' series
are gone and the Prometheus trigger reads nothing; the add-on's trigger is what wakes the
service, while the interceptor holds the requests that came, or, with ``coldStart:
retryAfter``, answers them at once: a 503 with ``Retry-After`` the last start's seconds,
or before one the pre-flight's predicted read where longer than the default (the route's
placeholder). Such a request is over in microseconds, too soon for the
scaler's concurrency sample, so that route also counts a request rate whose target no load
reaches (``WAKE_RATE_TARGET``): any request in its window makes the trigger active, which
is what wakes the service, and it never asks more replicas than the concurrency does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

from kvledger.operator.api.resource import API_VERSION, DEFAULT_START_S, KIND
from kvledger.operator.api.scaling_spec import Autoscaling
from kvledger.operator.api.spec import ServiceSpec
from kvledger.operator.render.render import labels, selector_labels

# Where KEDA queries Prometheus unless spec.autoscaling.prometheus.serverAddress says:
# the operator's --prometheus-url (env KVLEDGER_PROMETHEUS_URL), by default the Service
# the Prometheus Operator (kube-prometheus-stack) creates in namespace "monitoring".
DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
# The HTTP add-on's external scaler, where its chart installs it (namespace keda); the
# operator's --keda-http-scaler (env KVLEDGER_KEDA_HTTP_SCALER) names another.
DEFAULT_HTTP_SCALER = "keda-add-ons-http-external-scaler.keda:9090"
HTTP_ADD_ON_API_VERSION = "http.keda.sh/v1beta1"
HTTP_ADD_ON_RELEASE = "v0.15.0"
INTERCEPTOR_ROUTES = (HTTP_ADD_ON_API_VERSION, "interceptorroutes")
# coldStart retryAfter: the request rate that only wakes the service (int32's largest: the
# replicas it asks, ceil(rate / target), are 1 at any rate a cluster sees), over a window
# longer than a start, so the trigger stays active until a pod is ready.
WAKE_RATE_TARGET = 2**31 - 1
WAKE_RATE_WINDOW = "5m"
# A node drain evicts one replica at a time: the others keep serving meanwhile.
PDB_MAX_UNAVAILABLE = 1


@dataclass(frozen=True)
class Metric:
    """How one spec.autoscaling.metric is read: the name an HPA asks the custom metrics
    API for, and the engine's series (with a label matcher, and as a per-second rate for a
    counter) that KEDA's query sums."""

    pods_metric: str
    series: str
    matcher: str = ""
    rate_window: str | None = None


METRICS = {
    # Gauge, 0..1: the share of the KV pool promised to admitted requests.
    "kvReservedRatio": Metric("kvledger_kv_reserved_ratio", "kvledger_kv_reserved_ratio"),
    # Gauge: requests in line for a reservation (--max-queue-len).
    "requestsWaiting": Metric("kvledger_requests_waiting", "kvledger_requests_waiting"),
    # Counter of the 429s more replicas would answer (the KV cache or the line full; not a
    # tenant's own cap), as a rate; the adapter rule names it so.
    "rejectionRate": Metric("kvledger_kv_cache_full_per_second",
                            "kvledger_requests_rejected_total",
                            'reason=~"kv_cache_full|queue_full"', "1m"),
}
# Kubernetes names a Deployment's pod NAME-HASH-SUFFIX: HASH is the pod template's hash
# (its decimal digits, 1 to 10, spelled in letters and digits), SUFFIX 5 random characters,
# and "NAME-HASH-" is cut to 58 characters first. Up to 46 characters, a name keeps both
# parts whole.
_WHOLE_POD_NAMES_UP_TO = 46
_POD_NAME_MAX = 63


def scale_target_ref(name: str) -> dict[str, str]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": name}


def pod_name_pattern(name: str, nodes: int = 1) -> str:
    """A PromQL regex (anchored) for the names of the pods that serve HTTP. With ``nodes``
    above 1, the LeaderWorkerSet's leaders: ``NAME-GROUP`` (its workers, ``NAME-GROUP-N``,
    export nothing). Else the Deployment's pods:
    ``NAME-[a-z0-9]{1,10}-[a-z0-9]{5}``. Neither part has a '-', so the pods of another
    resource named ``NAME-x`` do not match (its pods' names have one '-' more, or, cut to
    58 characters, a last part longer than 5). Past 46 characters the hash is cut, and
    the pattern is the 58-character prefix and what may follow it. A name is a DNS-1035
    label: it needs no regex escaping (and PromQL's strings would refuse ``\\-``)."""
    if nodes > 1:
        return f"{name}-[0-9]+"
    if len(name) <= _WHOLE_POD_NAMES_UP_TO:
        return f"{name}-[a-z0-9]{{1,10}}-[a-z0-9]{{5}}"
    prefix = (name + "-")[:58]
    return f"{prefix}[-a-z0-9]{{5,{_POD_NAME_MAX - len(prefix)}}}"


def promql(name: str, namespace: str, metric: str, nodes: int = 1) -> str:
    """The sum over the resource's serving pods of the metric (KEDA's query)."""
    read = METRICS[metric]
    matchers = f'namespace="{namespace}",pod=~"{pod_name_pattern(name, nodes)}"'
    if read.matcher:
        matchers += f",{read.matcher}"
    series = f"{read.series}{{{matchers}}}"
    return f"sum(rate({series}[{read.rate_window}]))" if read.rate_window else f"sum({series})"


def quantity(value: Fraction) -> str:
    """``value`` as the API server writes a decimal quantity back (``800m``, ``4``, ``1k``),
    so that what is applied compares equal to what is stored."""
    for exponent, suffix in ((9, "G"), (6, "M"), (3, "k"), (0, ""), (-3, "m"), (-6, "u")):
        mantissa = value / Fraction(10) ** exponent
        if mantissa.denominator == 1:
            return f"{mantissa.numerator}{suffix}"
    return f"{-(-value * 10**9 // 1)}n"  # rounded up to a nano, as the API server does


def decimal(value: Fraction) -> str:
    """``value`` as a plain decimal (``0.8``): KEDA reads its threshold as a float."""
    text = format(Decimal(value.numerator) / Decimal(value.denominator), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _meta(name: str, namespace: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels(name)}


def render_hpa(name: str, namespace: str, settings: Autoscaling) -> dict[str, Any]:
    """The HorizontalPodAutoscaler (provider hpa) of the resource's scale subresource."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(name, namespace),
        "spec": {
            "scaleTargetRef": scale_target_ref(name),
            "minReplicas": settings.min_replicas,
            "maxReplicas": settings.max_replicas,
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": METRICS[settings.metric].pods_metric},
                "target": {"type": "AverageValue", "averageValue": quantity(settings.target)},
            }}],
        },
    }


def render_scaled_object(name: str, namespace: str, settings: Autoscaling, *,
                         prometheus_url: str = DEFAULT_PROMETHEUS_URL,
                         nodes: int = 1, http_scaler: str = DEFAULT_HTTP_SCALER,
                         ) -> dict[str, Any]:
    """The KEDA ScaledObject (provider keda) of the resource's scale subresource, with the
    HTTP add-on's trigger (at ``http_scaler``) when the add-on fronts the service.

    ``prometheus_url`` is the operator's default; ``serverAddress`` in the spec wins."""
    scaled = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _meta(name, namespace),
        "spec": {
            "scaleTargetRef": scale_target_ref(name),
            "minReplicaCount": settings.min_replicas,
            "maxReplicaCount": settings.max_replicas,
            "triggers": [{
                "type": "prometheus",
                # The query sums over the pods: the HPA KEDA makes divides by their count.
                "metricType": "AverageValue",
                "metadata": {
                    "serverAddress": settings.server_address or prometheus_url,
                    "query": promql(name, namespace, settings.metric, nodes),
                    "threshold": decimal(settings.target),
                },
            }],
        },
    }
    if settings.http_add_on is not None:
        scaled["spec"]["triggers"].append({
            "type": "external-push",
            "metadata": {"scalerAddress": http_scaler, "interceptorRoute": name},
        })
    return scaled


def render_interceptor_route(name: str, namespace: str, settings: Autoscaling, port: int,
                             start_seconds: int | None = None) -> dict[str, Any]:
    """The HTTP add-on's route to the resource's Service (``autoscaling.httpAddOn``): the
    requests for its hosts, counted for its trigger, held while no pod is ready; with
    ``coldStart: retryAfter`` answered then at once (``cold_start_answer``), with
    ``Retry-After`` of ``start_seconds`` (the last start measured, else the pre-flight's
    predicted read where longer than the default: ``children.cold_start_seconds``; None:
    neither)."""
    add_on = settings.http_add_on
    assert add_on is not None
    metric: dict[str, Any] = {"concurrency": {"targetValue": add_on.concurrency}}
    route: dict[str, Any] = {
        "apiVersion": HTTP_ADD_ON_API_VERSION,
        "kind": "InterceptorRoute",
        "metadata": _meta(name, namespace),
        "spec": {
            "target": {"service": name, "port": port},
            "rules": [{"hosts": list(add_on.hosts)}],
            "scalingMetric": metric,
        },
    }
    if add_on.readiness_timeout is not None:
        route["spec"]["timeouts"] = {"readiness": add_on.readiness_timeout}
    if add_on.cold_start == "retryAfter":
        metric["requestRate"] = {"targetValue": WAKE_RATE_TARGET, "window": WAKE_RATE_WINDOW}
        route["spec"]["coldStart"] = {"placeholder": {
            "response": cold_start_answer(name, start_seconds)}}
    return route


def cold_start_answer(name: str, start_seconds: int | None) -> dict[str, Any]:
    """The interceptor's answer while no pod is ready: 503, ``Retry-After`` the start's
    whole seconds (``DEFAULT_START_S`` until one is measured or predicted longer), and the
    error in the shape the engine's own 503s have (OpenAI's)."""
    seconds = start_seconds if start_seconds is not None and start_seconds > 0 \
        else DEFAULT_START_S
    message = f"{name} is starting from zero replicas: retry in {seconds} s"
    body = {"error": {"message": message, "type": "service_unavailable",
                      "code": "scaled_to_zero", "param": None}}
    return {"statusCode": 503,
            "headers": {"Retry-After": str(seconds), "Content-Type": "application/json"},
            "body": json.dumps(body, separators=(",", ":"))}


def pdb_wanted(spec: ServiceSpec) -> bool:
    """A PodDisruptionBudget is owned while the resource can have more than one pod."""
    settings = spec.autoscaling
    return max(spec.replicas, settings.max_replicas if settings else 0) > 1


def render_pdb(name: str, namespace: str) -> dict[str, Any]:
    """At most one pod evicted at a time (a node drain waits for the next); a pod that is
    not ready serves nothing, so it may always go (a crash-looping pod never blocks)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(name, namespace),
        "spec": {
            "maxUnavailable": PDB_MAX_UNAVAILABLE,
            "selector": {"matchLabels": selector_labels(name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


# (apiVersion, plural) of every child this module renders, in the order they are removed.
OPTIONAL_CHILDREN = (("autoscaling/v2", "horizontalpodautoscalers"),
                     ("keda.sh/v1alpha1", "scaledobjects"),
                     INTERCEPTOR_ROUTES,
                     ("policy/v1", "poddisruptionbudgets"))


def render_scaling(name: str, namespace: str, spec: ServiceSpec, *,
                   prometheus_url: str = DEFAULT_PROMETHEUS_URL,
                   http_scaler: str = DEFAULT_HTTP_SCALER, start_seconds: int | None = None,
                   ) -> dict[tuple[str, str], dict[str, Any] | None]:
    """Each optional child (``OPTIONAL_CHILDREN``) -> its body, or None where the spec
    wants none (the caller deletes it). ``start_seconds``: a cold start's Retry-After (the
    last start measured, ``status.startup.seconds.total``, else the predicted read)."""
    settings = spec.autoscaling
    hpa = scaled = route = None
    if settings is not None and settings.provider == "hpa":
        hpa = render_hpa(name, namespace, settings)
    elif settings is not None:
        scaled = render_scaled_object(name, namespace, settings, prometheus_url=prometheus_url,
                                      nodes=spec.nodes, http_scaler=http_scaler)
        if settings.http_add_on is not None:
            route = render_interceptor_route(name, namespace, settings, spec.serve.port,
                                             start_seconds)
    pdb = render_pdb(name, namespace) if pdb_wanted(spec) else None
    return dict(zip(OPTIONAL_CHILDREN, (hpa, scaled, route, pdb), strict=True))
