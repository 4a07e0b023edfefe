"""Prometheus metrics of one server, in its own registry (tests run many apps at once).

Ledger gauges are read at scrape time from the ledger itself, so ``/metrics`` can never
disagree with the blocks actually reserved.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Reasons of kvledger_requests_failed_total exported at 0 from the start, so that a rate()
# over them is defined before the first failure: a bug (500), the engine loop failing,
# and one request failing inside a live engine.
FAILURE_REASONS = ("internal_error", "engine_dead", "request_error")


class _LiveGauges:
    """Collects gauges from callables at scrape time."""

    def __init__(self, gauges: dict[str, tuple[str, Callable[[], float]]]) -> None:
        self._gauges = gauges

    def collect(self):
        for name, (help_text, read) in self._gauges.items():
            family = GaugeMetricFamily(name, help_text)
            family.add_metric([], float(read()))
            yield family


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.admitted = Counter("kvledger_requests_admitted", "requests whose KV reservation "
                                "was granted", registry=r)
        self.rejected = Counter("kvledger_requests_rejected", "requests refused, by reason",
                                ["reason"], registry=r)
        self.finished = Counter("kvledger_requests_finished", "admitted requests that ended, "
                                "by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("kvledger_prompt_tokens", "prompt tokens of admitted "
                                     "requests", registry=r)
        self.generation_tokens = Counter("kvledger_generation_tokens", "tokens generated",
                                         registry=r)
        self.latency = Histogram("kvledger_request_latency_seconds", "arrival to last byte of "
                                 "admitted requests", buckets=LATENCY_BUCKETS_S, registry=r)
        self.ttft = Histogram("kvledger_time_to_first_token_seconds", "arrival to first "
                              "generated token", buckets=LATENCY_BUCKETS_S, registry=r)
        self.failed = Counter("kvledger_requests_failed", "5xx answers and errors ending a "
                              "started stream, by reason", ["reason"], registry=r)
        for reason in FAILURE_REASONS:
            self.failed.labels(reason)
        self.queue_wait = Histogram("kvledger_queue_wait_seconds", "time spent waiting for a "
                                    "KV reservation", buckets=LATENCY_BUCKETS_S, registry=r)

    def count_failure(self, reason: str) -> None:
        """Count one request that failed on the server's side (5xx or a stream's error event)."""
        self.failed.labels(reason).inc()

    def watch(self, **gauges: tuple[str, Callable[[], float]]) -> None:
        """Register scrape-time gauges: ``name=(help, read)``."""
        self.registry.register(_LiveGauges(gauges))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
