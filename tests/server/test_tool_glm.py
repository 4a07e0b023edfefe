"""glm45 (glm47): GLM's <tool_call> with <arg_key>/<arg_value> pairs read as vLLM 0.32's
parser reads a whole answer (each case's answer is vLLM's own, with the request's tools:
names checked against them, values typed by their schemas, content stripped when a call
is made and dropped after it), streams that add up to the whole at every split, and
``required``/named calls written in GLM's format by a tiny model whose tokenizer holds
GLM's markers as added tokens, through the SDK."""

from __future__ import annotations

import json

import openai
import pytest
from _tool_sdk import marker_llm, named_round_trip, read_whole, required_round_trip
from _tool_streams import split_once_everywhere
from test_tool_calls_sdk import ASK, TOOLS, _streamed

from kvledger.engine.server.tools.calls import template_parser
from kvledger.engine.server.tools.glm_format import (
    CALL_END,
    CALL_START,
    KEY_END,
    KEY_START,
    MARKERS,
    VALUE_END,
    VALUE_START,
)
from kvledger.engine.server.tools.parsers import CallScanner
from kvledger.engine.server.tools.protocol import Tool

DECLARED = [Tool.model_validate(t) for t in [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "deep": {"type": "object", "properties": {"n": {"type": "number"}}},
            "flag": {"type": "boolean"}, "maybe": {"type": ["integer", "null"]}}}}},
    {"type": "function", "function": {"name": "get_time"}},
    {"type": "function", "function": {"name": "ns.tool", "parameters": {
        "type": "object", "properties": {"q": {"type": "number"}}}}}]]


def kv(key: str, value: str, between: str = "\n") -> str:
    return f"{KEY_START}{key}{KEY_END}{between}{VALUE_START}{value}{VALUE_END}\n"


C, E = CALL_START, CALL_END
CASES = [  # text, with the tools declared, content, calls: as vLLM 0.32's parser answers
    ("Let me check.\n" + C + "get_weather\n" + kv("city", "Paris") + kv("days", "3") + E, True,
     "Let me check.", [("get_weather", '{"city": "Paris", "days": 3}')]),
    # content stripped at both ends once a call is made, text after the first call dropped
    ("\nI'll look. " + C + "get_time\n" + E + "\n" + C + "ns.tool\n" + kv("q", "1.5") + E
     + " bye", True, "I'll look.", [("get_time", "{}"), ("ns.tool", '{"q": 1.5}')]),
    ("\nNo call here.", True, "\nNo call here.", []),
    # an undeclared name makes no call: its text goes, the text around it stays content
    ("Hi " + C + "unknown_tool\n" + kv("a", "1") + E + " there", True, "Hi  there", []),
    ("Hi " + C + "unknown_tool" + E + " there" + C + "get_time" + E, True, "Hi",
     [("get_time", "{}")]),
    # keys stripped, values as written; a key runs to the </arg_key> that <arg_value> follows
    (C + "get_weather\n" + kv(" city ", " Paris ") + kv("days", "3", "  x") + kv("city", "Rome")
     + E, True, "", [("get_weather", '{"city": " Paris ", "days</arg_key>  x<arg_value>3'
                                     '</arg_value>\\n<arg_key>city": "Rome"}')]),
    # no name before the pairs: the first "name": "..." in them names the call
    (C + KEY_START + '"name": "get_time"' + KEY_END + VALUE_START + "1" + VALUE_END + E, True,
     "", [("get_time", '{"\\"name\\": \\"get_time\\"": "1"}')]),
    # typed by the schema (an object's own properties are not); a call left open is read
    (C + "get_weather\n" + kv("deep", '{"n": "2"}') + kv("flag", "1") + kv("maybe", "null"),
     True, "", [("get_weather", '{"deep": {"n": "2"}, "flag": true, "maybe": null}')]),
    ("<think>hm</think>" + C + "anything" + E, False, "<think>hm</think>",
     [("anything", "{}")]),  # no tools declared: any name; no reasoning parser: text
    (C + "get_weather" + KEY_START + "city" + KEY_END + VALUE_START + "a" + KEY_END + "b" + E,
     True, "", [("get_weather", "{}")]),  # an unclosed value is no pair
]


