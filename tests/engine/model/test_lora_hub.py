"""LoRA adapters on the hub (``--lora-modules NAME=hf://ORG/NAME``): ``kvledger fetch``
downloads them beside the model into the cache, and the engine reads them from there
offline, as the pod's engine container runs; online, an engine downloads one itself."""

from __future__ import annotations

import pytest
from _hub_helpers import hub_env, kvledger, point_hub_at
from _lora_helpers import write_adapter
from hub_server import HubServer

from kvledger.engine import LLM, LoRARequest, SamplingParams
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.lora_config import LoraModule

PROMPT = [5, 17, 42, 9, 33, 7]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir, tmp_path_factory):
    return write_adapter(tmp_path_factory.mktemp("sql"), tiny_llama_dir, seed=5)


@pytest.fixture(scope="module")
def hub(tiny_llama_dir, adapter_dir):
    with HubServer() as server:
        server.add_commit("kvledger/tiny-llama", tiny_llama_dir)
        server.add_commit("kvledger/sql-lora", adapter_dir)
        server.add_commit("kvledger/not-an-adapter", tiny_llama_dir)
        yield server


def _tokens(model_dir, lora: LoRARequest | None = None, **flags) -> list[int]:
    llm = LLM(str(model_dir), max_model_len=128, device="cpu", enable_lora=True, **flags)
    if lora is None:
        (lora,) = llm.engine.loras.served.values()
    return llm.generate([PROMPT], GREEDY, lora_request=lora)[0].token_ids


def test_fetch_downloads_adapters_and_the_engine_reads_them_offline(
        hub, tiny_llama_dir, adapter_dir, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    env = hub_env(hub.url, tmp_path / "home")
    fetched = kvledger(env, "fetch", "--model", "hf://kvledger/tiny-llama", "--download-dir",
                       cache, "--lora-modules", "sql=hf://kvledger/sql-lora")
    assert fetched.returncode == 0, fetched.stderr
    assert "fetched LoRA adapter sql (hf://kvledger/sql-lora)" in fetched.stdout
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    served = (LoraModule("sql", "hf://kvledger/sql-lora"),)
    expected = _tokens(tiny_llama_dir, LoRARequest("sql", 1, str(adapter_dir)))
    assert _tokens(tiny_llama_dir, lora_modules=served, download_dir=cache) == expected
    with pytest.raises(BadInput, match=r"hf://kvledger/other is not in the hub cache .*"
                                       "HF_HUB_OFFLINE=1"):
        _tokens(tiny_llama_dir, lora_modules=(LoraModule("o", "hf://kvledger/other"),),
                download_dir=cache)


def test_online_the_engine_downloads_an_adapter(hub, tiny_llama_dir, adapter_dir, tmp_path,
                                                monkeypatch):
    point_hub_at(monkeypatch, hub.url, tmp_path)
    served = (LoraModule("sql", "hf://kvledger/sql-lora"),)
    cache = str(tmp_path / "cache")
    expected = _tokens(tiny_llama_dir, LoRARequest("sql", 1, str(adapter_dir)))
    assert _tokens(tiny_llama_dir, lora_modules=served, download_dir=cache) == expected
    with pytest.raises(BadInput, match=r"kvledger/not-an-adapter .*has no adapter_config.json"):
        _tokens(tiny_llama_dir, lora_modules=(LoraModule("x", "hf://kvledger/not-an-adapter"),),
                download_dir=cache)
