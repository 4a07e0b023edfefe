"""vLLM's request series on kvledger's /metrics: the names, types, label names and buckets
of vLLM 0.32's own /metrics (tests/data/vllm_metrics.txt, scraped from ``vllm serve``), with
values measured from the requests served."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from _server_helpers import make_llm, model_name, start_app
from prometheus_client.parser import text_string_to_metric_families

from kvledger.engine.server.vllm_metrics import request_tokens_buckets

VLLM_METRICS = Path(__file__).parents[1] / "data" / "vllm_metrics.txt"
# Family names as the parser gives them (counters without _total).
REQUEST_SERIES = (
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:num_preemptions",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:engine_sleep_state",
    "vllm:request_max_num_generation_tokens", "vllm:request_params_n",
    "vllm:iteration_tokens_total")
TOKEN_HISTOGRAMS = ("vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                    "vllm:request_max_num_generation_tokens")
PROMPT_IDS, MAX_TOKENS = list(range(5, 45)), 6  # two whole 16-token blocks: cached


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def label_names(family) -> set[str]:
    return {name for s in family.samples for name in s.labels if name != "le"}


def buckets(family) -> list[float]:
    return [float(s.labels["le"]) for s in family.samples
            if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]


def value(family, suffix: str = "", **labels) -> float:
    [sample] = [s for s in family.samples if s.name == family.name + suffix
                and labels.items() <= s.labels.items()]
    return sample.value


@pytest.fixture(scope="module")
def vllm():
    return families(VLLM_METRICS.read_text())


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


async def _scrape_after_requests(client, stream: bool) -> dict:
    for _ in range(2):  # the second finds the first's prompt in the prefix cache
        response = await client.post("/v1/completions", json={
            "model": model_name(client), "prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream})
        assert response.status == 200, await response.text()
        await response.read()
    return families(await (await client.get("/metrics")).text())


def test_the_reference_is_vllms_own_scrape(vllm):
    """The captured scrape is vLLM's: its token buckets are its 1-2-5 series up to the
    512-token context it ran with, and every series kvledger mirrors is in it."""
    assert set(REQUEST_SERIES) <= set(vllm)
    for name in TOKEN_HISTOGRAMS:
        assert buckets(vllm[name]) == request_tokens_buckets(512)


@pytest.mark.parametrize("stream", [False, True])
async def test_vllm_series_match_vllms_types_labels_and_buckets(aiohttp_client, llm, vllm,
                                                                stream):
    client = await start_app(aiohttp_client, llm)
    ours = await _scrape_after_requests(client, stream)
    for name in REQUEST_SERIES:
        assert name in ours, f"{name} is not exported"
        assert ours[name].type == vllm[name].type, name
        assert label_names(ours[name]) == label_names(vllm[name]), name
        if name in TOKEN_HISTOGRAMS:
            assert buckets(ours[name]) == request_tokens_buckets(llm.max_model_len), name
        elif vllm[name].type == "histogram":
            assert buckets(ours[name]) == buckets(vllm[name]), name
    assert {s.labels["finished_reason"] for s in ours["vllm:request_success"].samples} == {
        s.labels["finished_reason"] for s in vllm["vllm:request_success"].samples}
    assert set(ours["vllm:cache_config_info"].samples[0].labels) <= set(
        vllm["vllm:cache_config_info"].samples[0].labels)
    assert ours["vllm:cache_config_info"].samples[0].labels["num_gpu_blocks"] == "32"


@pytest.mark.parametrize("stream", [False, True])
async def test_vllm_series_count_what_the_requests_did(aiohttp_client, llm, stream):
    client = await start_app(aiohttp_client, llm)
    ours = await _scrape_after_requests(client, stream)
    labels = {"model_name": model_name(client), "engine": "0"}
    assert value(ours["vllm:prompt_tokens"], "_total", **labels) == 2 * len(PROMPT_IDS)
    assert value(ours["vllm:generation_tokens"], "_total", **labels) == 2 * MAX_TOKENS
    assert value(ours["vllm:request_success"], "_total", finished_reason="length") == 2
    assert value(ours["vllm:request_success"], "_total", finished_reason="stop") == 0
    assert value(ours["vllm:num_preemptions"], "_total", **labels) == 0
    assert value(ours["vllm:request_prompt_tokens"], "_sum") == 2 * len(PROMPT_IDS)
    assert value(ours["vllm:request_generation_tokens"], "_sum") == 2 * MAX_TOKENS
    assert value(ours["vllm:prefix_cache_queries"], "_total") >= 2 * len(PROMPT_IDS)
    assert value(ours["vllm:prefix_cache_hits"], "_total") > 0
    # Two requests, each observed once; a token after the first is an inter-token gap.
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_time_per_output_token_seconds"):
        assert value(ours[name], "_count") == 2, name
    assert 2 <= value(ours["vllm:inter_token_latency_seconds"], "_count") <= 2 * (MAX_TOKENS - 1)
    e2e = value(ours["vllm:e2e_request_latency_seconds"], "_sum")
    phases = sum(value(ours[f"vllm:request_{p}_time_seconds"], "_sum")
                 for p in ("queue", "prefill", "decode"))
    assert 0 < phases <= e2e
    assert value(ours["vllm:time_to_first_token_seconds"], "_sum") <= e2e
    # The same measurement points feed kvledger's own series.
    assert value(ours["kvledger_time_to_first_token_seconds"], "_count") == 2
    assert value(ours["kvledger_time_to_first_token_seconds"], "_sum") == pytest.approx(
        value(ours["vllm:time_to_first_token_seconds"], "_sum"))


async def test_an_aborted_request_counts_as_abort(aiohttp_client, llm):
    """A client that stops reading ends its request; vLLM counts it under "abort"."""
    client = await start_app(aiohttp_client, llm)
    response = await client.post("/v1/completions", json={
        "model": model_name(client), "prompt": PROMPT_IDS, "max_tokens": 200,
        "temperature": 0, "ignore_eos": True, "stream": True})
    await response.content.readline()
    response.close()
    for _ in range(200):
        ours = families(await (await client.get("/metrics")).text())
        if value(ours["vllm:request_success"], "_total", finished_reason="abort") == 1:
            break
        await asyncio.sleep(0.05)
    assert value(ours["vllm:request_success"], "_total", finished_reason="abort") == 1
    assert value(ours["vllm:e2e_request_latency_seconds"], "_count") == 1


DASHBOARD = Path(__file__).parents[2] / "charts" / "kvledger" / "dashboards" / "kvledger.json"
_SELECTOR = re.compile(r"([a-zA-Z_:][\w:]*)\s*\{")  # a series name before its label matchers


def dashboard_series() -> set[str]:
    """The series every panel's PromQL reads (each written with a ``{...}`` selector)."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert exprs and all(_SELECTOR.search(e) for e in exprs)
    return {name for e in exprs for name in _SELECTOR.findall(e)}


def sample_names(text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


async def test_the_dashboard_reads_only_series_both_servers_export(aiohttp_client, llm):
    """Every series the chart's Grafana dashboard queries is on kvledger's /metrics and on
    vLLM's (its captured scrape), so the dashboard shows either server."""
    client = await start_app(aiohttp_client, llm)
    await _scrape_after_requests(client, stream=False)
    ours = sample_names(await (await client.get("/metrics")).text())
    wanted = dashboard_series()
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:generation_tokens_total",
            "vllm:kv_cache_usage_perc"} <= wanted
    assert wanted <= ours, sorted(wanted - ours)
    assert wanted <= sample_names(VLLM_METRICS.read_text()), sorted(
        wanted - sample_names(VLLM_METRICS.read_text()))
