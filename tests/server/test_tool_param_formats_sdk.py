"""qwen3_coder's and pythonic's calls through the official ``openai`` SDK, whole and
streamed, on a tiny model whose tokenizer holds ``<tool_call>`` and ``</tool_call>`` as
added tokens, as Qwen3-Coder's does (random weights: only the grammar makes its calls
well-formed)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from _server_helpers import make_llm, with_added_tokens
from test_tool_calls_sdk import ASK, SCHEMAS, TOOLS, _streamed

VLLM_ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{16}$")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    out = with_added_tokens(tiny_llama_dir, tmp_path_factory.mktemp("qwen3-coder") / "model",
                            ["<tool_call>", "</tool_call>"])
    return make_llm(out, max_model_len=1024, num_gpu_blocks_override=256)


def _check(choice, finish_reason: str = "tool_calls") -> None:
    """Every call names a declared function, its arguments validate, its id is vLLM's."""
    assert choice.finish_reason == finish_reason
    assert choice.message.tool_calls and not choice.message.content
    for call in choice.message.tool_calls:
        assert VLLM_ID.match(call.id), call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _calls(choice) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


@pytest.mark.parametrize("parser", ["qwen3_coder", "pythonic"])
@pytest.mark.parametrize("seed", [0, 1])
async def test_required_calls_validate_whole_and_streamed(sdk_serve, llm, parser, seed) -> None:
    name, client = await sdk_serve(tool_call_parser=parser)
    body = {"model": name, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 300, "seed": seed, "temperature": 1.0, "parallel_tool_calls": False}
    whole = (await client.chat.completions.create(**body)).choices[0]
    streamed = await _streamed(client, **body)
    for choice in (whole, streamed):
        _check(choice)
        assert len(choice.message.tool_calls) == 1  # parallel_tool_calls false: one
    assert _calls(streamed) == _calls(whole)
    if parser == "qwen3_coder":  # the model wrote the marker's own token
        again = await client.chat.completions.create(**body, logprobs=True)
        first = again.choices[0].logprobs.content[0].token
        assert llm.tokenizer.token_to_id(first) == llm.tokenizer.added_token_id("<tool_call>")


@pytest.mark.parametrize("parser", ["qwen3_xml", "llama4_pythonic"])
async def test_a_named_function_is_called_once(sdk_serve, parser) -> None:
    name, client = await sdk_serve(tool_call_parser=parser)
    body = {"model": name, "messages": ASK, "tools": TOOLS, "max_tokens": 200,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "seed": 3, "temperature": 1.0}
    whole = (await client.chat.completions.create(**body)).choices[0]
    streamed = await _streamed(client, **body)
    for choice in (whole, streamed):
        _check(choice, "stop")  # a named function's, as OpenAI's and vLLM's
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    assert _calls(streamed) == _calls(whole)


async def test_parallel_calls_stream_into_the_whole_answer(sdk_serve) -> None:
    name, client = await sdk_serve(tool_call_parser="qwen3_coder")
    body = {"model": name, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 400, "seed": 1, "temperature": 1.0}
    whole = (await client.chat.completions.create(**body)).choices[0]
    _check(whole)
    assert len(whole.message.tool_calls) > 1
    assert _calls(await _streamed(client, **body)) == _calls(whole)


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
