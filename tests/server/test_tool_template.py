"""A tool-calling conversation as a request reads it (``protocol``) and as the built-in
chat template renders it, the same text as transformers renders from the same checkpoint."""

from __future__ import annotations

import pytest

from kvledger.engine.model.tokenizer import Tokenizer
from kvledger.engine.server.api_errors import ApiError
from kvledger.engine.server.protocol import parse_chat

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather <now> & here",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "24 C"},
]


def _chat(**body):
    return parse_chat({"model": "m", "messages": ROUND_TRIP, **body})


def test_the_round_trip_renders_as_transformers_renders_it(tiny_llama_dir) -> None:
    transformers = pytest.importorskip("transformers")
    req = _chat(tools=TOOLS, tool_choice="none")
    ours = Tokenizer(tiny_llama_dir).apply_chat_template(req.template_messages,
                                                         tools=req.template_tools)
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    assert ours == hf.apply_chat_template(req.template_messages, tools=req.template_tools,
                                          tokenize=False, add_generation_prompt=True)
    assert ours.startswith("<s><|system|>\nBe brief.\n\n# Tools\n")
    assert '"description": "The weather <now> & here"' in ours  # not HTML-escaped
    assert ('<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Rome"}}\n</tool_call><|end|>\n') in ours
    assert "<|user|>\n<tool_response>\n24 C\n</tool_response><|end|>\n<|assistant|>\n" in ours


def test_without_tools_the_template_renders_as_before(tiny_llama_dir) -> None:
    tok = Tokenizer(tiny_llama_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == \
        "<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"


def test_tool_defaults_follow_vllm() -> None:
    assert _chat().tool_choice == "none"
    assert _chat(tools=TOOLS).tool_choice == "auto"
    assert _chat(tools=TOOLS, tool_choice="required").calls_required
    assert _chat(tools=TOOLS, parallel_tool_calls=False).parallel_tool_calls is False
    assert _chat(parallel_tool_calls=False).tool_choice == "none"


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"tool_choice": "auto"}, "tool_choice", "'tool_choice' needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", "names the function 'f', which 'tools' does not declare"),
    ({"tools": TOOLS * 2}, "tools", "declares the function 'get_weather' twice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
     "a function name is 1 to 64"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", ""),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice",
     "drop guided_regex"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
     "messages[0].tool_call_id", "only tool messages"),
])
def test_bad_tool_fields_are_refused_by_name(body, param, message) -> None:
    with pytest.raises(ApiError) as error:
        parse_chat({"model": "m", "messages": ROUND_TRIP, **body})
    assert error.value.param == param
    assert message in error.value.message
