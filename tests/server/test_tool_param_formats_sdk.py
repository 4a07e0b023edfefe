"""qwen3_coder's and pythonic's calls through the official ``openai`` SDK, whole and
streamed, on a tiny model whose tokenizer holds ``<tool_call>`` and ``</tool_call>`` as
added tokens, as Qwen3-Coder's does (random weights: only the grammar makes its calls
well-formed)."""

from __future__ import annotations

import json

import openai
import pytest
from _tool_sdk import VLLM_ID, checked_calls, marker_llm, named_round_trip
from test_tool_calls_sdk import ASK, TOOLS, _streamed


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return marker_llm(tiny_llama_dir, tmp_path_factory, "qwen3-coder",
                      ["<tool_call>", "</tool_call>"])


@pytest.mark.parametrize("parser", ["qwen3_coder", "pythonic"])
@pytest.mark.parametrize("seed", [0, 1])
async def test_required_calls_validate_whole_and_streamed(sdk_serve, llm, parser, seed) -> None:
    name, client = await sdk_serve(tool_call_parser=parser)
    body = {"model": name, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 300, "seed": seed, "temperature": 1.0, "parallel_tool_calls": False}
    whole = (await client.chat.completions.create(**body)).choices[0]
    streamed = await _streamed(client, **body)
    calls = checked_calls(whole)
    assert len(calls) == 1  # parallel_tool_calls false: one
    assert checked_calls(streamed) == calls
    if parser == "qwen3_coder":  # the model wrote the marker's own token
        again = await client.chat.completions.create(**body, logprobs=True)
        first = again.choices[0].logprobs.content[0].token
        assert llm.tokenizer.token_to_id(first) == llm.tokenizer.added_token_id("<tool_call>")


@pytest.mark.parametrize("parser", ["qwen3_xml", "llama4_pythonic"])
async def test_a_named_function_is_called_once(sdk_serve, parser) -> None:
    await named_round_trip(sdk_serve, parser)  # finish "stop", as OpenAI's and vLLM's


async def test_parallel_calls_stream_into_the_whole_answer(sdk_serve) -> None:
    name, client = await sdk_serve(tool_call_parser="qwen3_coder")
    body = {"model": name, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 400, "seed": 1, "temperature": 1.0}
    whole = (await client.chat.completions.create(**body)).choices[0]
    calls = checked_calls(whole)
    assert len(calls) > 1
    assert checked_calls(await _streamed(client, **body)) == calls


@pytest.mark.parametrize(("parser", "answer"), [
    ("qwen3_coder", r"Sure\.\n<function=get_weather>\n<parameter=city>\n(Paris|Rome)\n"
                    r"</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n"
                    r"<parameter=days>\n3\n</parameter>\n</function>"),
    ("pythonic", r'\[get_weather\(city="(Paris|Rome)", unit="celsius", days=3\)\]'),
])
async def test_auto_reads_what_the_model_wrote(sdk_serve, parser, answer) -> None:
    """A regex constraint makes the model write a call (``auto`` leaves the output free):
    the server reads it back, its values typed by the schema (qwen3_coder's ``3``)."""
    name, client = await sdk_serve(enable_auto_tool_choice=True, tool_call_parser=parser)
    body = {"model": name, "messages": ASK, "tools": TOOLS, "max_tokens": 120,
            "extra_body": {"structured_outputs": {"regex": answer}}}
    for choice in [(await client.chat.completions.create(**body)).choices[0],
                   await _streamed(client, **body)]:
        assert choice.finish_reason == "tool_calls"
        assert (choice.message.content or "") == ("Sure." if parser == "qwen3_coder" else "")
        [call] = choice.message.tool_calls
        assert VLLM_ID.match(call.id)
        arguments = json.loads(call.function.arguments)
        assert arguments["days"] == 3 and arguments["unit"] == "celsius"
    free = await client.chat.completions.create(model=name, messages=ASK, tools=TOOLS,
                                                max_tokens=8, tool_choice="auto")
    assert free.choices[0].message.tool_calls is None  # plain text stays text


@pytest.mark.parametrize(("parser", "parameters", "message"), [
    ("qwen3_coder", {"type": "object", "properties": {"when": {"type": "string", "format":
                                                               "date-time"}}},
     "'tools[0].function.parameters.properties.when' (f): a qwen3_coder string is written "
     "bare"),
    ("pythonic", {"type": "object", "properties": {"class": {"type": "string"}}},
     "'tools[0].function.parameters.properties.class' (f): a pythonic call's keyword"),
])
async def test_a_schema_the_format_cannot_write_is_a_400(sdk_serve, parser, parameters,
                                                         message) -> None:
    name, client = await sdk_serve(tool_call_parser=parser)
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(model=name, messages=ASK, tools=tools,
                                             tool_choice="required", max_tokens=4)
    assert message in error.value.message and error.value.body["param"] == "tools"
