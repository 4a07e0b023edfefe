"""Mistral's tool calls through the official ``openai`` SDK, whole and streamed, on tiny
models whose tokenizers hold ``[TOOL_CALLS]`` (and, v11, ``[ARGS]``) as special tokens:
the grammar makes the model write those very tokens, decoding for users drops them, and
the parser reads them in the text the engine keeps for it."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from _engine_helpers import drain
from _server_helpers import make_llm, start_sdk
from _tool_checkpoints import write_mistral_tools
from test_tool_calls_sdk import ASK, SCHEMAS, TOOLS, _streamed

from kvledger.engine.sampling.grammar import GrammarCompiler, GrammarSpec
from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.server.tools.calls import control_token_ids, tool_plan
from kvledger.engine.server.tools.protocol import Tool

MISTRAL_ID = re.compile(r"^[A-Za-z0-9]{9}$")


@pytest.fixture(scope="module", params=["v3", "v11"])
def mistral_llm(request, make_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mistral-tools") / request.param
    model_dir = write_mistral_tools(make_model_dir("tiny-mistral"), out,
                                    v11=request.param == "v11")
    return request.param, make_llm(model_dir, max_model_len=512, num_gpu_blocks_override=128)


@pytest.fixture
async def serve(aiohttp_server, mistral_llm):
    version, llm = mistral_llm
    clients = []

    async def start(**options):
        return await start_sdk(aiohttp_server, llm, clients, **options)

    yield version, llm, start
    for client in clients:
        await client.close()


def _check(choice, finish_reason: str = "tool_calls") -> None:
    assert choice.finish_reason == finish_reason
    assert not choice.message.content  # no [TOOL_CALLS], no </s>: no other text
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert MISTRAL_ID.match(call.id), call.id  # Mistral's ids, as vLLM's
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [3, 4])
async def test_required_calls_are_written_and_read_in_mistral_format(serve, seed) -> None:
    """No --tool-call-parser: the template's [TOOL_CALLS] chooses mistral."""
    _, llm, start = serve
    name, client = await start()
    body = {"model": name, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 110, "seed": seed, "temperature": 1.0}
    whole = (await client.chat.completions.create(**body)).choices[0]
    streamed = await _streamed(client, **body)
    for choice in (whole, streamed):
        _check(choice)
    assert whole.message.content is None
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    # The model wrote the special token itself (not its spelling in ordinary tokens).
    tokenizer = llm.tokenizer
    again = await client.chat.completions.create(**body, logprobs=True)
    first = again.choices[0].logprobs.content[0]
    assert tokenizer.token_to_id(first.token) == tokenizer.special_token_id("[TOOL_CALLS]")


async def test_a_named_function_and_the_round_trip(serve) -> None:
    _, _, start = serve
    name, client = await start(tool_call_parser="mistral")
    first = await client.chat.completions.create(
        model=name, messages=ASK, tools=TOOLS, max_tokens=100, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False)
    _check(first.choices[0], "stop")  # a named function's, as OpenAI's and vLLM's
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    messages = [*ASK, first.choices[0].message.model_dump(),  # its nulls and all, as SDKs send
                {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    second = await client.chat.completions.create(  # the template takes the 9-char id
        model=name, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4,
        extra_body={"ignore_eos": True})
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    messages[1]["tool_calls"][0]["id"] = "call_0123456789abcdef"
    with pytest.raises(openai.BadRequestError, match="length 9"):
        await client.chat.completions.create(model=name, messages=messages, max_tokens=4)


def test_auto_keeps_the_control_tokens_the_model_writes(mistral_llm) -> None:
    """``auto`` leaves the output free, so here the engine is driven directly: a grammar
    makes the model write text, the special [TOOL_CALLS] (and [ARGS]) tokens and a call;
    with the plan's kept tokens the text holds them, and the parser reads the call."""
    version, llm = mistral_llm
    tokenizer = llm.tokenizer
    specials = control_token_ids(tokenizer)
    plan = tool_plan([Tool.model_validate(TOOLS[1])], "auto", True, auto_enabled=True,
                     parser="mistral", chat_template=tokenizer.chat_template,
                     specials=specials)
    assert plan.kept_ids == frozenset(specials.values()) and plan.grammar is None
    call = (f'<[{specials["[TOOL_CALLS]"]}]> "[{{\\"name\\": \\"get_time\\", '
            f'\\"arguments\\": {{\\"zone\\": \\"UTC\\"}}}}]"' if version == "v3" else
            f'<[{specials["[TOOL_CALLS]"]}]> "get_time" <[{specials["[ARGS]"]}]> '
            f'"{{\\"zone\\": \\"UTC\\"}}"')
    compiler = GrammarCompiler(tokenizer, tokenizer.eos_token_ids,
                               llm.runner.config.vocab_size)
    grammar = compiler.compile(GrammarSpec("lark", f'start: "Sure. " {call}\n'))
    prompt = tokenizer.encode("[INST]What time is it?[/INST]")
    texts = {}
    for kept in (plan.kept_ids, frozenset()):
        params = SamplingParams(temperature=0, max_tokens=60, grammar=grammar,
                                kept_special_ids=kept)
        llm.add_request(f"auto-{len(texts)}", prompt, params)
        [output] = drain(llm).values()
        assert output.finish_reason == "stop"
        texts[kept] = output.text
    assert "[TOOL_CALLS]" not in texts[frozenset()]  # what users see without tools
    scanner = plan.scanner()
    scanner.feed(texts[plan.kept_ids], final=True)
    assert scanner.content == "Sure."
    assert [(c.name, c.arguments) for c in scanner.calls] == [("get_time", '{"zone": "UTC"}')]
    assert MISTRAL_ID.match(scanner.calls[0].id)
