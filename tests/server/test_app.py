"""The HTTP surface on a real tiny engine, through aiohttp's test client."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from _server_helpers import fill_pool, make_llm, metric, model_name, start_app, wait_for_metric

from kvledger.engine.server.app import build_app
from kvledger.engine.server.state import STATE
from kvledger.engine.settings.config_flags import add_engine_flags, config_from_args


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def reserving_llm(tiny_llama_dir):
    """--admission reserve: free (unpromised) blocks decide admission."""
    return make_llm(tiny_llama_dir, admission="reserve")


def _sse_events(raw: str) -> list:
    events = [line[len("data: "):] for line in raw.split("\n\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


async def test_completion_json_shape_usage_and_greedy_determinism(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    body = {"model": model_name(client), "prompt": "Once upon a time", "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    first = await (await client.post("/v1/completions", json=body)).json()
    second = await (await client.post("/v1/completions", json=body)).json()
    assert first["object"] == "text_completion" and first["id"].startswith("cmpl-")
    choice = first["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    usage = first["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12
    assert second["choices"][0]["text"] == choice["text"]


async def test_chat_and_stop_and_seed(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    body = {"model": model_name(client), "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 8, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    a = await (await client.post("/v1/chat/completions", json=body)).json()
    b = await (await client.post("/v1/chat/completions", json=body)).json()
    assert a["object"] == "chat.completion"
    assert a["choices"][0]["message"]["role"] == "assistant"
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["usage"]["completion_tokens"] == 8


async def test_streaming_completion_and_chat_end_with_usage_and_done(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    name = model_name(client)
    whole = await (await client.post("/v1/completions", json={
        "model": name, "prompt": "The cat", "max_tokens": 10, "temperature": 0,
        "ignore_eos": True})).json()
    response = await client.post("/v1/completions", json={
        "model": name, "prompt": "The cat", "max_tokens": 10, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = _sse_events(await response.text())
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert events[-2]["choices"] == [] and usage["completion_tokens"] == 10
    chunks = events[:-2]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]

    response = await client.post("/v1/chat/completions", json={
        "model": name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
        "stream": True, "ignore_eos": True})
    events = _sse_events(await response.text())
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])


@pytest.mark.parametrize("path, body, status, code", [
    ("/v1/completions", b"{not json", 400, "invalid_json"),
    ("/v1/completions", b'{"model": "MODEL", "prompt": "a\\ud800b"}', 400, "invalid_json"),
    ("/v1/chat/completions", b'{"model": "MODEL", "messages": [{"role": "user", '
     b'"content": "\\udfff"}]}', 400, "invalid_json"),
    ("/v1/completions", b'{"model": "MODEL", "prompt": "\\ud83e\\udd99", "max_tokens": 1}',
     200, None),
    ("/v1/completions", b'{"model": "MODEL"}', 400, "invalid_request"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 1}', 200, None),  # no model: the base
    ("/v1/completions", b'{"model": "MODEL", "prompt": "x", "max_tokens": -4}', 400,
     "invalid_request"),
    ("/v1/completions", b'{"model": "MODEL", "prompt": "x", "max_tokens": 1.5}', 400,
     "invalid_request"),
    ("/v1/completions", b'{"model": "MODEL", "prompt": "x", "n": 0}', 400, "invalid_request"),
    ("/v1/completions", b'{"model": "MODEL", "prompt": "x", "logit_bias": {"99999": 1}}', 400,
     "invalid_request"),
    ("/v1/completions", b'{"model": "MODEL", "prompt": [99999]}', 400, "invalid_request"),
    ("/v1/completions", b'{"model": "other", "prompt": "x"}', 404, "model_not_found"),
    ("/v1/chat/completions", b'{"model": "MODEL", "messages": "hi"}', 400, "invalid_request"),
    ("/v1/completions", b'{"model": "MODEL", "prompt": [5, 6], "max_tokens": 255}', 400,
     "context_length_exceeded"),
    ("/v1/completions", b'{"model": "MODEL", "prompt": [5], "max_tokens": 255}', 200, None),
])
async def test_bad_input_gets_openai_error_bodies(aiohttp_client, llm, path, body, status, code):
    client = await start_app(aiohttp_client, llm)
    body = body.replace(b"MODEL", model_name(client).encode())
    response = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    assert response.status == status
    payload = await response.json()
    if code is not None:
        assert set(payload["error"]) >= {"message", "type", "code"}
        assert payload["error"]["code"] == code
    assert await wait_for_metric(client, "kvledger_kv_blocks_reserved", 0) == 0
    if status >= 400:  # refused before admission: never counted as admitted
        assert await metric(client, "kvledger_requests_admitted_total") == 0


async def test_prompt_at_the_context_is_400_and_body_over_the_limit_is_413(aiohttp_client, llm):
    """A prompt that fills the context is vLLM's and OpenAI's 400 (the SDKs' BadRequestError);
    a body over --max-body-bytes stays a 413."""
    client = await start_app(aiohttp_client, llm, max_body_bytes=2048)
    response = await client.post("/v1/completions", json={"model": model_name(client),
                                                          "prompt": [5] * 256})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert error["message"].startswith("This model's maximum context length is 256 tokens. "
                                       "However, your prompt contains 256 input tokens")
    response = await client.post("/v1/completions", json={"model": model_name(client),
                                                          "prompt": "x" * 5000})
    assert response.status == 413
    assert (await response.json())["error"]["code"] == "body_too_large"
    assert await metric(client, "kvledger_requests_rejected_total",
                        'reason="body_too_large"') == 1


@pytest.mark.parametrize("prompt", [[5, 6, 7], "The river flows"])
async def test_each_engine_rule_runs_once_per_request_before_admission(aiohttp_client, llm,
                                                                       monkeypatch, prompt):
    """The prompt's ids, the cap and the params are checked once for all ``n`` choices,
    before anything is reserved, at the engine's front door; the engine takes the checked
    requests as they are."""
    from kvledger.engine.admission import line as admission_module
    from kvledger.engine.core import request as request_module
    from kvledger.engine.frontend import checks as door_module

    client = await start_app(aiohttp_client, llm)
    calls = []

    def counted(name, real):
        return lambda *args: calls.append(name) or real(*args)

    for name in ("check_prompt", "check_params", "check_request"):
        monkeypatch.setattr(llm, name, counted(name, getattr(llm, name)))
    for module in (request_module, admission_module, door_module):  # each caller's own name
        monkeypatch.setattr(module, "output_cap", counted("output_cap", module.output_cap))
    response = await client.post("/v1/completions", json={
        "model": model_name(client), "prompt": prompt, "max_tokens": 3, "n": 2,
        "logit_bias": {"5": 1.0}})
    assert response.status == 200 and len((await response.json())["choices"]) == 2
    assert sorted(calls) == ["check_params", "check_prompt", "output_cap"]


async def test_api_key(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, api_keys=("s3cret",))
    body = {"model": model_name(client), "prompt": "x", "max_tokens": 1}
    response = await client.post("/v1/completions", json=body)
    assert response.status == 401
    assert (await response.json())["error"]["code"] == "invalid_api_key"
    response = await client.post("/v1/completions", json=body,
                                 headers={"Authorization": "Bearer wrong"})
    assert response.status == 401
    response = await client.post("/v1/completions", json=body,
                                 headers={"Authorization": "Bearer s3cret"})
    assert response.status == 200
    assert (await client.get("/health")).status == 200  # probes need no key


async def test_models_budget_metrics(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [model_name(client)]
    budget = await (await client.get("/v1/budget")).json()
    assert budget["pool"]["total_blocks"] == 32 and budget["pool"]["reserved_blocks"] == 0
    assert budget["plan"]["kv"]["num_blocks"] == 32 and budget["plan"]["fits"] is True
    assert budget["queue"] == {"waiting": 0, "running": 0, "max_queue_wait_s": None,
                               "max_queue_len": 256, "backfill": False, "backfilled": 0}
    ready = budget["time_to_ready"]  # the start's phases (planner/ready_time.py)
    assert set(ready["measured_s"]) == {"read", "profile", "kv", "warmup"}
    assert all(seconds >= 0 for seconds in ready["measured_s"].values())  # to the ms
    assert ready["measured_s"]["read"] > 0 and ready["pack_bytes_per_s"] > 0  # the CPU packs
    assert ready["weight_file_bytes"] > 0 and ready["read_bytes_per_s"] > 0
    # Read (the timed read's own bytes from the page cache, at the copy's speed), then
    # packed; not placed: on the CPU in the checkpoint's dtype the loaded tensors are views
    # of the files' maps, read by the first pass over them.
    assert ready["copies_weights"] is False
    sampled = ready["read_sample_bytes"]
    assert 0 < sampled <= ready["weight_file_bytes"]
    assert ready["predicted_s"]["read"] == pytest.approx(
        (ready["weight_file_bytes"] - sampled) / ready["read_bytes_per_s"]
        + sampled / ready["place_bytes_per_s"]
        + ready["weight_bytes"] / ready["pack_bytes_per_s"], rel=1e-3, abs=1e-3)  # ms
    # The profile: its steps' arithmetic over the timed matmul; the pool: its bytes over
    # the timed copy (the plan's KV class); the warm-up: its steps, each the weights over
    # the timed one-row product and the step's timed cost beside them; no graphs here.
    assert ready["profile_flops"] > 0 and ready["matmul_flops_per_s"] > 0
    assert ready["predicted_s"]["profile"] == pytest.approx(
        ready["profile_flops"] / ready["matmul_flops_per_s"], rel=1e-2, abs=1e-3)
    assert ready["predicted_s"]["kv"] == pytest.approx(
        budget["plan"]["classes"]["kv_cache"] / ready["place_bytes_per_s"], rel=1e-2, abs=1e-3)
    assert ready["stream_bytes_per_s"] > 0 and ready["step_cost_s"]["per_layer"] >= 0
    cost = ready["step_cost_s"]
    step = (ready["weight_bytes"] / ready["stream_bytes_per_s"]
            + llm.runner.config.num_layers * cost["per_layer"] + cost["per_step"])
    assert ready["predicted_s"]["warmup"] == pytest.approx(4 * step + 2 * cost["new_shape"],
                                                          rel=1e-2, abs=2e-3)
    assert ready["predicted_s"]["graphs"] is None
    text = await (await client.get("/metrics")).text()
    for name in ("kvledger_kv_blocks_total 32.0", "kvledger_kv_blocks_reserved 0.0",
                 "kvledger_kv_blocks_used 0.0", "kvledger_requests_admitted_total",
                 "kvledger_requests_backfilled_total 0.0",
                 "kvledger_request_latency_seconds_bucket",
                 "kvledger_time_to_first_token_seconds_bucket",
                 "kvledger_generation_tokens_total"):
        assert name in text


async def test_engine_step_counters_count_the_steps_that_produced_tokens(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    before = {name: await metric(client, f"kvledger_engine_{name}_total")
              for name in ("steps", "step_seconds", "step_tokens")}
    body = {"model": model_name(client), "prompt": [5, 6, 7], "max_tokens": 9,
            "ignore_eos": True, "temperature": 0}
    answer = await (await client.post("/v1/completions", json=body)).json()
    assert answer["usage"]["completion_tokens"] == 9
    after = {name: await metric(client, f"kvledger_engine_{name}_total") for name in before}
    assert after["steps"] - before["steps"] == 9  # one token a step: the prefill's, then 8
    assert after["step_tokens"] - before["step_tokens"] == 9
    assert after["step_seconds"] > before["step_seconds"]


async def test_ready_is_503_until_the_model_is_attached(aiohttp_client, llm):
    app = build_app()
    client = await aiohttp_client(app)
    assert (await client.get("/health")).status == 200
    assert (await client.get("/ready")).status == 503
    response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert response.status == 503
    assert (await response.json())["error"]["code"] == "not_ready"
    await app[STATE].attach(llm)
    assert (await client.get("/ready")).status == 200
    assert (await client.get("/nowhere")).status == 404
    assert (await (await client.get("/nowhere")).json())["error"]["code"] == "not_found"


def test_prompt_token_bound_used_by_early_rejection_holds(tiny_llama_dir):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvledger.engine.frontend.checks import ADDED_TOKENS_MAX as _ADDED_TOKENS_MAX
    from kvledger.engine.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_llama_dir)

    @settings(max_examples=200, deadline=None)
    @given(st.text(min_size=1, max_size=200))
    def bound_holds(text):
        assert len(tokenizer.encode(text)) <= len(text.encode()) + _ADDED_TOKENS_MAX

    bound_holds()


async def test_full_pool_refuses_with_the_same_answer_before_and_after_tokenizing(
        aiohttp_client, reserving_llm):
    # No line: refused at once. Reserving, the promise held decides, unwritten as it is.
    client = await start_app(aiohttp_client, reserving_llm, max_queue_len=0)
    ledger = client.app[STATE].door.engine.ledger
    held = ledger.try_reserve(ledger.block_size * (ledger.num_blocks - 1))  # 1 block free
    try:
        for body in ({"prompt": "short"}, {"prompt": [5, 6, 7]},
                     {"prompt": "short", "max_tokens": 100},
                     {"prompt": "word " * 40, "max_tokens": 100},  # tokenized first
                     {"messages": [{"role": "user", "content": "hi"}]}):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            response = await client.post(path, json={"model": model_name(client), **body})
            assert response.status == 429
            assert (await response.json())["error"]["code"] == "kv_cache_full"
        response = await client.post("/v1/completions", json={  # the 400 wins over 429
            "model": model_name(client), "prompt": [5] * 256})
        assert response.status == 400
    finally:
        ledger.release(held)


async def test_max_queue_wait_holds_a_request_until_blocks_return(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, max_queue_wait_s=5.0)
    ledger = client.app[STATE].door.engine.ledger
    held = fill_pool(ledger)
    request = asyncio.create_task(client.post("/v1/completions", json={
        "model": model_name(client), "prompt": "x", "max_tokens": 2}))
    assert await wait_for_metric(client, "kvledger_queue_length", 1) == 1
    budget = await (await client.get("/v1/budget")).json()
    assert budget["queue"]["waiting"] == 1
    ledger.release(held)
    client.app[STATE].door.admission.capacity_changed()  # what the engine's next step would do
    response = await request
    assert response.status == 200
    assert await metric(client, "kvledger_queue_wait_seconds_count") == 1


async def test_backfill_reaches_admission(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, backfill=True)
    budget = await (await client.get("/v1/budget")).json()
    assert budget["queue"]["backfill"] is True


async def test_safe_admission_over_http_serves_everyone_and_reports_itself(aiohttp_client,
                                                                           tiny_llama_dir):
    client = await start_app(aiohttp_client, make_llm(tiny_llama_dir, admission="safe"),
                             max_queue_wait_s=60.0)
    body = {"model": model_name(client), "prompt": "a b c", "temperature": 0,
            "ignore_eos": True}
    answers = await asyncio.gather(*(client.post("/v1/completions", json={
        **body, "max_tokens": cap}) for cap in (200, 40, 120, 10, 200, 60)))
    assert [a.status for a in answers] == [200] * 6
    usage = [(await a.json())["usage"]["completion_tokens"] for a in answers]
    assert usage == [200, 40, 120, 10, 200, 60]
    budget = await (await client.get("/v1/budget")).json()
    assert budget["pool"]["admission"] == "safe" and budget["pool"]["paused"] == 0
    assert budget["pool"]["reserved_blocks"] == budget["pool"]["used_blocks"] == 0
    exposition = await (await client.get("/metrics")).text()
    assert "\nkvledger_requests_paused 0.0\n" in exposition
    assert "\nkvledger_kv_draws_refused_total " in exposition


async def test_several_served_model_names_as_vllm_takes_them(aiohttp_client, tiny_llama_dir):
    """``--served-model-name a b``: both accepted, both listed, answers carry the first."""
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    config = config_from_args(parser.parse_args(
        [str(tiny_llama_dir), "--served-model-name", "first", "second"]))
    assert (config.served_model_name, config.served_model_aliases) == ("first", ("second",))
    assert config_from_args(parser.parse_args(config.to_flags())) == config
    client = await start_app(aiohttp_client, make_llm(tiny_llama_dir, served_model_name="first",
                                                      served_model_aliases=("second",)))
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["first", "second"]
    answer = await client.post("/v1/completions", json={"model": "second", "prompt": "a",
                                                        "max_tokens": 2})
    assert answer.status == 200 and (await answer.json())["model"] == "first"
    refused = await client.post("/v1/completions", json={"model": "third", "prompt": "a"})
    assert refused.status == 404


async def test_vllm_endpoints_not_served_are_refused_by_name(aiohttp_client, llm):
    """/v1/embeddings (and vLLM's other non-generation endpoints) are a 404, as vLLM
    answers a route its model does not serve, naming what kvledger serves rather than
    reading like a wrong base URL."""
    client = await start_app(aiohttp_client, llm)
    for path in ("/v1/embeddings", "/v1/rerank", "/pooling"):
        response = await client.post(path, json={"model": model_name(client), "input": "hi"})
        assert response.status == 404, path
        error = (await response.json())["error"]
        assert error["code"] == "not_found" and f"does not serve {path} (" in error["message"]
        assert "/v1/chat/completions" in error["message"]
        assert "/v1/responses" in error["message"]
    assert (await client.post("/v1/embedding", json={})).status == 404  # a typo stays a 404
