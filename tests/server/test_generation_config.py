"""A model's published sampling defaults (``generation_config.json``), applied as vLLM
applies them (``--generation-config auto|vllm|DIR``), and vLLM's ``min_p``."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from _server_helpers import make_llm, model_name, start_app

from kvledger.engine.errors import BadInput
from kvledger.engine.model.generation_config import describe, max_tokens_cap, sampling_defaults
from kvledger.engine.sampling.params import SamplingParams

# What a model card might publish: greedy by top_k 1, and a default output length.
PUBLISHED = {"bos_token_id": 1, "eos_token_id": 2, "top_k": 1, "temperature": 0.7,
             "max_new_tokens": 5, "presence_penalty": 0.5}  # vLLM reads no penalty but
                                                              # repetition_penalty


@pytest.fixture(scope="module")
def published_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("published")
    for path in tiny_llama_dir.iterdir():
        shutil.copy(path, out / path.name)
    (out / "generation_config.json").write_text(json.dumps(PUBLISHED))
    return out


def test_defaults_are_read_as_vllm_reads_them(published_dir, tmp_path):
    assert sampling_defaults(published_dir) == {"top_k": 1, "temperature": 0.7, "max_tokens": 5}
    assert sampling_defaults(published_dir, "vllm") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.8, "min_p": 0.1}))
    assert sampling_defaults(published_dir, str(tmp_path)) == {"top_p": 0.8, "min_p": 0.1}
    with pytest.raises(BadInput, match="not 'auto', 'vllm' or a folder"):
        sampling_defaults(published_dir, str(tmp_path / "missing"))
    with pytest.raises(BadInput, match="not 'auto', 'vllm' or a folder"):  # OSError before
        sampling_defaults(published_dir, str(tmp_path / ("m" * 300)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": "many"}))
    with pytest.raises(BadInput, match="top_k must be a number"):
        sampling_defaults(published_dir, str(tmp_path))
    # --override-generation-config: over the file, over nothing with vllm; its
    # max_new_tokens (and a folder's) caps every request, the model's own file's does not
    override = {"temperature": 0.2, "max_new_tokens": 9, "frequency_penalty": 1.0}
    assert sampling_defaults(published_dir, "auto", override) == {
        "top_k": 1, "temperature": 0.2, "max_tokens": 9}
    assert sampling_defaults(published_dir, "vllm", override) == {"temperature": 0.2,
                                                                 "max_tokens": 9}
    assert max_tokens_cap(sampling_defaults(published_dir), "auto") is None
    assert max_tokens_cap({"max_tokens": 9}, "vllm", override) == 9
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    assert max_tokens_cap(sampling_defaults(published_dir, str(tmp_path)), str(tmp_path)) == 7
    with pytest.raises(BadInput, match="--override-generation-config: top_p must be a number"):
        sampling_defaults(published_dir, "vllm", {"top_p": "high"})


async def _texts(client, count: int, **body) -> list[str]:
    texts = []
    for _ in range(count):
        response = await client.post("/v1/completions", json={
            "model": model_name(client), "prompt": "Once upon a time", **body})
        assert response.status == 200, await response.text()
        answer = await response.json()
        texts.append((answer["choices"][0]["text"], answer["usage"]["completion_tokens"]))
    return texts


async def test_unset_fields_take_the_models_defaults(aiohttp_client, published_dir, caplog):
    with caplog.at_level(logging.INFO, logger="kvledger.engine"):
        llm = make_llm(published_dir)
    assert any("sampling defaults from the model's generation_config.json" in r.message
               and "top_k=1" in r.message for r in caplog.records)
    client = await start_app(aiohttp_client, llm)
    # top_k 1 from the file: three unparameterised requests give one text, of 16 tokens
    # (a completion's default, as vLLM's; before, the model's 5)
    plain = await _texts(client, 3)
    assert len(set(plain)) == 1 and plain[0][1] == 16
    # max_tokens sent as null, and a chat naming none, take the model's max_new_tokens
    assert (await _texts(client, 1, max_tokens=None))[0][1] == 5
    chat = await client.post("/v1/chat/completions", json={
        "model": model_name(client), "messages": [{"role": "user", "content": "hi"}]})
    assert (await chat.json())["usage"]["completion_tokens"] == 5
    # a request's own values win: max_tokens 8, and top_k -1 samples again
    assert (await _texts(client, 1, max_tokens=8))[0][1] == 8
    sampled = await _texts(client, 4, top_k=-1, temperature=1.0, max_tokens=16)
    assert len(set(sampled)) > 1


async def test_a_folders_or_the_overrides_max_new_tokens_caps_every_request(
        aiohttp_client, published_dir, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    for llm in (make_llm(published_dir, generation_config=str(tmp_path)),
                make_llm(published_dir, override_generation_config={"max_new_tokens": 7})):
        client = await start_app(aiohttp_client, llm)
        assert [n for _, n in await _texts(client, 2, max_tokens=20)] == [7, 7]  # was 20
        assert (await _texts(client, 1, max_tokens=3))[0][1] == 3


async def test_generation_config_vllm_ignores_the_file(aiohttp_client, published_dir):
    client = await start_app(aiohttp_client, make_llm(published_dir, generation_config="vllm"))
    texts = await _texts(client, 4, max_tokens=16)
    assert len(set(texts)) > 1  # vLLM's neutral defaults: temperature 1, no top_k


def test_min_p_keeps_only_tokens_near_the_top():
    """min_p 1 leaves only the most likely token: sampling then equals greedy."""
    from kvledger.engine.sampling.sampler import Sampler

    class Seq:
        def __init__(self, params):
            self.params, self.generator = params, None

    sampler = Sampler(0, torch.device("cpu"), frozenset())
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1))
    near = SamplingParams(temperature=1.0, min_p=1.0)
    drawn = {int(sampler._sample_row(logits, Seq(near))[0]) for _ in range(20)}
    assert drawn == {int(logits.argmax())}
    wide = SamplingParams(temperature=1.0, min_p=0.0)
    assert len({int(sampler._sample_row(logits, Seq(wide))[0]) for _ in range(50)}) > 1
    with pytest.raises(BadInput, match="min_p must be a number in"):
        SamplingParams(min_p=1.5)


def test_without_generation_config_json_config_jsons_sampling_values_are_read(
        tiny_llama_dir, tmp_path):
    """vLLM's fallback (``GenerationConfig.from_model_config``): an older checkpoint keeps
    its sampling values in config.json; only those are read, and the start-up line says
    where they came from."""
    for path in tiny_llama_dir.iterdir():
        if path.name != "generation_config.json":
            shutil.copy(path, tmp_path / path.name)
    config = json.loads((tmp_path / "config.json").read_text())
    assert sampling_defaults(tmp_path) == {}  # kvledger's own config.json states none
    config.update(temperature=0.6, top_p=0.9, max_length=20, do_sample=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9}
    assert "the model's config.json" in describe({"temperature": 0.6}, "auto",
                                                 model_dir=tmp_path)
    assert sampling_defaults(tmp_path, "vllm") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 3}))
    assert sampling_defaults(tmp_path) == {"top_k": 3}  # the file wins whole, as in vLLM
