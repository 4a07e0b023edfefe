"""vLLM's request series, under vLLM's names, types, labels and buckets, so the dashboards
and gateways built for ``vllm serve`` read a kvledger server unchanged.

Checked against vLLM 0.32's ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``)
and ``buckets.py``: every series is labelled ``model_name`` and ``engine`` (kvledger runs
one engine, ``"0"``). The values come from the server's own measurement points
(``metrics.RequestTimeline``); the phases map as vLLM defines them: queue = arrival to
admission (kvledger's line for a KV reservation; the engine schedules an admitted request
at its next step), prefill = admission to the first token, decode = first to last token.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"
# vllm/v1/metrics/buckets.py: REQUEST_LATENCY_BUCKETS (e2e, queue, prefill, decode),
# TIME_TO_FIRST_TOKEN_BUCKETS and INTER_TOKEN_LATENCY_BUCKETS (also time per output token).
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                             40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
                                 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# ITERATION_TOKENS_BUCKETS (tokens per engine step) and REQUEST_PARAMS_N_BUCKETS.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# vllm:engine_sleep_state's sleep_state labels (its PrometheusStatLogger.record_sleep_state).
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
# vllm/v1/engine FINISH_REASON_STRINGS, each exported at 0 from the start as vLLM does.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
# kvledger's finish reasons vLLM lacks: a grammar's dead end ends the text as a stop does
# (the answer's finish_reason is "stop" too).
_FINISHED_REASON = {"grammar": "stop"}


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's ``build_1_2_5_buckets(max_model_len)``: 1, 2, 5, 10, 20, 50, ... up to the
    context, the buckets of its per-request token histograms."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class CacheInfo:
    """The labels of ``vllm:cache_config_info``: the fields of vLLM's ``CacheConfig`` that
    have a meaning here, as vLLM writes them (``str()`` of the value)."""

    block_size: int
    cache_dtype: str
    enable_prefix_caching: bool
    gpu_memory_utilization: float | None
    num_gpu_blocks: int
    num_gpu_blocks_override: int | None
    kv_cache_memory_bytes: int | None

    def labels(self) -> dict[str, str]:
        return {**{name: str(value) for name, value in vars(self).items()},
                "engine": ENGINE_INDEX}


class VllmSeries:
    """vLLM's per-request series for one served model, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int,
                 cache: CacheInfo) -> None:
        values = (model_name, ENGINE_INDEX)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets,
                             registry=registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=registry).labels(*values)

        tokens = request_tokens_buckets(max_model_len)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.",
                              TIME_TO_FIRST_TOKEN_BUCKETS_S)
        self.inter_token = histogram("vllm:inter_token_latency_seconds",
                                     "Histogram of inter-token latency in seconds.",
                                     INTER_TOKEN_LATENCY_BUCKETS_S)
        self.time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_LATENCY_BUCKETS_S)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS_S)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               REQUEST_LATENCY_BUCKETS_S)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.",
                                   REQUEST_LATENCY_BUCKETS_S)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.",
                                 REQUEST_LATENCY_BUCKETS_S)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.",
                                REQUEST_LATENCY_BUCKETS_S)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.",
                                                   tokens)
        # Per prompt (vLLM's parent request of its n choices): the most tokens one of its
        # choices generated, and its n.
        self.max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tokens)
        self.params_n = histogram("vllm:request_params_n",
                                  "Histogram of the n request parameter.",
                                  REQUEST_PARAMS_N_BUCKETS)
        # Per engine step that computed tokens: the prompt tokens it computed (not those
        # found in the prefix cache) and the tokens it generated, as vLLM counts them.
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKENS_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        # kvledger never preempts (admission keeps every admitted request able to finish):
        # the counter is vLLM's, and stays 0.
        counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*LABELS, "finished_reason"], registry=registry)
        self.success = {reason: success.labels(*values, reason) for reason in FINISHED_REASONS}
        info = cache.labels()
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              list(info), registry=registry).labels(**info).set(1)
        sleep = Gauge("vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine "
                      "is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 "
                      "means sleep level 1; discard_all = 1 means sleep level 2.",
                      [*LABELS, "sleep_state"], registry=registry)
        self._sleep = {state: sleep.labels(*values, state) for state in SLEEP_STATES}
        self.sleep_state(None)

    def sleep_state(self, level: int | None) -> None:
        """vLLM's three samples for ``level`` (None: awake; 0 pauses, moves nothing)."""
        self._sleep["awake"].set(level is None)
        self._sleep["weights_offloaded"].set(level == 1)
        self._sleep["discard_all"].set(level == 2)

    def finished(self, reasons: list[str], choice_tokens: list[int], n: int) -> None:
        """Count the finished choices of one request by vLLM's ``finished_reason``, and
        observe each of its prompts' ``n`` and its choices' most tokens (``choice_tokens``:
        each choice's, choice ``k`` answering prompt ``k // n``)."""
        for reason in reasons:
            self.success[_FINISHED_REASON.get(reason, reason)].inc()
        for start in range(0, len(choice_tokens), n):
            self.max_num_generation_tokens.observe(max(choice_tokens[start:start + n]))
            self.params_n.observe(n)
