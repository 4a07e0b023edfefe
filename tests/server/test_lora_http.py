"""LoRA adapters over HTTP, as vLLM serves them: a request names an adapter in ``model``
(404 naming an unknown one); ``/v1/models`` lists each with ``parent`` and ``root``;
runtime load and unload only when allowed; unloading never loses a request in flight;
the adapters' metrics (``vllm:lora_requests_info``, kvledger's per-adapter counter)."""

from __future__ import annotations

import asyncio
import json

import pytest
from _lora_helpers import write_adapter
from _server_helpers import make_llm, metric, start_app

from kvledger.engine import LLM, LoRARequest, SamplingParams
from kvledger.engine.settings.lora_config import LoraModule

PROMPT = [5, 17, 42, 9, 33, 7, 120, 64, 3]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(root / name, tiny_llama_dir, seed=seed)
            for name, seed in (("sql", 1), ("chat", 2), ("late", 3))}


@pytest.fixture(scope="module")
def alone(tiny_llama_dir, adapters):
    """Each adapter's (and the base model's) greedy text for PROMPT, from the Python API."""
    llm = LLM(str(tiny_llama_dir), max_model_len=256, device="cpu", enable_lora=True,
              max_loras=1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    texts = {name: llm.generate([PROMPT], params, LoRARequest(name, i + 1, str(path)))[0].text
             for i, (name, path) in enumerate(adapters.items())}
    texts[None] = llm.generate([PROMPT], params)[0].text
    return texts


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, adapters):
    return make_llm(tiny_llama_dir, enable_lora=True, max_loras=1, max_cpu_loras=2,
                    served_model_name="base",
                    lora_modules=(LoraModule("sql", str(adapters["sql"])),
                                  LoraModule("chat", str(adapters["chat"]))))


def _body(model: str, **more) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, **more}


async def test_requests_name_adapters_and_run_together(aiohttp_client, llm, alone, adapters):
    """The base and two adapters at once with one slot: the adapters take turns, nothing
    fails, each text is the one it gets alone; /v1/models lists them as vLLM does."""
    client = await start_app(aiohttp_client, llm)
    models = (await (await client.get("/v1/models")).json())["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in models] == [
        ("base", None, llm.config.model), ("sql", "base", "sql"), ("chat", "base", "chat")]
    names = ["sql", "chat", "base", "chat", "sql"]
    answers = await asyncio.gather(*(client.post("/v1/completions", json=_body(name))
                                     for name in names))
    for name, answer in zip(names, answers, strict=True):
        assert answer.status == 200, await answer.text()
        data = await answer.json()
        assert data["model"] == name
        assert data["choices"][0]["text"] == alone[None if name == "base" else name]
    text = await (await client.get("/metrics")).text()
    assert 'kvledger_lora_requests_total{adapter="sql"} 2.0' in text
    assert 'kvledger_lora_requests_total{adapter="chat"} 2.0' in text
    assert ('vllm:lora_requests_info{max_lora="1",running_lora_adapters="",'
            'waiting_lora_adapters=""}') in text
    unknown = await client.post("/v1/completions", json=_body("nosuch"))
    assert unknown.status == 404
    assert "'nosuch' does not exist" in (await unknown.json())["error"]["message"]


async def test_runtime_updates_are_404_unless_allowed(aiohttp_client, llm, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    client = await start_app(aiohttp_client, llm)
    for route in ("load", "unload"):
        answer = await client.post(f"/v1/{route}_lora_adapter", json={"lora_name": "sql"})
        assert answer.status == 404


async def test_load_and_unload_at_run_time(aiohttp_client, llm, alone, adapters, tmp_path,
                                           monkeypatch, tiny_llama_dir):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    client = await start_app(aiohttp_client, llm)
    load = {"lora_name": "late", "lora_path": str(adapters["late"])}
    answer = await client.post("/v1/load_lora_adapter", json=load)
    assert answer.status == 200 and "'late' added" in await answer.text()
    again = await client.post("/v1/load_lora_adapter", json=load)
    assert again.status == 400 and "already loaded" in await again.text()
    wide = write_adapter(tmp_path / "wide", tiny_llama_dir, rank=32)
    refused = await client.post("/v1/load_lora_adapter",
                                json={"lora_name": "wide", "lora_path": str(wide)})
    assert refused.status == 400
    assert "'wide'" in (message := (await refused.json())["error"]["message"])
    assert "rank 32 is over --max-lora-rank 16" in message
    missing = await client.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert missing.status == 400
    # A long request for the adapter is in flight when it is unloaded: it finishes.
    stream = await client.post("/v1/completions", json=_body("late", stream=True))
    assert stream.status == 200
    first = await stream.content.readline()
    assert first.startswith(b"data: ")
    unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert unload.status == 200 and "'late' removed" in await unload.text()
    rest = first.decode() + (await stream.read()).decode()
    events = [json.loads(line[6:]) for line in rest.splitlines()
              if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == alone["late"]
    gone = await client.post("/v1/completions", json=_body("late"))
    assert gone.status == 404 and "'late'" in await gone.text()
    twice = await client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert twice.status == 404 and "'late' cannot be found" in await twice.text()
    models = (await (await client.get("/v1/models")).json())["data"]
    assert "late" not in [m["id"] for m in models]


async def test_running_adapters_in_vllm_lora_requests_info(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    stream = await client.post("/v1/completions", json=_body("sql", stream=True, max_tokens=60))
    await stream.content.readline()
    text = await (await client.get("/metrics")).text()
    assert 'max_lora="1",running_lora_adapters="sql"' in text
    await stream.read()
    assert await metric(client, "kvledger_lora_requests_total", 'adapter="sql"') >= 1
