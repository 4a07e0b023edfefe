"""Tenant isolation over HTTP: an adapter loaded at run time whose weights overflow fails
its own requests alone while base requests batched with it keep their exact tokens, also
after it is unloaded; adapters that cannot be trusted are refused at load with a 400
naming why; and request fields nested past the parser's depth are a 4xx or are taken
as text, never a 500."""

from __future__ import annotations

import asyncio
import threading

import pytest
from _lora_helpers import write_adapter
from _server_helpers import make_llm, metric, start_app

from kvledger.engine.errors import BadInput
from kvledger.engine.frontend.offload import ADAPTER_THREADS

PROMPT = [5, 17, 42, 9, 33, 7, 120, 64, 3]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, enable_lora=True, max_loras=1, max_num_seqs=8,
                    served_model_name="base")


def _body(model: str, **more) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, **more}


async def test_an_overflowing_adapter_fails_alone_and_leaves_base_tokens_exact(
        aiohttp_client, llm, tiny_llama_dir, tmp_path, monkeypatch):
    """Weights of 1e30 are finite, so the load accepts them; its rows overflow to inf and
    NaN. Its requests fail with a clear error; base requests in the same batches, and
    after it is unloaded, get the tokens they get alone."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    client = await start_app(aiohttp_client, llm)
    alone = await (await client.post("/v1/completions", json=_body("base"))).json()
    expected = alone["choices"][0]["text"]
    huge = write_adapter(tmp_path / "huge", tiny_llama_dir, scale=1e30)
    loaded = await client.post("/v1/load_lora_adapter",
                               json={"lora_name": "huge", "lora_path": str(huge)})
    assert loaded.status == 200, await loaded.text()
    answers = await asyncio.gather(*(client.post("/v1/completions", json=_body(model))
                                     for model in ["huge", "base", "huge", "base", "base"]))
    for model, answer in zip(["huge", "base", "huge", "base", "base"], answers, strict=True):
        data = await answer.json()
        if model == "huge":
            assert answer.status == 500
            assert "not finite" in data["error"]["message"]
        else:
            assert answer.status == 200 and data["choices"][0]["text"] == expected
    assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "huge"})).status == 200
    for _ in range(3):
        data = await (await client.post("/v1/completions", json=_body("base"))).json()
        assert data["choices"][0]["text"] == expected
    assert (await client.get("/health")).status == 200
    assert llm.ledger.used_blocks == 0


@pytest.mark.parametrize(("config", "message"), [
    (dict(scale=float("nan")), "holds values that are not finite"),
    (dict(scale=float("inf")), "holds values that are not finite"),
    (dict(alpha=float("nan")), "lora_alpha must be a finite number"),
    (dict(alpha=1e400), "lora_alpha must be a finite number"),
    (dict(target_modules=[["q_proj"]]), "target_modules must be a list of module names"),
], ids=["nan", "inf", "alpha-nan", "alpha-1e400", "nested-targets"])
async def test_an_adapter_that_cannot_be_trusted_is_a_400_at_load(
        aiohttp_client, llm, tiny_llama_dir, tmp_path, monkeypatch, config, message):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    client = await start_app(aiohttp_client, llm)
    path = write_adapter(tmp_path / "bad", tiny_llama_dir, **config)
    answer = await client.post("/v1/load_lora_adapter",
                               json={"lora_name": "bad", "lora_path": str(path)})
    assert answer.status == 400
    assert message in (await answer.json())["error"]["message"]


async def test_a_deeply_nested_adapter_config_is_a_400(aiohttp_client, llm, tiny_llama_dir,
                                                        tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    client = await start_app(aiohttp_client, llm)
    path = write_adapter(tmp_path / "deep", tiny_llama_dir)
    (path / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    answer = await client.post("/v1/load_lora_adapter",
                               json={"lora_name": "deep", "lora_path": str(path)})
    assert answer.status == 400
    assert "nested too deeply" in (await answer.json())["error"]["message"]


async def test_deeply_nested_past_tool_call_arguments_are_text_not_a_500(
        aiohttp_client, tiny_llama_dir):
    """A past assistant message's ``tool_calls[].function.arguments`` string of 5,000
    nested brackets: the chat template gets it as the string (it is not an object), for
    chat completions and for /tokenize alike."""
    llm = make_llm(tiny_llama_dir, served_model_name="base")
    client = await start_app(aiohttp_client, llm)
    failed = await metric(client, "kvledger_requests_failed_total", 'reason="internal_error"')
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]
    chat = await client.post("/v1/chat/completions", json={
        "model": "base", "messages": messages, "max_tokens": 2})
    assert chat.status < 500, await chat.text()
    tokenize = await client.post("/tokenize", json={"model": "base", "messages": messages})
    assert tokenize.status < 500, await tokenize.text()
    assert await metric(client, "kvledger_requests_failed_total",
                        'reason="internal_error"') == failed


async def test_a_client_learns_nothing_of_the_servers_paths(aiohttp_client, llm, tmp_path,
                                                            monkeypatch):
    """A path that does not exist and one that does (not an adapter) get one message."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    client = await start_app(aiohttp_client, llm)
    messages = []
    for path in ("/no/such/dir", str(tmp_path), "/etc/passwd"):
        answer = await client.post("/v1/load_lora_adapter",
                                   json={"lora_name": "probe", "lora_path": path})
        assert answer.status == 400
        messages.append((await answer.json())["error"]["message"])
    assert len(set(messages)) == 1, messages
    assert "not a PEFT LoRA adapter directory this server can read" in messages[0]


