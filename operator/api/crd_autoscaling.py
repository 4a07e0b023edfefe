"""The schema of an InferenceService's ``spec.autoscaling`` (OpenAPI v3, as the CRD writes
it): the metric and its target, the HPA or KEDA, KEDA's Prometheus and its HTTP add-on
(the hosts it routes, its concurrency, what it does while no pod is ready).
"""

from __future__ import annotations

from kvledger.operator.api.quantity import TARGET_PATTERN
from kvledger.operator.api.resource import (
    AUTOSCALING_METRICS,
    AUTOSCALING_PROVIDERS,
    DEFAULT_HTTP_CONCURRENCY,
    DEFAULT_MIN_REPLICAS,
    DURATION_PATTERN,
    HOST_PATTERN,
    HTTP_COLD_STARTS,
    MAX_HTTP_HOSTS,
)
from kvledger.operator.api.setting_schema import INT_OR_STRING, integer
from kvledger.operator.api.spec_rules import ruled

AUTOSCALING = ruled({
    "type": "object",
    "description": "Scale spec.replicas on a per-pod metric: the operator owns an HPA (provider "
                   "hpa) or a KEDA ScaledObject (provider keda) whose target is this resource's "
                   "scale subresource.",
    "required": ["maxReplicas"],
    "properties": {
        "minReplicas": integer(0, "fewest pods (0 only with provider keda)",
                            default=DEFAULT_MIN_REPLICAS),
        "maxReplicas": integer(1, "most pods"),
        "metric": {"type": "string", "enum": list(AUTOSCALING_METRICS),
                   "default": AUTOSCALING_METRICS[0],
                   "description": "kvReservedRatio (share of KV blocks reserved, 0..1), "
                                  "requestsWaiting (requests queued for a reservation) or "
                                  "rejectionRate (429s for a full KV cache per second)"},
        "target": {
            "x-kubernetes-int-or-string": True, "anyOf": INT_OR_STRING,
            "minimum": 1, "pattern": TARGET_PATTERN, "maxLength": 32,
            "description": "per-pod average of the metric to hold, a quantity (4, \"0.8\", "
                           "\"800m\"); default 0.8 for kvReservedRatio, 4 for "
                           "requestsWaiting, 1 for rejectionRate. Write a decimal as a "
                           "string (target: \"0.8\"): the field is an integer or a string, "
                           "and the API server refuses an unquoted 0.8 as neither",
        },
        "provider": {"type": "string", "enum": list(AUTOSCALING_PROVIDERS),
                     "default": AUTOSCALING_PROVIDERS[0]},
        "prometheus": {
            "type": "object",
            "description": "provider keda: where KEDA queries the metric (default: the "
                           "operator's --prometheus-url)",
            "properties": {"serverAddress": {"type": "string", "pattern": r"^https?://\S+$",
                                             "maxLength": 2048}},
        },
        "httpAddOn": {
            "type": "object", "required": ["hosts"],
            "description": "provider keda: KEDA's HTTP add-on fronts the service. The "
                           "operator renders an InterceptorRoute (http.keda.sh/v1beta1) to "
                           "its Service and adds the add-on's external-push trigger to the "
                           "ScaledObject: the interceptor holds requests while no pod is "
                           "ready and wakes the service from zero. Needs the add-on installed",
            "properties": {
                "hosts": {"type": "array", "minItems": 1, "maxItems": MAX_HTTP_HOSTS,
                          "description": "the Host headers the interceptor routes here: "
                                         "the Service's own cluster names (NAME.NAMESPACE"
                                         "[.svc[.cluster.local]]), others as the admin's "
                                         "policy.httpAddOnHosts allows",
                          "items": {"type": "string", "maxLength": 253,
                                    "pattern": HOST_PATTERN}},
                "concurrency": integer(1, "in-flight requests a pod, the add-on's metric's "
                                       "target (with the spec's own metric: the higher "
                                       "count wins)",
                                    default=DEFAULT_HTTP_CONCURRENCY),
                "readinessTimeout": {"type": "string", "pattern": DURATION_PATTERN,
                                     "maxLength": 32,
                                     "description": "how long the interceptor holds a "
                                                    "request while no pod is ready (\"5m\"; "
                                                    "default: the add-on's)"},
                "coldStart": {"type": "string", "enum": list(HTTP_COLD_STARTS),
                              "default": HTTP_COLD_STARTS[0],
                              "description": "while no pod is ready: hold (the interceptor "
                                             "holds each request until one is) or "
                                             "retryAfter (it answers 503 at once, Retry-After "
                                             "the last start's seconds, and the service "
                                             "wakes all the same)"},
            },
        },
    },
}, "autoscaling")
