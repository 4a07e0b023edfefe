"""vLLM's own dashboards read kvledger's /metrics: every series each of their PromQL
expressions names (tests/data/vllm_dashboard_queries.txt, from vLLM 0.32's sdist) is
exported, with the type its function needs and the labels it matches and groups by; and
the series added for them (tokens per engine step, a prompt's n and its longest choice)
count what the requests did."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _server_helpers import make_llm, model_name, start_app
from prometheus_client.parser import text_string_to_metric_families

QUERIES = Path(__file__).parents[1] / "data" / "vllm_dashboard_queries.txt"
VLLM_METRICS = Path(__file__).parents[1] / "data" / "vllm_metrics.txt"
# Added by Prometheus from the scrape target (a pod's, a service's), not by the server.
TARGET_LABELS = {"namespace", "service", "pod", "job", "instance"}
_SELECTOR = re.compile(r"(vllm:[\w:]+)\s*(\{[^}]*\})?")
_MATCHER = re.compile(r'(\w+)\s*(?:=~|!~|!=|=)\s*"')
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_RATE = re.compile(r"\b(rate|increase|irate)\s*\($")
PROMPT_IDS = list(range(5, 45))


def queries() -> list[str]:
    return [line for line in QUERIES.read_text().splitlines()
            if line and not line.startswith("#")]


def exposition(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Each sample name's family type, and the label names its samples carry."""
    types, labels = {}, {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            types[sample.name] = family.type
            labels.setdefault(sample.name, set()).update(sample.labels)
    return types, labels


def problems(query: str, types: dict[str, str], labels: dict[str, set[str]]) -> list[str]:
    """What would make ``query`` come up empty or wrong on this exposition."""
    if query.startswith("label_values(") and "vllm:" not in query:
        wanted = query[len("label_values("):-1]
        return [] if any(wanted in names for names in labels.values()) else [query]
    found = []
    grouped = {g.strip() for group in _BY.findall(query) for g in group.split(",")} - {""}
    for match in _SELECTOR.finditer(query):
        name = match.group(1)
        if name not in types:
            found.append(f"{name} is not exported")
            continue
        needed = set(_MATCHER.findall(match.group(2) or "")) | grouped
        if not name.endswith("_bucket"):
            needed.discard("le")
        if missing := needed - TARGET_LABELS - labels[name]:
            found.append(f"{name} lacks {sorted(missing)}")
        if _RATE.search(query[:match.start()]) and types[name] not in ("counter", "histogram"):
            found.append(f"{name} is a {types[name]}, under a rate")
        if "histogram_quantile" in query[:match.start()] and "le" not in labels[name]:
            found.append(f"{name} has no buckets for histogram_quantile")
    return found


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


def test_the_checker_passes_vllms_own_scrape_and_catches_a_gauge_under_a_rate():
    """The reference: every query reads vLLM's own /metrics (its captured scrape); and the
    checker is not blind: a missing series, a label, a rate of a gauge are caught."""
    types, labels = exposition(VLLM_METRICS.read_text())
    assert len(queries()) > 100
    assert {q: problems(q, types, labels) for q in queries()
            if problems(q, types, labels)} == {}
    assert problems("rate(vllm:num_requests_waiting[1m])", types, labels)
    assert problems('sum by (tenant) (vllm:num_requests_waiting{model_name="m"})', types,
                    labels)
    assert problems("histogram_quantile(0.9, rate(vllm:nothing_bucket[1m]))", types, labels)


async def test_every_dashboard_query_reads_kvledger(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    for stream in (False, True):
        response = await client.post("/v1/completions", json={
            "model": model_name(client), "prompt": PROMPT_IDS, "max_tokens": 4,
            "stream": stream})
        assert response.status == 200, await response.text()
        await response.read()
    types, labels = exposition(await (await client.get("/metrics")).text())
    assert {q: problems(q, types, labels) for q in queries()
            if problems(q, types, labels)} == {}


def _value(text: str, sample: str, **labels) -> float:
    [value] = [s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == sample and labels.items() <= s.labels.items()]
    return value


async def test_a_prompts_n_and_longest_choice_and_the_tokens_of_each_step(aiohttp_client,
                                                                        llm):
    """Two prompts of n=2 choices each: two observations of n=2 and of the longest choice
    (its max_tokens, as ignore_eos runs each to it); every token the engine computed or
    generated after the warm-up falls in some step of vllm:iteration_tokens_total."""
    client = await start_app(aiohttp_client, llm)
    before = await (await client.get("/metrics")).text()
    assert _value(before, "vllm:iteration_tokens_total_count") == 0  # the warm-up's not
    prefilled = llm.num_prefill_tokens
    response = await client.post("/v1/completions", json={
        "model": model_name(client), "prompt": [PROMPT_IDS, PROMPT_IDS[:7]], "n": 2,
        "max_tokens": 5, "ignore_eos": True, "temperature": 1, "seed": 1})
    assert response.status == 200, await response.text()
    await response.read()
    text = await (await client.get("/metrics")).text()
    labels = {"model_name": model_name(client), "engine": "0"}
    assert _value(text, "vllm:request_params_n_count", **labels) == 2
    assert _value(text, "vllm:request_params_n_sum", **labels) == 4
    assert _value(text, "vllm:request_params_n_bucket", le="1.0") == 0
    assert _value(text, "vllm:request_max_num_generation_tokens_count", **labels) == 2
    assert _value(text, "vllm:request_max_num_generation_tokens_sum", **labels) == 10
    assert _value(text, "vllm:request_generation_tokens_sum") == 20  # all four choices'
    # The prompt tokens the engine computed (not those the prefix cache held: fewer than
    # the four choices' 94) and the 20 generated, over at least the 5 decode steps.
    computed = llm.num_prefill_tokens - prefilled
    assert 0 < computed <= 2 * (len(PROMPT_IDS) + 7)
    assert _value(text, "vllm:iteration_tokens_total_sum", **labels) == computed + 20
    assert 5 <= _value(text, "vllm:iteration_tokens_total_count", **labels) <= 20
    for name in ("vllm:iteration_tokens_total", "vllm:request_params_n"):  # vLLM's buckets
        assert _buckets(text, name) == _buckets(VLLM_METRICS.read_text(), name), name


def _buckets(text: str, name: str) -> list[str]:
    return [s.labels["le"] for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name + "_bucket"]
