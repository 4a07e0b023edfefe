"""--reasoning-parser over HTTP on a tiny model whose tokenizer holds ``<think>``,
``</think>`` and ``<tool_call>`` as Qwen3's does (added, not special). Its random weights
write the markers when ``allowed_token_ids`` leaves few others; the same seeded request
on a server without the flag gives the raw text the split is checked against."""

from __future__ import annotations

import json

import pytest
from _server_helpers import make_llm, model_name, start_app, stop_app, with_added_tokens

from kvledger.engine.errors import BadInput

MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
ASK = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def think_dir(tiny_llama_dir, tmp_path_factory):
    return with_added_tokens(tiny_llama_dir, tmp_path_factory.mktemp("think") / "model",
                             MARKERS)


@pytest.fixture(scope="module")
def llm(think_dir):
    return make_llm(think_dir, max_model_len=512, num_gpu_blocks_override=128)


# Qwen3's layout: ChatML turns, the tools and a <tool_call> example in the system turn. Its
# turn markers are tokens, as in Qwen3's tokenizer, so the example is an earlier turn's and
# does not end the reasoning (vLLM's is_reasoning_end on the prompt stops at <|im_start|>).
QWEN_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "For each function call, return a json object within <tool_call></tool_call> XML "
    "tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def qwen_llm(tiny_llama_dir, tmp_path_factory):
    """The tiny model with Qwen3's markers, its turn markers and its chat layout."""
    model = with_added_tokens(tiny_llama_dir, tmp_path_factory.mktemp("qwen") / "model",
                              [*MARKERS, "<|im_start|>", "<|im_end|>"])
    (model / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    return make_llm(model, max_model_len=512, num_gpu_blocks_override=128)


def _body(client, llm, seed: int, **extra):
    tok = llm.tokenizer
    allowed = [tok.token_to_id(m) for m in ("<think>", "</think>")] + tok.encode(
        " sky blue light", add_special_tokens=False)
    return {"model": model_name(client), "messages": ASK, "max_tokens": 24, "seed": seed,
            "temperature": 1.0, "allowed_token_ids": allowed, **extra}


async def _raw_and_split(aiohttp_client, llm, parser: str, seeds=range(6), **extra):
    """Each seed's raw text (no flag), then the whole and streamed answers with it."""
    plain = await start_app(aiohttp_client, llm)
    raws = []
    for seed in seeds:
        answer = await (await plain.post("/v1/chat/completions",
                                         json=_body(plain, llm, seed))).json()
        message = answer["choices"][0]["message"]
        assert "reasoning" not in message  # without the flag nothing changes
        raws.append(message["content"])
    await stop_app(plain)
    client = await start_app(aiohttp_client, llm, reasoning_parser=parser)
    wholes, streams = [], []
    for seed in seeds:
        response = await client.post("/v1/chat/completions", json=_body(
            client, llm, seed, **extra))
        assert response.status == 200, await response.text()
        wholes.append(await response.json())
        response = await client.post("/v1/chat/completions", json=_body(
            client, llm, seed, stream=True, stream_options={"include_usage": True}, **extra))
        streams.append([json.loads(line[6:]) for line in (await response.text()).splitlines()
                        if line.startswith("data: {")])
    return client, raws, wholes, streams


def _expected(parser: str, raw: str) -> tuple[str | None, str | None]:
    body = raw.replace("<think>", "", raw.split("</think>")[0].count("<think>")) \
        if "</think>" in raw else raw.replace("<think>", "")
    if "</think>" not in raw:
        return body or None, None
    reasoning, _, content = raw.partition("</think>")
    reasoning = reasoning.replace("<think>", "")
    if parser == "qwen3":
        content = content.replace("</think>", "")
    return reasoning or None, content or None


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
async def test_whole_and_streamed_answers_split_the_raw_text(aiohttp_client, llm, parser):
    client, raws, wholes, streams = await _raw_and_split(aiohttp_client, llm, parser)
    assert any("</think>" in r for r in raws) and any(r.partition("</think>")[2] for r in raws)
    for raw, whole, events in zip(raws, wholes, streams, strict=True):
        message = whole["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == _expected(parser, raw), raw
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        streamed = ("".join(d.get("reasoning") or "" for d in deltas),
                    "".join(d.get("content") or "" for d in deltas))
        assert streamed == (message["reasoning"] or "", message["content"] or "")
        details = whole["usage"]["completion_tokens_details"]
        assert events[-1]["usage"]["completion_tokens_details"] == details
        if parser == "qwen3" and message["reasoning"]:
            assert details["reasoning_tokens"] > 0
    await stop_app(client)


async def test_include_reasoning_false_drops_it(aiohttp_client, llm):
    client, raws, wholes, streams = await _raw_and_split(
        aiohttp_client, llm, "qwen3", seeds=range(3), include_reasoning=False)
    for raw, whole, events in zip(raws, wholes, streams, strict=True):
        assert whole["choices"][0]["message"]["reasoning"] is None
        assert whole["choices"][0]["message"]["content"] == _expected("qwen3", raw)[1]
        assert not any(e["choices"][0]["delta"].get("reasoning") for e in events if e["choices"])
    await stop_app(client)


async def test_include_reasoning_needs_a_parser_and_no_thinking_constrains_all(aiohttp_client, llm):
    plain = await start_app(aiohttp_client, llm)
    response = await plain.post("/v1/chat/completions", json={
        "model": model_name(plain), "messages": ASK, "include_reasoning": False})
    assert response.status == 400
    assert (await response.json())["error"]["param"] == "include_reasoning"
    await stop_app(plain)
    client = await start_app(aiohttp_client, llm, reasoning_parser="qwen3")
    fmt = {"type": "json_object"}
    # Qwen3 without thinking: all content, the constraint from the first token as in vLLM
    # (with thinking it applies after the reasoning: test_reasoning_grammar.py)
    response = await client.post("/v1/chat/completions", json={
        "model": model_name(client), "messages": ASK, "max_tokens": 4, "response_format": fmt,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert response.status == 200, await response.text()
    message = (await response.json())["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"].lstrip().startswith("{")
    await stop_app(client)


async def test_responses_put_the_reasoning_in_its_own_item(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, reasoning_parser="deepseek_r1")
    # deepseek_r1: the answer starts in reasoning, so without a </think> it is all
    # reasoning; no message item beside it, as vLLM builds them (it has no text)
    body = {"model": model_name(client), "input": "Why is the sky blue?",
            "max_output_tokens": 12, "temperature": 0}
    response = await client.post("/v1/responses", json=body)
    answer = await response.json()
    assert response.status == 200, answer
    [item] = answer["output"]
    assert item["type"] == "reasoning" and item["status"] == "completed"
    thought = item["content"][0]["text"]
    assert thought and "</think>" not in thought
    assert answer["usage"]["output_tokens_details"]["reasoning_tokens"] == 0  # no <think>
    await stop_app(client)


async def test_a_model_without_the_markers_is_refused(aiohttp_client, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    with pytest.raises(BadInput, match="--reasoning-parser qwen3"):
        await start_app(aiohttp_client, llm, reasoning_parser="qwen3")
