"""``spec.autoscaling``: what scales a resource and how, parsed with the CRD's defaults
(``parse_autoscaling``); the renderers are ``render/autoscaling.py``'s."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from kvledger.engine.errors import BadInput
from kvledger.operator.api.quantity import target_value
from kvledger.operator.api.resource import (
    AUTOSCALING_METRICS,
    AUTOSCALING_PROVIDERS,
    DEFAULT_HTTP_CONCURRENCY,
    DEFAULT_MIN_REPLICAS,
    DEFAULT_TARGETS,
    DURATION_PATTERN,
    HOST_PATTERN,
    HTTP_COLD_STARTS,
    MAX_HTTP_HOSTS,
)


@dataclass(frozen=True)
class HttpAddOn:
    """``spec.autoscaling.httpAddOn``: KEDA's HTTP add-on fronts the service; its
    interceptor routes requests for ``hosts`` here, and wakes the service from zero. While
    no pod is ready it holds them (``cold_start`` "hold": for ``readiness_timeout``, else
    the add-on's own) or answers 503 with a Retry-After at once ("retryAfter")."""

    hosts: tuple[str, ...]
    concurrency: int = DEFAULT_HTTP_CONCURRENCY
    readiness_timeout: str | None = None
    cold_start: str = HTTP_COLD_STARTS[0]


@dataclass(frozen=True)
class Autoscaling:
    """``spec.autoscaling`` with its defaults; ``target`` is the exact per-pod value."""

    min_replicas: int
    max_replicas: int
    metric: str
    target: Fraction
    provider: str
    server_address: str | None
    http_add_on: HttpAddOn | None = None


def parse_autoscaling(scaling: Mapping[str, Any] | None) -> Autoscaling | None:
    """``spec.autoscaling`` with the CRD's defaults, or None without it. Raises BadInput for
    fields the schema refuses; its cross-field rules are ``spec_rules``'."""
    if scaling is None:
        return None
    metric = scaling.get("metric", AUTOSCALING_METRICS[0])
    provider = scaling.get("provider", AUTOSCALING_PROVIDERS[0])
    if metric not in AUTOSCALING_METRICS or provider not in AUTOSCALING_PROVIDERS:
        raise BadInput(f"autoscaling: unknown metric {metric!r} or provider {provider!r}")
    low, high = scaling.get("minReplicas", DEFAULT_MIN_REPLICAS), scaling.get("maxReplicas")
    if not isinstance(high, int) or high < 1 or not isinstance(low, int) or low < 0:
        raise BadInput("autoscaling.maxReplicas must be at least 1 and minReplicas at least 0")
    add_on = scaling.get("httpAddOn")
    return Autoscaling(min_replicas=low, max_replicas=high, metric=metric,
                       target=target_value(scaling.get("target", DEFAULT_TARGETS[metric])),
                       provider=provider,
                       server_address=(scaling.get("prometheus") or {}).get("serverAddress"),
                       http_add_on=None if add_on is None else _http_add_on(add_on))


def _http_add_on(add_on: Mapping[str, Any]) -> HttpAddOn:
    """``autoscaling.httpAddOn`` checked as the CRD's schema does (BadInput, one line)."""
    hosts = add_on.get("hosts")
    if (not isinstance(hosts, list) or not 1 <= len(hosts) <= MAX_HTTP_HOSTS
            or not all(isinstance(h, str) and len(h) <= 253 and re.match(HOST_PATTERN, h)
                       for h in hosts)):
        raise BadInput(f"autoscaling.httpAddOn.hosts must list 1 to {MAX_HTTP_HOSTS} host "
                       f"names (a leading \"*.\" or \"*\" alone for any), got {hosts!r}")
    concurrency = add_on.get("concurrency", DEFAULT_HTTP_CONCURRENCY)
    timeout = add_on.get("readinessTimeout")
    if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
        raise BadInput(f"autoscaling.httpAddOn.concurrency must be at least 1, got {concurrency!r}")
    if timeout is not None and not (isinstance(timeout, str) and re.match(DURATION_PATTERN, timeout)):
        raise BadInput("autoscaling.httpAddOn.readinessTimeout must be a duration such as "
                       f"\"90s\" or \"5m\", got {timeout!r}")
    cold_start = add_on.get("coldStart", HTTP_COLD_STARTS[0])
    if cold_start not in HTTP_COLD_STARTS:
        raise BadInput(f"autoscaling.httpAddOn.coldStart must be one of "
                       f"{', '.join(HTTP_COLD_STARTS)}, got {cold_start!r}")
    return HttpAddOn(tuple(hosts), concurrency, timeout, cold_start)
