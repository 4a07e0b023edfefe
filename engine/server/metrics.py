"""Prometheus metrics of one server, in its own registry (tests run many apps at once).

Ledger gauges are read at scrape time from the ledger itself, so ``/metrics`` can never
disagree with the blocks actually reserved.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvledger.engine.server.vllm_metrics import ENGINE_INDEX, LABELS, CacheInfo, VllmSeries

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Reasons of kvledger_requests_failed_total exported at 0 from the start, so that a rate()
# over them is defined before the first failure: a bug (500), the engine loop failing,
# and one request failing inside a live engine.
FAILURE_REASONS = ("internal_error", "engine_dead", "request_error")
# Reasons of kvledger_requests_rejected_total exported at 0 from the start, for the same
# reason: an autoscaler's rate() of the 429s (kv_cache_full, queue_full) must read 0, not
# nothing, before the first one.
REJECTION_REASONS = ("kv_cache_full", "queue_full", "tenant_queue_full", "prompt_too_long",
                     "over_context", "over_pool", "bad_request", "unknown_model",
                     "unauthorized", "body_too_large", "body_timeout", "not_ready",
                     "shutting_down", "engine_dead")
# vLLM's names for the gauges an endpoint picker reads (the Gateway API Inference
# Extension's model server protocol), so one routes to kvledger with no configuration.
# KV usage is the reserved ratio: what kvledger has promised, which is what decides
# whether the next request is admitted. gpu_cache_usage_perc is the older name.
# Counters' names are without ``_total``, as prometheus_client takes them.
VLLM_ALIASES = {
    "vllm:num_requests_waiting": "kvledger_requests_waiting",
    "vllm:num_requests_running": "kvledger_requests_running",
    "vllm:kv_cache_usage_perc": "kvledger_kv_reserved_ratio",
    "vllm:gpu_cache_usage_perc": "kvledger_kv_reserved_ratio",
    "vllm:prefix_cache_queries": "kvledger_prefix_cache_queries",
    "vllm:prefix_cache_hits": "kvledger_prefix_cache_hits",
}


Reads = dict[str, tuple[str, Callable[[], float]]]  # name -> (help, read)


class _LiveGauges:
    """Collects gauges and counters from callables at scrape time, and their vLLM-named
    aliases (labelled ``model_name`` and ``engine``, as vLLM labels them) once a model is
    served."""

    def __init__(self, gauges: Reads, counters: Reads,
                 model_name: Callable[[], str | None]) -> None:
        self._gauges = gauges
        self._counters = counters
        self._model_name = model_name

    def collect(self):
        # Each read once: an alias never disagrees with its source.
        counts = {name: float(read()) for name, (_, read) in self._counters.items()}
        values = {name: float(read()) for name, (_, read) in self._gauges.items()}
        for name, (help_text, _) in self._counters.items():
            counter = CounterMetricFamily(name, help_text)
            counter.add_metric([], counts[name])
            yield counter
        for name, (help_text, _) in self._gauges.items():
            family = GaugeMetricFamily(name, help_text)
            family.add_metric([], values[name])
            yield family
        model = self._model_name()
        if model is None:
            return
        for alias, name in VLLM_ALIASES.items():
            kind = CounterMetricFamily if name in counts else GaugeMetricFamily
            if name in counts or name in values:
                family = kind(alias, f"{name}, under vLLM's name", labels=list(LABELS))
                family.add_metric([model, ENGINE_INDEX], counts.get(name, values.get(name)))
                yield family


# A request's 429s, counted per tenant too (kvledger_tenant_requests_rejected_total).
TENANT_REJECTION_REASONS = ("kv_cache_full", "queue_full", "tenant_queue_full")


class _TenantsWaiting:
    """Requests in line by tenant, read from the line at scrape time."""

    def __init__(self, labels: list[str], waiting: Callable[[], dict[str, int]]) -> None:
        self._labels = labels
        self._waiting = waiting

    def collect(self):
        counts = self._waiting()
        family = GaugeMetricFamily("kvledger_tenant_requests_waiting", "requests in line for "
                                   "a KV reservation, by tenant", labels=["tenant"])
        for label in dict.fromkeys([*self._labels, *counts]):
            family.add_metric([label], counts.get(label, 0))
        yield family


class ServerMetrics:
    def __init__(self, tenants: Sequence[str] = ("anonymous",)) -> None:
        """``tenants``: every label the per-tenant series may carry (``Tenants.labels``:
        bounded by the configuration, never a key), exported at 0 from the start."""
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
        # Per tenant (server/tenants.py): its admissions, 429s, queue waits and tokens.
        self.tenant_admitted = Counter("kvledger_tenant_requests_admitted", "requests "
                                       "admitted, by tenant", ["tenant"], registry=r)
        self.tenant_rejected = Counter("kvledger_tenant_requests_rejected", "429s, by tenant "
                                       "and reason", ["tenant", "reason"], registry=r)
        self.tenant_queue_wait = Histogram("kvledger_tenant_queue_wait_seconds", "time spent "
                                           "waiting for a KV reservation, by tenant",
                                           ["tenant"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.tenant_generation_tokens = Counter("kvledger_tenant_generation_tokens", "tokens "
                                                "generated, by tenant", ["tenant"], registry=r)
        for tenant in tenants:
            self.tenant_admitted.labels(tenant)
            self.tenant_queue_wait.labels(tenant)
            self.tenant_generation_tokens.labels(tenant)
            for reason in TENANT_REJECTION_REASONS:
                self.tenant_rejected.labels(tenant, reason)
        self.vllm: VllmSeries | None = None  # once a model is served

    def sleep_state(self, level: int | None) -> None:
        """``vllm:engine_sleep_state`` for sleep ``level`` (None: awake)."""
        if self.vllm is not None:
            self.vllm.sleep_state(level)

    def serve_model(self, model_name: str, max_model_len: int, cache: CacheInfo) -> None:
        """Export vLLM's request series for the model now served (once: one model a server)."""
        if self.vllm is None:
            self.vllm = VllmSeries(self.registry, model_name, max_model_len, cache)

    def timeline(self, arrived: float) -> RequestTimeline:
        """The measurement points of one request that arrived at ``arrived`` (monotonic)."""
        return RequestTimeline(self, arrived)

    def count_tenant_rejection(self, tenant: str, reason: str) -> None:
        """One 429 of ``tenant``'s (``reason``: one of ``TENANT_REJECTION_REASONS``)."""
        self.tenant_rejected.labels(tenant, reason).inc()

    def count_failure(self, reason: str) -> None:
        """Count one request that failed on the server's side (5xx or a stream's error event)."""
        self.failed.labels(reason).inc()

    def watch(self, gauges: Reads, *, counters: Reads | None = None,
              model_name: Callable[[], str | None]) -> None:
        """Register scrape-time gauges and counters (a counter's name without ``_total``),
        ``{name: (help, read)}``; the gauges in ``VLLM_ALIASES`` are also exported under
        vLLM's names while ``model_name()`` is not None."""
        self.registry.register(_LiveGauges(gauges, counters or {}, model_name))

    def watch_tenants(self, labels: Sequence[str], waiting: Callable[[], dict[str, int]]) -> None:
        """Export ``kvledger_tenant_requests_waiting{tenant}`` at scrape time: ``waiting()``
        by label, 0 for each of ``labels`` not in it."""
        self.registry.register(_TenantsWaiting(list(labels), waiting))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimeline:
    """One request's timings, taken once each and observed into both kvledger's series and
    vLLM's: arrival, admission (its KV reservation granted), each output that carried new
    tokens, and the end."""

    def __init__(self, metrics: ServerMetrics, arrived: float) -> None:
        self._metrics = metrics
        self._vllm = metrics.vllm
        self.arrived = arrived
        self.admitted_at: float | None = None
        self.tenant = "anonymous"  # its tenant's label, once known (server/tenants.py)
        self.first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._tokens = 0

    def admitted(self, prompt_tokens: int) -> None:
        self.admitted_at = now = time.monotonic()
        self._metrics.admitted.inc()
        self._metrics.queue_wait.observe(now - self.arrived)
        self._metrics.tenant_admitted.labels(self.tenant).inc()
        self._metrics.tenant_queue_wait.labels(self.tenant).observe(now - self.arrived)
        self._metrics.prompt_tokens.inc(prompt_tokens)
        if self._vllm is not None:
            self._vllm.queue.observe(now - self.arrived)
            self._vllm.prompt_tokens.inc(prompt_tokens)
            self._vllm.request_prompt_tokens.observe(prompt_tokens)

    def generated(self, tokens: int) -> None:
        """The request's choices hold ``tokens`` generated tokens in all, as of now."""
        if tokens <= self._tokens:
            return
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
            self._metrics.ttft.observe(now - self.arrived)
            if self._vllm is not None:
                self._vllm.ttft.observe(now - self.arrived)
        elif self._vllm is not None:
            self._vllm.inter_token.observe(now - self._last_token_at)
        self._last_token_at, self._tokens = now, tokens

    def finished(self, reasons: list[str], choice_tokens: list[int], n: int) -> None:
        """The end of an admitted request: its choices' finish reasons ("abort" for one cut
        short) and the tokens each generated (choice ``k`` answers prompt ``k // n``)."""
        now = time.monotonic()
        generated_tokens = sum(choice_tokens)
        for reason in reasons:
            self._metrics.finished.labels(reason).inc()
        self._metrics.generation_tokens.inc(generated_tokens)
        self._metrics.tenant_generation_tokens.labels(self.tenant).inc(generated_tokens)
        self._metrics.latency.observe(now - self.arrived)
        vllm = self._vllm
        if vllm is None:
            return
        vllm.finished(reasons, choice_tokens, n)
        vllm.generation_tokens.inc(generated_tokens)
        vllm.request_generation_tokens.observe(generated_tokens)
        vllm.e2e.observe(now - self.arrived)
        if self.first_token_at is None or self.admitted_at is None:
            return  # no token came: vLLM's phases after the queue are undefined
        last = self._last_token_at
        vllm.prefill.observe(self.first_token_at - self.admitted_at)
        vllm.decode.observe(last - self.first_token_at)
        vllm.inference.observe(last - self.admitted_at)
        vllm.time_per_output_token.observe(
            (last - self.first_token_at) / (generated_tokens - 1) if generated_tokens > 1 else 0)
