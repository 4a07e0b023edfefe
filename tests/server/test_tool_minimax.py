"""minimax_m2: MiniMax-M2's <minimax:tool_call> with <invoke name=...> calls and their
<parameter name=...> values, read as vLLM 0.32's parser reads a whole answer (each case's
answer is vLLM's own, with the request's tools: names checked against them, values typed
by their schemas, content stripped when a call is made), streams that add up to the whole
at every split, and ``required``/named calls written in MiniMax's format by a tiny model
whose tokenizer holds its wrapper tags as added tokens, through the SDK."""

from __future__ import annotations

import json

import openai
import pytest
from _tool_sdk import marker_llm, named_round_trip, read_whole, required_round_trip
from _tool_streams import split_once_everywhere
from test_tool_calls_sdk import ASK, TOOLS, _streamed
from test_tool_glm import DECLARED

from kvledger.engine.server.tools.calls import template_parser
from kvledger.engine.server.tools.minimax_format import CALLS_END, CALLS_START, MARKERS
from kvledger.engine.server.tools.parsers import CallScanner

S, E = CALLS_START, CALLS_END


def inv(name: str, *params: str, q: str = '"') -> str:
    return f"<invoke name={q}{name}{q}>\n" + "".join(params) + "</invoke>\n"


def p(key: str, value: str, q: str = '"') -> str:
    return f"<parameter name={q}{key}{q}>{value}</parameter>\n"


CASES = [  # text, with the tools declared, content, calls: as vLLM 0.32's parser answers
    ("Let me check.\n" + S + "\n" + inv("get_weather", p("city", "Paris"), p("days", "3")) + E,
     True, "Let me check.", [("get_weather", '{"city": "Paris", "days": 3}')]),
    # content stripped at both ends once a call is made, text after the first call dropped
    ("\nI'll look. " + S + inv("get_time") + inv("ns.tool", p("q", "1.5")) + E + " bye", True,
     "I'll look.", [("get_time", "{}"), ("ns.tool", '{"q": 1.5}')]),
    ("\nNo call here.", True, "\nNo call here.", []),
    # an undeclared name makes no call: its text goes, the text around it stays content
    ("Hi " + S + inv("unknown_tool", p("a", "1")) + E + " there", True, "Hi  there", []),
    # a name declared only once stripped: the call is made, the text after it kept
    ("Hi " + S + inv(" get_time ") + E + " there", True, "Hi  there", [("get_time", "{}")]),
    # keys quoted either way or bare, stripped; values as written; a later key wins
    (S + inv("get_weather", p(" city ", " Paris ", "'"), p("days", "3", ""), p("city", "Rome"))
     + E, True, "", [("get_weather", '{"city": "Rome", "days": 3}')]),
    # a value ends at the next <parameter name=; a call needs no closing wrapper
    (S + "<invoke name=get_weather><parameter name=city>a<parameter name='days'>4</invoke>"
     + E, True, "", [("get_weather", '{"city": "a"}')]),
    # no name: the first "name": "..." names it, else its text as a JSON call
    (S + '<invoke name="">{"name": "get_time"}</invoke>' + E, True, "", [("get_time", "{}")]),
    (S + '<invoke name=" ">{"name": "get_time", "arguments": {"x": 1}}</invoke>' + E, True,
     "", [("get_time", '{"x": 1}')]),
    # typed by the schema (an object's own properties are not); a call left open is read
    (S + inv("get_weather", p("deep", '{"n": "2"}'), p("flag", "1"), p("maybe", "null")),
     True, "", [("get_weather", '{"deep": {"n": "2"}, "flag": true, "maybe": null}')]),
    ("<think>hm</think>" + S + inv("anything") + E, False, "<think>hm</think>",
     [("anything", "{}")]),  # no tools declared: any name; no reasoning parser: text
    # the wrapper's end inside a call is its text; an <invoke needs no wrapper
    (S + '<invoke name="get_weather"><parameter name="city">x</parameter>' + E + "ok", True,
     "", [("get_weather", '{"city": "x"}')]),
    ('<invoke name="get_time"></invoke> after', True, "", [("get_time", "{}")]),
    ('a > b "c" ' + S + inv("get_time") + E, True, 'a > b "c"', [("get_time", "{}")]),
    # markers are cut longest first: <think>'s '>' does not end a name
    (S + '<invoke name="get<think>x"></invoke>' + E, False, "", [("get<think>x", "{}")]),
]


def _scanner(declared: bool) -> CallScanner:
    return CallScanner("minimax_m2", tools=DECLARED if declared else ())


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
    assert _scanner(True).feed("Sure, let me", False) == ["Sure, let me"]
    blank = _scanner(True)
    assert blank.feed("\nSure, let me", False) == []  # stripped only if a call is made
    assert blank.feed("\nSure, let me" + S + inv("get_time") + E, True)[0] == "Sure, let me"


def test_the_template_chooses_the_format() -> None:
    template = ("{{- '<minimax:tool_call>\\n' }}{%- for tc in message.tool_calls %}"
                "{{- '<invoke name=\"' + tc.name + '\">' }}")
    assert template_parser(template) == "minimax_m2"
    assert template_parser("<tool_call>{{ tool_call | tojson }}</tool_call>") == "hermes"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return marker_llm(tiny_llama_dir, tmp_path_factory, "minimax", list(MARKERS))


async def test_required_calls_are_written_and_read_in_minimax_format(sdk_serve, llm) -> None:
    await required_round_trip(sdk_serve, llm, "minimax_m2", S)


async def test_a_named_function_is_called_once(sdk_serve) -> None:
    await named_round_trip(sdk_serve, "minimax_m2")


async def test_auto_reads_what_the_model_wrote(sdk_serve, llm) -> None:
    """A grammar makes the model write a call (its wrapper tags as their own tokens;
    ``auto`` leaves the output free): read back with ``3`` typed by the schema."""
    name, client = await sdk_serve(enable_auto_tool_choice=True, tool_call_parser="minimax_m2")
    start, end = (llm.tokenizer.added_token_id(m) for m in MARKERS)
    grammar = (f'start: "Sure.\\n" <[{start}]> "<invoke name=\\"get_weather\\">\\n'
               '<parameter name=\\"city\\">" ("Paris" | "Rome") "</parameter>\\n'
               '<parameter name=\\"days\\">3</parameter>\\n</invoke>\\n" '
               f"<[{end}]>")
    body = {"model": name, "messages": ASK, "tools": TOOLS, "max_tokens": 120,
            "extra_body": {"structured_outputs": {"grammar": grammar}}}
    for choice in [(await client.chat.completions.create(**body)).choices[0],
                   await _streamed(client, **body)]:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Sure."
        [call] = choice.message.tool_calls
        assert json.loads(call.function.arguments)["days"] == 3


@pytest.mark.parametrize(("properties", "message"), [
    ({"when": {"type": "string", "format": "date"}},
     "'tools[0].function.parameters.properties.when' (f): a minimax_m2 string is written bare"),
    ({'say"x': {"type": "integer"}}, "a minimax_m2 parameter's name has no '<', '>' or quote"),
])
async def test_a_schema_the_format_cannot_write_is_a_400(sdk_serve, properties,
                                                         message) -> None:
    name, client = await sdk_serve(tool_call_parser="minimax_m2")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": properties}}}]
    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(model=name, messages=ASK, tools=tools,
                                             tool_choice="required", max_tokens=4)
    assert message in error.value.message
