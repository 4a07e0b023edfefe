"""Prometheus metrics of one server, in its own registry (tests run many apps at once).

Ledger gauges are read at scrape time from the ledger itself, so ``/metrics`` can never
disagree with the blocks actually reserved.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Reasons of kvledger_requests_failed_total exported at 0 from the start, so that a rate()
# over them is defined before the first failure: a bug (500), the engine loop failing,
# and one request failing inside a live engine.
FAILURE_REASONS = ("internal_error", "engine_dead", "request_error")
# Reasons of kvledger_requests_rejected_total exported at 0 from the start, for the same
# reason: an autoscaler's rate() of the 429s (kv_cache_full) must read 0, not nothing,
# before the first one.
REJECTION_REASONS = ("kv_cache_full", "prompt_too_long", "over_context", "over_pool",
                     "bad_request", "unknown_model", "unauthorized", "body_too_large",
                     "body_timeout", "not_ready", "shutting_down", "engine_dead")
# vLLM's names for the gauges an endpoint picker reads (the Gateway API Inference
# Extension's model server protocol), so one routes to kvledger with no configuration.
# KV usage is the reserved ratio: what kvledger has promised, which is what decides
# whether the next request is admitted. gpu_cache_usage_perc is the older name.
VLLM_ALIASES = {
    "vllm:num_requests_waiting": "kvledger_requests_waiting",
    "vllm:num_requests_running": "kvledger_requests_running",
    "vllm:kv_cache_usage_perc": "kvledger_kv_reserved_ratio",
    "vllm:gpu_cache_usage_perc": "kvledger_kv_reserved_ratio",
}


Reads = dict[str, tuple[str, Callable[[], float]]]  # name -> (help, read)


class _LiveGauges:
    """Collects gauges and counters from callables at scrape time, and the gauges'
    vLLM-named aliases (labelled ``model_name``, as vLLM labels them) once a model is
    served."""

    def __init__(self, gauges: Reads, counters: Reads,
                 model_name: Callable[[], str | None]) -> None:
        self._gauges = gauges
        self._counters = counters
        self._model_name = model_name

    def collect(self):
        for name, (help_text, read) in self._counters.items():
            counter = CounterMetricFamily(name, help_text)
            counter.add_metric([], float(read()))
            yield counter
        values = {name: float(read()) for name, (_, read) in self._gauges.items()}
        for name, (help_text, _) in self._gauges.items():
            family = GaugeMetricFamily(name, help_text)
            family.add_metric([], values[name])
            yield family
        model = self._model_name()
        if model is None:
            return
        for alias, name in VLLM_ALIASES.items():
            if name in values:  # read once above: an alias never disagrees with its source
                family = GaugeMetricFamily(alias, f"{name}, under vLLM's name",
                                           labels=["model_name"])
                family.add_metric([model], values[name])
                yield family


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.admitted = Counter("kvledger_requests_admitted", "requests whose KV reservation "
                                "was granted", registry=r)
        self.rejected = Counter("kvledger_requests_rejected", "requests refused, by reason",
                                ["reason"], registry=r)
        for reason in REJECTION_REASONS:
            self.rejected.labels(reason)
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

    def watch(self, gauges: Reads, *, counters: Reads | None = None,
              model_name: Callable[[], str | None]) -> None:
        """Register scrape-time gauges and counters (a counter's name without ``_total``),
        ``{name: (help, read)}``; the gauges in ``VLLM_ALIASES`` are also exported under
        vLLM's names while ``model_name()`` is not None."""
        self.registry.register(_LiveGauges(gauges, counters or {}, model_name))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
