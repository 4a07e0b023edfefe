"""The OpenAI surface through the official ``openai`` SDK on 127.0.0.1: logprobs and echo,
``n``, penalties, ``min_tokens``, ``logit_bias``, structured outputs, usage in streams,
and vLLM's /tokenize, /detokenize and /version. After each, every reserved KV block is
back: reservations stay exact whatever a request asks for."""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import jsonschema
import openai
import pytest
from _server_helpers import make_llm

from kvledger.engine.server.app import build_app
from kvledger.engine.server.state import STATE, ServeOptions

IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_num_seqs=16, num_gpu_blocks_override=64)


@pytest.fixture
async def server(aiohttp_server, llm):
    app = build_app(ServeOptions())
    http = await aiohttp_server(app, host="127.0.0.1")
    await app[STATE].attach(llm)
    client = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none",
                                max_retries=0)
    client.name = app[STATE].model_name
    client.root = str(http.make_url("/"))
    client.ledger = llm.ledger
    client.llm = llm
    yield client
    await client.close()
    await _pool_empty(llm.ledger)


async def _pool_empty(ledger, timeout_s: float = 5.0) -> None:
    """Every reservation is released (the engine frees an aborted one at its next step)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while ledger.reserved_blocks and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    assert ledger.reserved_blocks == 0 and ledger.used_blocks == 0


async def test_completion_logprobs_and_echo_agree_with_teacher_forcing(server):
    first = await server.completions.create(
        model=server.name, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=3,
        extra_body={"return_tokens_as_token_ids": True, **IGNORE_EOS})
    lp = first.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token.startswith("token_id:") and token in top and len(top) in (3, 4)
        assert value <= 0 and value == pytest.approx(max(top.values()))  # greedy: the best
    generated = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    # Echo the prompt plus what was generated: the prompt logprobs of the generated part,
    # from one (chunked) prefill, equal the logprobs each decode step reported.
    prompt = (await _post(server, "tokenize", {"prompt": "Once upon a time"}))["tokens"]
    echoed = await server.completions.create(model=server.name, prompt=prompt + generated,
                                             max_tokens=1, temperature=0, logprobs=2,
                                             echo=True)
    elp = echoed.choices[0].logprobs
    assert len(elp.tokens) == len(prompt) + len(generated) + 1
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert elp.token_logprobs[len(prompt):-1] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert echoed.choices[0].text.endswith(first.choices[0].text + _last_text(elp))
    assert elp.text_offset == [sum(len(t) for t in elp.tokens[:i])
                               for i in range(len(elp.tokens))]


def _last_text(logprobs) -> str:
    return logprobs.tokens[-1]


async def test_chat_logprobs_with_top_alternatives(server):
    chat = await server.chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=4, extra_body=IGNORE_EOS)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    # The text holds back a trailing partial UTF-8 character; each token shows its own.
    assert "".join(entry.token for entry in content).startswith(chat.choices[0].message.content)
    for entry in content:
        assert len(entry.top_logprobs) == 4 and entry.bytes == list(entry.token.encode())
        values = [alt.logprob for alt in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0])
        assert math.fsum(math.exp(v) for v in values) <= 1.0 + 1e-4
    plain = await server.chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, extra_body=IGNORE_EOS)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == chat.choices[0].message.content


async def test_n_choices_whole_and_streamed_with_seeds(server):
    many = await server.completions.create(model=server.name, prompt="Once", max_tokens=8,
                                           n=3, seed=11, temperature=1.0,
                                           extra_body=IGNORE_EOS)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.usage.completion_tokens == 24 and many.usage.prompt_tokens > 0
    texts = [c.text for c in many.choices]
    assert len(set(texts)) > 1  # each choice draws its own tokens
    again = await server.completions.create(model=server.name, prompt="Once", max_tokens=8,
                                            n=3, seed=11, temperature=1.0,
                                            extra_body=IGNORE_EOS)
    assert [c.text for c in again.choices] == texts  # seed + index: reproducible
    stream = await server.chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=2,
        stream=True, stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
    parts: dict[int, str] = {0: "", 1: ""}
    finished = set()
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            parts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and usage.completion_tokens == 12


async def test_penalties_min_tokens_logit_bias_and_top_k_zero(server):
    eos = sorted(server.llm.tokenizer.eos_token_ids)[0]
    base = {"model": server.name, "prompt": "the the the the", "max_tokens": 64,
            "temperature": 0}
    ids = {"return_tokens_as_token_ids": True, **IGNORE_EOS}
    plain = await server.completions.create(**base, logprobs=0, extra_body=ids)
    penalised = await server.completions.create(
        **base, frequency_penalty=2.0, presence_penalty=2.0, logprobs=0, extra_body=ids)
    assert _max_repeats(plain) > 1 and _max_repeats(penalised) == 1
    forced = await server.completions.create(**base, logit_bias={str(eos): 100})
    assert forced.usage.completion_tokens == 1 and forced.choices[0].finish_reason == "stop"
    held = await server.completions.create(**base, logit_bias={str(eos): 100},
                                           extra_body={"min_tokens": 4})
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"
    off = await server.completions.create(**base, extra_body={"top_k": 0, **IGNORE_EOS})
    assert off.choices[0].text == plain.choices[0].text
    capped = await server.completions.create(model=server.name, prompt="x", temperature=0,
                                             extra_body={"max_completion_tokens": 3,
                                                         **IGNORE_EOS})
    assert capped.usage.completion_tokens == 3


def _max_repeats(completion) -> int:
    tokens = completion.choices[0].logprobs.tokens
    return max(tokens.count(t) for t in tokens)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


async def test_response_format_json_schema_and_json_object(server):
    for stream in (False, True):
        chat = await server.chat.completions.create(
            model=server.name, messages=[{"role": "user", "content": "a person"}],
            max_tokens=120, temperature=0.8, seed=3, stream=stream,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": SCHEMA}})
        if stream:
            text = "".join([c.choices[0].delta.content or "" async for c in chat
                            if c.choices])
        else:
            text = chat.choices[0].message.content
            assert chat.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    obj = await server.completions.create(model=server.name, prompt="{", max_tokens=120,
                                          temperature=0.8, seed=5,
                                          extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.choices[0].text), dict)
    choice = await server.completions.create(model=server.name, prompt="pick", max_tokens=20,
                                             extra_body={"guided_choice": ["red", "green"]})
    assert choice.choices[0].text in ("red", "green")
    with pytest.raises(openai.BadRequestError) as info:
        await server.chat.completions.create(
            model=server.name, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}})
    assert info.value.body["param"] == "response_format"


async def test_continuous_usage_stats(server):
    stream = await server.completions.create(
        model=server.name, prompt="Once", max_tokens=4, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body=IGNORE_EOS)
    chunks = [c async for c in stream]
    seen = [c.usage.completion_tokens for c in chunks if c.choices]
    assert seen == sorted(seen) and seen[-1] == 4
    assert all(c.usage is not None for c in chunks)


async def test_unknown_and_unsupported_fields_are_refused_by_name(server):
    for extra, param in (({"temprature": 0.2}, "temprature"), ({"best_of": 3}, "best_of"),
                         ({"suffix": "x"}, "suffix")):
        with pytest.raises(openai.BadRequestError) as info:
            await server.completions.create(model=server.name, prompt="x", extra_body=extra)
        assert info.value.body["param"] == param


async def test_tokenize_detokenize_version(server):
    tokens = await _post(server, "tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    text = await _post(server, "detokenize", {"tokens": tokens["tokens"]})
    assert text["prompt"] == "<s>Hello world"  # special tokens kept, as vLLM's
    assert tokens["token_strs"][0] == "<s>" and "Ġworld" in tokens["token_strs"]  # the vocab's
    chat = await _post(server, "tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    completion = await server.chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert chat["count"] == completion.usage.prompt_tokens
    bad = await _post(server, "tokenize", {"prompt": "x", "messages": []}, status=400)
    assert "exactly one" in bad["error"]["message"]
    bad = await _post(server, "detokenize", {"tokens": [10**9]}, status=400)
    assert bad["error"]["param"] == "tokens"
    async with aiohttp.ClientSession() as session, \
            session.get(server.root + "version") as response:
        assert (await response.json())["version"]


async def _post(server, path: str, body: dict, status: int = 200) -> dict:
    async with aiohttp.ClientSession() as session, \
            session.post(server.root + path, json=body) as response:
        assert response.status == status, await response.text()
        return await response.json()


@pytest.mark.parametrize("extra", [
    {"n": 3},
    {"logprobs": 5, "echo": True},
    {"frequency_penalty": 1.0, "logit_bias": {"7": 3}},  # 5 is an EOS id: it ended early
    {"response_format": {"type": "json_object"}},
])
async def test_a_client_leaving_mid_stream_releases_every_choice(server, extra):
    body = {"model": server.name, "prompt": "Once upon a time", "max_tokens": 200,
            "stream": True, "temperature": 1.0, **extra}
    async with aiohttp.ClientSession() as session, \
            session.post(server.root + "v1/completions", json=body) as response:
        assert response.status == 200
        await response.content.readline()  # the first event: it is running
        assert server.ledger.reserved_blocks > 0
    # leaving the block closed the connection mid-stream
    await _pool_empty(server.ledger)
