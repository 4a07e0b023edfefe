"""vLLM's other think-tag --reasoning-parser rules over HTTP, on a tiny model whose
tokenizer holds GLM's and Magistral's markers as added tokens: GLM's (reasoning opened
again by a later ``<think>``, ``<tool_call>`` ending it, its trailing whitespace cut),
Magistral's (content until ``[THINK]``), Step3's (an end marker alone) and DeepSeek-V3's
(thinking only when the chat asks). Random weights write the markers when
``allowed_token_ids`` leaves few others; the same seeded request on a server without the
flag gives the raw text, split here by the rule as vLLM 0.32's parser reads it."""

from __future__ import annotations

import json
import re

import pytest
from _server_helpers import make_llm, model_name, start_app, stop_app, with_added_tokens

MARKERS = ["<think>", "</think>", "<tool_call>", "[THINK]", "[/THINK]", "[TOOL_CALLS]"]
ASK = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    model = with_added_tokens(tiny_llama_dir, tmp_path_factory.mktemp("think") / "model",
                              MARKERS)
    return make_llm(model, max_model_len=512, num_gpu_blocks_override=128)


def _body(client, llm, seed: int, markers: list[str], **extra):
    tok = llm.tokenizer
    allowed = [tok.token_to_id(m) for m in markers] + tok.encode(
        " sky blue\n light", add_special_tokens=False)
    return {"model": model_name(client), "messages": ASK, "max_tokens": 24, "seed": seed,
            "temperature": 1.0, "allowed_token_ids": allowed, **extra}


def _split(rule: str, raw: str) -> tuple[str | None, str | None]:
    """``raw`` as vLLM's parser splits it, marker by marker (the markers are the only
    tokens that write ``<``, ``[``)."""
    reasoning, content = "", ""
    start, end, call, reopens, in_reasoning = {
        "glm45": ("<think>", "</think>", "<tool_call>", True, True),
        "mistral": ("[THINK]", "[/THINK]", "[TOOL_CALLS]", True, False),
        "step3": (None, "</think>", None, False, True),
        "deepseek_v3": ("<think>", "</think>", None, False, True)}[rule]
    for piece in re.split(r"(<think>|</think>|<tool_call>|\[THINK\]|\[/THINK\]|"
                          r"\[TOOL_CALLS\])", raw):
        if in_reasoning and piece in (end, call):
            in_reasoning = False
            content += piece if piece == call else ""
        elif in_reasoning:
            reasoning += "" if piece == start else piece
        elif reopens and piece == start:
            in_reasoning = True
        elif not (reopens and piece == end):  # GLM's and Magistral's grammars drop it
            content += piece
    if rule in ("glm45", "mistral"):
        reasoning = reasoning.rstrip()
    return reasoning or None, content or None


async def _answers(aiohttp_client, llm, parser: str, markers: list[str], **extra):
    """Each seed's raw text (no flag), then its whole and streamed answers with it."""
    plain = await start_app(aiohttp_client, llm)
    raws = []
    for seed in range(5):
        answer = await (await plain.post("/v1/chat/completions",
                                         json=_body(plain, llm, seed, markers))).json()
        raws.append(answer["choices"][0]["message"]["content"] or "")
    await stop_app(plain)
    client = await start_app(aiohttp_client, llm, reasoning_parser=parser)
    answers = []
    for seed, raw in enumerate(raws):
        body = _body(client, llm, seed, markers, **extra)
        whole = await (await client.post("/v1/chat/completions", json=body)).json()
        text = await (await client.post("/v1/chat/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}})).text()
        events = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: {")]
        answers.append((raw, whole, events))
    await stop_app(client)
    return answers


def _check(answers, rule: str) -> None:
    for raw, whole, events in answers:
        message = whole["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == _split(rule, raw), raw
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        assert ("".join(d.get("reasoning") or "" for d in deltas),
                "".join(d.get("content") or "" for d in deltas)) == (
            message["reasoning"] or "", message["content"] or "")
        assert events[-1]["usage"]["completion_tokens_details"] == \
            whole["usage"]["completion_tokens_details"]


@pytest.mark.parametrize(("parser", "markers"), [
    ("glm45", ["<think>", "</think>", "<tool_call>"]),
    ("mistral", ["[THINK]", "[/THINK]", "[TOOL_CALLS]"]),
    ("step3", ["<think>", "</think>"]),
])
async def test_whole_and_streamed_answers_split_the_raw_text(aiohttp_client, llm, parser,
                                                             markers):
    answers = await _answers(aiohttp_client, llm, parser, markers)
    raws = [raw for raw, _, _ in answers]
    assert any(markers[1] in r for r in raws) and any(markers[0] in r for r in raws)
    _check(answers, parser)
    if parser == "glm45":  # the rule's own turns happened: reopened, trailing space cut
        assert any(r.count("<think>") and r.partition("</think>")[2].count("<think>")
                   for r in raws)


async def test_deepseek_v3_thinks_only_when_the_chat_asks(aiohttp_client, llm):
    markers = ["<think>", "</think>"]
    for raw, whole, _ in await _answers(aiohttp_client, llm, "deepseek_v3", markers):
        message = whole["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == (None, raw or None)
        assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    asked = await _answers(aiohttp_client, llm, "deepseek_v3", markers,
                           chat_template_kwargs={"thinking": True})
    assert any(whole["choices"][0]["message"]["reasoning"] for _, whole, _ in asked)
    _check(asked, "deepseek_v3")


async def test_a_model_without_magistrals_call_marker_is_refused(aiohttp_client,
                                                                 tiny_llama_dir, tmp_path):
    from kvledger.engine.errors import BadInput

    model = with_added_tokens(tiny_llama_dir, tmp_path / "model", ["[THINK]", "[/THINK]"])
    with pytest.raises(BadInput, match=r"--reasoning-parser mistral: .*\[TOOL_CALLS\]"):
        await start_app(aiohttp_client, make_llm(model), reasoning_parser="mistral")
