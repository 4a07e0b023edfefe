"""Tool calling through the official ``openai`` SDK, whole and streamed, on the tiny model
(random weights: only the grammar makes its calls well-formed)."""

from __future__ import annotations

import json
import time

import aiohttp
import jsonschema
import openai
import pytest
from _server_helpers import make_llm

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_model_len=1024, num_gpu_blocks_override=256)


def _check_calls(calls) -> None:
    """Every call names a declared function, and its arguments validate."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def _streamed(client, **body):
    """The SDK's own assembly of a streamed answer (its snapshot: the final parse refuses
    an answer cut by max_tokens)."""
    async with client.chat.completions.stream(**body) as stream:
        async for _ in stream:
            pass
        return stream.current_completion_snapshot.choices[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_required_calls_validate_against_their_schemas(sdk_serve, seed) -> None:
    name, client = await sdk_serve()
    answer = await client.chat.completions.create(
        model=name, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
        seed=seed, temperature=1.0, parallel_tool_calls=False)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls false: at most one
    _check_calls(choice.message.tool_calls)


async def test_a_named_function_is_the_one_called_whole_and_streamed(sdk_serve) -> None:
    name, client = await sdk_serve()
    body = {"model": name, "messages": ASK, "tools": TOOLS, "max_tokens": 200,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "temperature": 0, "parallel_tool_calls": False}
    whole = (await client.chat.completions.create(**body)).choices[0]
    streamed = await _streamed(client, **body)
    for choice in (whole, streamed):
        assert choice.finish_reason == "stop"  # a named function's, as OpenAI's and vLLM's
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
        _check_calls(choice.message.tool_calls)
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
async def test_a_named_function_is_called_exactly_once(sdk_serve, seed) -> None:
    """parallel_tool_calls left at its default (true): a named choice is still one call
    (before: two or three get_time calls in 3 of 4 seeds)."""
    name, client = await sdk_serve()
    answer = await client.chat.completions.create(
        model=name, messages=ASK, tools=TOOLS, max_tokens=300, seed=seed, temperature=1.0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = answer.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    _check_calls(calls)


async def test_streamed_parallel_calls_assemble_into_the_whole_answer(sdk_serve) -> None:
    name, client = await sdk_serve()
    body = {"model": name, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 300, "seed": 7, "temperature": 1.0}
    whole = (await client.chat.completions.create(**body)).choices[0]
    streamed = await _streamed(client, **body)
    assert streamed.finish_reason == whole.finish_reason
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    _check_calls(whole.message.tool_calls)
    chunks = [chunk async for chunk in await client.chat.completions.create(**body, stream=True)]
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks
              if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].id and deltas[0].function.name and deltas[0].function.arguments == ""
    assert deltas[1].id is None and deltas[1].function.arguments  # then the arguments


async def test_a_call_cut_by_max_tokens_counts_them_all(sdk_serve) -> None:
    name, client = await sdk_serve()
    answer = await client.chat.completions.create(
        model=name, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=5)
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 5
    assert not answer.choices[0].message.tool_calls  # an unfinished call is no call


async def test_auto_parses_what_the_model_wrote(sdk_serve) -> None:
    """The model is made to write a hermes call by a regex constraint (``auto`` itself
    leaves the output free): the server reads it back as a call, whole and streamed."""
    name, client = await sdk_serve(enable_auto_tool_choice=True, tool_call_parser="hermes")
    regex = (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>')
    body = {"model": name, "messages": ASK, "tools": TOOLS, "max_tokens": 120,
            "extra_body": {"structured_outputs": {"regex": regex}}}
    for choice in [(await client.chat.completions.create(**body)).choices[0],
                   await _streamed(client, **body)]:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Sure."
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["unit"] == "celsius"
    chunks = [chunk async for chunk in await client.chat.completions.create(**body, stream=True)]
    fragments = [c.choices[0].delta.tool_calls[0].function.arguments for c in chunks
                 if c.choices and c.choices[0].delta.tool_calls]
    assert fragments[0] == "" and len(fragments) > 3  # named, then the arguments in pieces
    free = await client.chat.completions.create(model=name, messages=ASK, tools=TOOLS,
                                                max_tokens=8, tool_choice="auto")
    assert free.choices[0].message.tool_calls is None  # plain text stays text
    assert free.choices[0].message.content is not None


async def test_none_answers_text(sdk_serve) -> None:
    name, client = await sdk_serve()
    answer = await client.chat.completions.create(
        model=name, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=6,
        extra_body={"ignore_eos": True})
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason == "length"


async def test_the_round_trip_is_served(sdk_serve) -> None:
    name, client = await sdk_serve()
    first = await client.chat.completions.create(
        model=name, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
        parallel_tool_calls=False, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}]
    second = await client.chat.completions.create(
        model=name, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4,
        extra_body={"ignore_eos": True})
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.choices[0].finish_reason == "length"


@pytest.mark.parametrize(("body", "message"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "'tool_choice' names the function 'nope', which 'tools' does not declare"),
    ({"tool_choice": "required"}, "'tool_choice' needs 'tools'"),
    ({"tools": TOOLS}, "\"auto\" tool choice requires --enable-auto-tool-choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"},
     "'tools[0].function.parameters' (f): the schema cannot be compiled"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "constrains the output itself; drop response_format"),
])
async def test_bad_tool_requests_are_400s_naming_the_problem(sdk_serve, body, message) -> None:
    name, client = await sdk_serve()
    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(model=name, messages=ASK, max_tokens=4, **body)
    assert message in error.value.message


async def test_tokenize_counts_the_tools_as_chat_does(sdk_serve) -> None:
    name, client = await sdk_serve()
    chat = await client.chat.completions.create(model=name, messages=ASK, tools=TOOLS,
                                                tool_choice="none", max_tokens=1)
    url = str(client.base_url).removesuffix("/").removesuffix("/v1") + "/tokenize"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json={"messages": ASK, "tools": TOOLS}) as response:
            assert (await response.json())["count"] == chat.usage.prompt_tokens
        async with session.post(url, json={"prompt": "x", "tools": TOOLS}) as response:
            assert response.status == 400


async def test_tool_schemas_over_the_compile_time_limit_are_a_400(sdk_serve, monkeypatch) -> None:
    """A compile over the limit is a 400. The compile is held a second here: a fresh
    server's first one (which also builds the library's view of the tokenizer) takes tens
    of milliseconds, which a loaded machine could let it finish before the 0.1 ms wait
    was looked at."""
    from kvledger.engine.sampling.grammar import GrammarCompiler

    real = GrammarCompiler._compile

    def slow(self, spec):
        time.sleep(1.0)
        return real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    name, client = await sdk_serve(grammar_compile_timeout_s=0.0001)
    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(model=name, messages=ASK, max_tokens=4,
                                             tools=TOOLS, tool_choice="required")
    assert error.value.body["param"] == "tools"
    assert "--grammar-compile-timeout" in error.value.message


async def test_arguments_stream_in_fragments_as_they_are_generated(sdk_serve) -> None:
    """The name first, then the arguments in many deltas (about a token each), which the
    SDK assembles into the whole answer's call."""
    name, client = await sdk_serve()
    note = {"type": "object", "additionalProperties": False, "required": ["text"],
            "properties": {"text": {"type": "string", "pattern": "^[a-z ]{40,60}$"}}}
    tools = [{"type": "function", "function": {"name": "take_note", "parameters": note}}]
    body = {"model": name, "messages": ASK, "tools": tools, "tool_choice": "required",
            "max_tokens": 200, "temperature": 0, "parallel_tool_calls": False}
    whole = (await client.chat.completions.create(**body)).choices[0]
    [call] = whole.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), note)
    chunks = [chunk async for chunk in await client.chat.completions.create(**body, stream=True)]
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks
              if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].function.name == "take_note" and deltas[0].function.arguments == ""
    fragments = [d.function.arguments for d in deltas[1:]]
    assert len(fragments) > 10 and all(d.id is None and d.index == 0 for d in deltas[1:])
    assert "".join(fragments) == call.function.arguments
    streamed = await _streamed(client, **body)
    assert streamed.message.tool_calls[0].function.arguments == call.function.arguments