def _scanner(declared: bool) -> CallScanner:
    return CallScanner("glm45", tools=DECLARED if declared else ())


@pytest.mark.parametrize(("text", "declared", "content", "calls"), CASES)
def test_whole_answers_read_as_vllm_reads_them(text, declared, content, calls) -> None:
    scanner = _scanner(declared)
    assert read_whole(scanner, text) == (content, calls)


@pytest.mark.parametrize(("text", "declared", "content", "calls"), CASES)
def test_a_stream_adds_up_to_the_whole_answer_at_every_split(text, declared, content,
                                                             calls) -> None:
    for cut, got_content, got_calls in split_once_everywhere(lambda: _scanner(declared), text):
        assert (got_content.rstrip(), got_calls) == (content, calls), cut


def test_content_streams_unless_the_answer_begins_blank() -> None:
    scanner = _scanner(True)
    assert scanner.feed("Sure, let me", False) == ["Sure, let me"]
    blank = _scanner(True)
    assert blank.feed("\nSure, let me", False) == []  # stripped only if a call is made
    assert blank.feed("\nSure, let me" + C + "get_time" + E, True)[0] == "Sure, let me"


def test_the_template_chooses_the_format() -> None:
    template = "{% for tc in tool_calls %}<tool_call>{{ tc.name }}<arg_key>{{ k }}</arg_key>"
    assert template_parser(template) == "glm45"
    assert template_parser("<tool_call>{{ tool_call | tojson }}</tool_call>") == "hermes"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return marker_llm(tiny_llama_dir, tmp_path_factory, "glm", list(MARKERS))


@pytest.mark.parametrize("parser", ["glm45", "glm47"])
async def test_required_calls_are_written_and_read_in_glm_format(sdk_serve, llm,
                                                                 parser) -> None:
    await required_round_trip(sdk_serve, llm, parser, CALL_START)


async def test_a_named_function_is_called_once(sdk_serve) -> None:
    await named_round_trip(sdk_serve, "glm47")


async def test_auto_reads_what_the_model_wrote(sdk_serve, llm) -> None:
    """A grammar makes the model write a call (its markers as their own tokens; ``auto``
    leaves the output free): read back with ``3`` typed by the schema."""
    name, client = await sdk_serve(enable_auto_tool_choice=True, tool_call_parser="glm45")
    ids = {m: llm.tokenizer.added_token_id(m) for m in MARKERS}

    def pair(key: str, value: str) -> str:
        return (f'<[{ids[KEY_START]}]> "{key}" <[{ids[KEY_END]}]> "\\n" <[{ids[VALUE_START]}]> '
                f'{value} <[{ids[VALUE_END]}]> "\\n"')
    grammar = (f'start: "Sure.\\n" <[{ids[CALL_START]}]> "get_weather\\n" '
               + pair("city", '("Paris" | "Rome")') + " " + pair("unit", '"celsius"') + " "
               + pair("days", '"3"') + f" <[{ids[CALL_END]}]>")
    body = {"model": name, "messages": ASK, "tools": TOOLS, "max_tokens": 120,
            "extra_body": {"structured_outputs": {"grammar": grammar}}}
    for choice in [(await client.chat.completions.create(**body)).choices[0],
                   await _streamed(client, **body)]:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Sure."
        [call] = choice.message.tool_calls
        assert json.loads(call.function.arguments)["days"] == 3


async def test_a_schema_the_format_cannot_write_is_a_400(sdk_serve) -> None:
    name, client = await sdk_serve(tool_call_parser="glm45")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"when": {"type": "string", "format": "date"}}}}}]
    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(model=name, messages=ASK, tools=tools,
                                             tool_choice="required", max_tokens=4)
    assert "'tools[0].function.parameters.properties.when' (f): a glm45 string is " \
        "written bare" in error.value.message
