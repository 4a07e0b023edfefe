"""Requests byte for byte as today's client libraries send them, pointed at kvledger as at
vLLM 0.32: LiteLLM 1.110 (``hosted_vllm/`` and ``openai/``), LangChain's ``ChatOpenAI``
1.8, the OpenAI Agents SDK 0.25 and ``openai`` 3.63. The bodies are the ones a recording
proxy saw them send; the libraries themselves are not needed."""

from __future__ import annotations

import pytest
from _server_helpers import make_llm, model_name, start_app

# What the template under test shows of the variables a chat's fields set.
SHOWS_EFFORT = ("{{ bos_token }}effort={{ reasoning_effort | default('unset') }} "
                "thinking={{ enable_thinking | default('unset') }}"
                "{% for m in messages %}|{{ m['content'] }}{% endfor %}")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


async def _chat(client, **body) -> tuple[int, dict]:
    response = await client.post("/v1/chat/completions", json={
        "model": model_name(client), "messages": [{"role": "user", "content": "hi"}], **body})
    return response.status, await response.json()


async def test_reasoning_effort_as_the_libraries_send_it_is_served(aiohttp_client, llm):
    """``litellm.completion(..., reasoning_effort="low")``, ``ChatOpenAI(reasoning_effort=
    "low")`` and the Agents SDK's ``ModelSettings(reasoning=Reasoning(effort="low"))`` on
    chat completions: vLLM 0.32 serves them; kvledger answered 400 "'reasoning_effort' is
    not supported by this server"."""
    client = await start_app(aiohttp_client, llm)
    litellm = {"max_tokens": 8, "reasoning_effort": "low"}
    langchain = {"stream": False, "max_completion_tokens": 8, "reasoning_effort": "low"}
    for body in (litellm, langchain, {"max_tokens": 2, "reasoning_effort": None}):
        status, answer = await _chat(client, **body)
        assert status == 200, answer
        assert answer["choices"][0]["message"]["role"] == "assistant"
    status, answer = await _chat(client, max_tokens=2, reasoning_effort="extreme")
    assert status == 400 and answer["error"]["param"] == "reasoning_effort", answer


async def test_reasoning_effort_reaches_the_template_as_vllm_passes_it(aiohttp_client, llm):
    """As vLLM 0.32's ``build_chat_params``: the effort is the template's
    ``reasoning_effort`` (over a ``chat_template_kwargs`` entry) and sets Qwen3's
    ``enable_thinking`` (false for "none") unless the request's own
    ``chat_template_kwargs`` names it; either over the server's defaults."""
    client = await start_app(aiohttp_client, llm, trust_request_chat_template=True,
                             default_chat_template_kwargs={"enable_thinking": False})

    async def rendered(**body) -> list[int]:
        status, answer = await _chat(client, chat_template=SHOWS_EFFORT, max_tokens=1,
                                     return_token_ids=True, **body)
        assert status == 200, answer
        return answer["prompt_token_ids"]

    def tokens(text: str) -> list[int]:
        return llm.tokenizer.encode("<s>" + text + "|hi", add_special_tokens=False)

    cases = [({}, "effort=unset thinking=False"),
             ({"reasoning_effort": "high"}, "effort=high thinking=True"),
             ({"reasoning_effort": "none"}, "effort=none thinking=False"),
             ({"reasoning_effort": "low", "chat_template_kwargs": {
                 "enable_thinking": False, "reasoning_effort": "medium"}},
              "effort=low thinking=False")]
    for body, shown in cases:
        assert await rendered(**body) == tokens(shown), (body, shown)