async def test_an_unloaded_adapter_leaves_no_metric_series(aiohttp_client, llm, tiny_llama_dir,
                                                          tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    client = await start_app(aiohttp_client, llm)
    for i in range(3):
        path = write_adapter(tmp_path / f"a{i}", tiny_llama_dir, seed=i)
        await client.post("/v1/load_lora_adapter", json={"lora_name": f"a{i}", "lora_path": str(path)})
        assert (await client.post("/v1/completions", json=_body(f"a{i}", max_tokens=2))).status == 200
        assert await metric(client, "kvledger_lora_requests_total", f'adapter="a{i}"') == 1
        await client.post("/v1/unload_lora_adapter", json={"lora_name": f"a{i}"})
    text = await (await client.get("/metrics")).text()
    assert "kvledger_lora_requests_total{" not in text


async def test_adapter_loads_that_hang_hold_up_no_other_request(aiohttp_client, llm,
                                                                monkeypatch):
    """Four runtime loads stuck (a hub that never answers, as long as --hub-timeout): a
    plain completion and a large /tokenize, which run on the prepare threads, answer at
    once; the loads run on threads of their own, at most ADAPTER_THREADS of them."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    client = await start_app(aiohttp_client, llm)
    release, started = threading.Event(), []

    def stuck(module):
        started.append(module.name)
        release.wait(30)
        raise BadInput("the hub did not answer")

    monkeypatch.setattr(llm.loras, "add", stuck)  # the engine the test holds
    loads = [asyncio.create_task(client.post("/v1/load_lora_adapter", json={
        "lora_name": f"hub{i}", "lora_path": f"hf://kvledger/stuck-{i}"})) for i in range(4)]
    for _ in range(100):  # the loads reach their threads (later on a loaded machine)
        if len(started) >= ADAPTER_THREADS:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # time for a third to start, were there a thread for it
    assert len(started) == ADAPTER_THREADS  # the others wait, holding no thread
    began = asyncio.get_running_loop().time()
    plain = await client.post("/v1/completions", json=_body("base", max_tokens=2,
                                                            user="u" * 12_000))
    tokenized = await client.post("/tokenize", json={"model": "base", "prompt": "x " * 20_000})
    assert plain.status == 200 and tokenized.status == 200
    assert asyncio.get_running_loop().time() - began < 5
    release.set()
    for answer in await asyncio.gather(*loads):
        assert answer.status == 400 and "did not answer" in await answer.text()
