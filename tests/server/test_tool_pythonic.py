"""pythonic and llama4_pythonic calls (Llama 3.2, Llama 4: ``[get_weather(city="Paris")]``)
read back as vLLM 0.32 reads a whole answer, the same streamed, and the grammar of
``required``/a named function, without a model. The expected calls are vLLM 0.32's own
(its parsers run on the same texts)."""

from __future__ import annotations

import ast
import json
import re

import pytest
from _tool_streams import assembled

from kvledger.engine.server.tools.calls import tool_plan
from kvledger.engine.server.tools.parsers import CallScanner, ToolCall
from kvledger.engine.server.tools.protocol import Tool
from kvledger.engine.server.validation import Refusal

WEATHER = ("get_weather", '{"city": "Paris"}')
CASES = [  # text, calls (None: the whole answer is content), as vLLM 0.32 reads them
    ("[get_weather(city='San Francisco', metric='celsius')]",
     [("get_weather", '{"city": "San Francisco", "metric": "celsius"}')]),
    ("[register_user(name='John Doe', age=37, address={'city': 'SF', 'state': 'CA'}, "
     "role=None, passed_test=True, aliases=['John', 'Johnny'])]",
     [("register_user", '{"name": "John Doe", "age": 37, "address": {"city": "SF", '
                        '"state": "CA"}, "role": null, "passed_test": true, '
                        '"aliases": ["John", "Johnny"]}')]),
    ("[get_weather(), do_something_cool(additional_data={}, steps=[])]",
     [("get_weather", "{}"), ("do_something_cool", '{"additional_data": {}, "steps": []}')]),
    (r"""[get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')]""",
     [("get_weather", '{"city": "Martha\'s Vineyard", "metric": "\\"cool units\\""}')]),
    ("[move(dx=-1.5, dy=+2, size=(800, 600), tags={'a'}, label=f'x', ok=true, none=null)]",
     [("move", '{"dx": -1.5, "dy": 2, "size": [800, 600], "tags": ["a"], "label": "x", '
               '"ok": true, "none": null}')]),
    ("[get_weather(city='Paris')]\nfoo", [WEATHER]),  # what follows is Python: dropped
    ("[get_weather(city='Paris')]\nThat is all.", None),  # ... not Python: all content
    (" [get_weather(city='Paris')]", None),  # a call list starts the answer
    ("[tools.search.run(query='x')]", None),  # the pattern wants a plain first name
    ("[get_weather('Paris')]", None),  # a positional argument
    ("[get_weather(city=b'Paris')]", None),  # not JSON
    ("[get_weather(city=unknown)]", None),  # not a literal
    ("[docs](https://example.com) say so", None),
    ("How can I help you today?", None),
    ("[get_weather(city='Par", None),  # cut off
    ("<|python_start|>[get_weather(city='Paris')]<|python_end|>", None),  # pythonic's
]


def _read(parser: str, text: str, cuts: list[int], max_calls: int | None = None):
    scanner, pieces = CallScanner(parser, max_calls), []
    for n, end in enumerate(cuts):
        pieces += scanner.feed(text[:end], final=n == len(cuts) - 1)
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", piece.id)  # vLLM's ids
               for piece in pieces if isinstance(piece, ToolCall))
    content, calls, _ = assembled(pieces)
    return content, calls


@pytest.mark.parametrize(("text", "calls"), CASES)
@pytest.mark.parametrize("parser", ["pythonic", "llama4_pythonic"])
def test_calls_are_read_as_vllm_reads_them_whole_and_streamed(parser, text, calls) -> None:
    if parser == "llama4_pythonic" and text.startswith("<|python_start|>"):
        calls = [WEATHER]  # its markers dropped first
    expected = ("", calls) if calls is not None else (text.rstrip(), [])
    assert _read(parser, text, [len(text)]) == expected
    assert _read(parser, text, list(range(1, len(text) + 1))) == expected
    assert _read(parser, text, [len(text) // 3, len(text) // 2, len(text)]) == expected


def test_content_streams_at_once_when_it_cannot_be_calls() -> None:
    for text, held in (("Sure, here it is.", 1), ("[docs](x) and more", 6),
                       ("[get_weather(city='Paris')] and more", 40)):
        scanner, out = CallScanner("pythonic"), []
        for end in range(1, len(text) + 1):
            out.append("".join(p for p in scanner.feed(text[:end], end == len(text))
                               if isinstance(p, str)))
        assert "".join(out) == text
        assert next(i for i, piece in enumerate(out) if piece) + 1 == min(held, len(text))


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = "[get_weather(city='Paris'), get_time()]"
    assert _read("pythonic", text, [len(text)], max_calls=1) == ("", [WEATHER])


TOOLS = [Tool.model_validate(t) for t in [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]},
            "unit": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time"}}]]


def test_the_grammar_writes_keyword_arguments_in_order() -> None:
    plan = tool_plan(TOOLS, "required", True, auto_enabled=False, parser="pythonic",
                     chat_template=None)
    lines = plan.grammar.splitlines()
    assert lines[0] == 'start: "[" call (", " call)* "]"'
    assert 'call_0: "get_weather(" a_0_first_0 ")"' in lines
    assert 'call_1: "get_time(" ")"' in lines
    assert "a_0_first_0: p_0_0 a_0_rest_1" in lines  # city first, and always
    assert 'a_0_rest_1: (", " p_0_1)? a_0_rest_2' in lines
    assert 'p_0_2: "days=" v_0_2' in lines
    single = tool_plan(TOOLS, "required", False, auto_enabled=False, parser="llama4_pythonic",
                       chat_template=None)
    assert single.grammar.startswith('start: "[" call "]"\n') and single.max_calls == 1


def test_json_values_are_python_literals_of_the_same_value() -> None:
    """The grammar writes each value as %json: JSON's literals read back through Python
    (true, false, null as vLLM names them; the escapes llguidance writes) are the same."""
    for value in ['"a\\"b\\\\c\\n\\t\\u0001é"', "-12", "1.5e-3", "true", "null",
                  '{"k": [1, {"x": false}]}']:
        text = f"[f(v={value})]"
        [(_, arguments)] = _read("pythonic", text, [len(text)])[1]
        assert json.loads(arguments) == {"v": json.loads(value)}
        assert ast.parse(text)  # what vLLM parses


@pytest.mark.parametrize(("tool", "message"), [
    ({"name": "get-time"}, "'tools[0].function.name' 'get-time': a pythonic call's name is "
     "a Python name"),
    ({"name": "f", "parameters": {"type": "object", "properties": {"from": {}}}},
     "'tools[0].function.parameters.properties.from' (f): a pythonic call's keyword "
     "argument is a Python name (not a keyword)"),
    ({"name": "f", "parameters": {"type": "object", "properties": {}, "required": ["x"]}},
     "'tools[0].function.parameters' (f): 'required' names 'x', which 'properties' does "
     "not declare"),
])
def test_what_the_format_cannot_write_is_refused_by_name(tool, message) -> None:
    with pytest.raises(Refusal, match=re.escape(message)):
        tool_plan([Tool.model_validate({"type": "function", "function": tool})], "required",
                  True, auto_enabled=False, parser="pythonic", chat_template=None)
