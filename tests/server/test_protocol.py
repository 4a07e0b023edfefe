"""Request parsing: every field is implemented or refused by name; a malformed body is a
400 naming the field, never an exception."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.engine.sampling.json_grammar import JsonLayout
from kvledger.engine.server.api_errors import ApiError
from kvledger.engine.server.protocol import parse_chat, parse_completion


def _refused(parse, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


def test_completion_defaults_and_fields():
    req = parse_completion({"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0,
                            "top_p": 0.5, "seed": 7, "stop": "\n", "stream": True,
                            "stream_options": {"include_usage": True}})
    assert (req.kind, req.prompt, req.cap, req.temperature, req.top_p) == \
        ("completion", ["hi"], 5, 0.0, 0.5)
    assert (req.seed, req.stop, req.stream, req.include_usage) == (7, ["\n"], True, True)
    assert parse_completion({"model": "m", "prompt": "x"}).cap is None
    assert parse_completion({"model": "m", "prompt": "x", "max_completion_tokens": 3}).cap == 3
    # always a batch: one prompt, or several (strings, or token-id lists)
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}).prompt == [[1, 2, 3]]
    assert parse_completion({"model": "m", "prompt": ["one"]}).prompt == ["one"]
    assert parse_completion({"model": "m", "prompt": ["a", "b"]}).prompt == ["a", "b"]
    assert parse_completion({"model": "m", "prompt": [[1], [2, 3]]}).prompt == [[1], [2, 3]]


def test_chat_prefers_max_completion_tokens_and_joins_text_parts():
    req = parse_chat({"model": "m", "max_tokens": 9, "max_completion_tokens": 4,
                      "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}]})
    assert req.cap == 4
    # The parts reach the chat template as parts; its render joins them by newlines for a
    # template that reads a string (model/chat_template.py).
    assert req.template_messages == [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]}]
    assert parse_chat({"model": "m", "max_tokens": 9,
                       "messages": [{"role": "user", "content": "x"}]}).cap == 9


def test_a_message_sent_back_as_the_sdk_dumps_it_is_taken():
    """OpenAI's SDK's ``message.model_dump()`` of an answer, appended to the next request
    (an agent's loop): its null fields and annotations change nothing; its reasoning
    reaches the template as vLLM passes it; extra keys on a text part are dropped."""
    answer = {"role": "assistant", "content": "hi", "refusal": None, "annotations": [],
              "audio": None, "function_call": None, "tool_calls": None,
              "reasoning_content": "thought"}
    req = parse_chat({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]},
        answer, {"role": "user", "content": "again"}]})
    assert req.template_messages[1] == {"role": "assistant", "content": "hi",
                                        "reasoning": "thought", "reasoning_content": "thought"}
    assert req.template_messages[0]["content"] == [{"type": "text", "text": "a"}]
    tool = parse_chat({"model": "m", "messages": [
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "1"},
                                                          {"type": "text", "text": "2"}]}]})
    assert tool.template_messages[0]["content"] == "1\n2"  # a tool's parts: one string
    for field, value in (("audio", {"id": "a"}), ("function_call", {"name": "f"})):
        assert _refused(parse_chat, {"model": "m", "messages": [
            {**answer, field: value}]}).param == f"messages[0].{field}"


def test_unset_fields_may_be_sent_as_null():
    """vLLM's fields are ``X | None``: a client that sends unset fields as null gets their
    defaults (``n`` 1, ``stream`` false, ...); ``max_tokens`` null asks for the rest of the
    context, where unset completions take 16."""
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": None,
                      "logprobs": None, "stream": None, "parallel_tool_calls": None,
                      "return_tokens_as_token_ids": None, "max_tokens": None})
    assert (req.n, req.logprobs, req.stream, req.parallel_tool_calls, req.default_cap) == \
        (1, False, False, True, None)
    completion = parse_completion({"model": "m", "prompt": "x", "echo": None, "stream": None})
    assert (completion.echo, completion.stream, completion.default_cap) == (False, False, 16)
    assert parse_completion({"model": "m", "prompt": "x", "max_tokens": None}).default_cap is None
    assert parse_completion({"prompt": "x"}).model is None  # the base model, as vLLM takes it


@pytest.mark.parametrize("body, param", [
    ({"model": 3, "prompt": "x"}, "model"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": 12}, "prompt"),
    ({"model": "m", "prompt": ["a", [1]]}, "prompt"),
    ({"model": "m", "prompt": ["a", ""]}, "prompt"),
    ({"model": "m", "prompt": [[1], []]}, "prompt"),
    ({"model": "m", "prompt": [[1], [2, 1.5]]}, "prompt"),
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"], "n": 65}, "prompt"),
    ({"model": "m", "prompt": [1, -2]}, "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"model": "m", "prompt": "x", "n": 0}, "n"),
    ({"model": "m", "prompt": "x", "n": 129}, "n"),
    ({"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "seed": 1.5}, "seed"),
    ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "m", "prompt": "x", "logprobs": True}, "logprobs"),
    ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": "m", "prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"model": "m", "prompt": "x", "top_k": -2}, "top_k"),
    ({"model": "m", "prompt": "x", "logit_bias": {"7": 101}}, "logit_bias.7"),
    ({"model": "m", "prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options"),
    ({"model": "m", "prompt": "x", "stream": True, "stream_options": {"usage": True}},
     "stream_options.usage"),
    ({"model": "m", "prompt": "x", "response_format": {"type": "xml"}}, "response_format.type"),
    ({"model": "m", "prompt": "x", "response_format": {"type": "json_schema"}},
     "response_format"),
    ({"model": "m", "prompt": "x", "response_format": {"type": "json_object"},
      "guided_regex": "a"}, "guided_regex"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ({"model": "m", "prompt": "x", "guided_choice": []}, "guided_choice"),
    ({"model": "m", "prompt": "x", "guided_json": "not json"}, "guided_json"),
    # Known fields this server does not implement, by name...
    ({"model": "m", "prompt": "x", "best_of": 2}, "best_of"),
    ({"model": "m", "prompt": "x", "suffix": "end"}, "suffix"),
    ({"model": "m", "prompt": "x", "min_p": 1.5}, "min_p"),
    ({"model": "m", "prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ({"model": "m", "prompt": "x", "skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"model": "m", "prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
    # ... and fields nobody modelled, as unknown.
    ({"model": "m", "prompt": "x", "temprature": 0.5}, "temprature"),
    ({"model": "m", "prompt": "x", "store": "yes"}, "store"),
])
def test_completion_rejects_bad_fields(body, param):
    assert _refused(parse_completion, body).param == param


def test_refusals_say_what_is_wrong():
    assert "not supported" in str(_refused(parse_completion,
                                           {"model": "m", "prompt": "x", "best_of": 3}))
    assert "unknown field 'foo'" in str(_refused(parse_completion,
                                                 {"model": "m", "prompt": "x", "foo": 1}))
    assert "must be an integer, got '10'" in str(
        _refused(parse_completion, {"model": "m", "prompt": "x", "max_tokens": "10"}))
    huge = str(_refused(parse_completion, {"model": "m", "prompt": "x", "seed": 10**400}))
    assert len(huge) < 200  # the 400-digit number is not echoed back
    key = str(_refused(parse_completion, {"model": "m", "prompt": "x",
                                          "logit_bias": {"9" * 5000: 1}}))
    assert "keys must be token ids" in key and "set_int_max_str_digits" not in key


def test_neutral_and_ignored_fields_are_accepted():
    req = parse_completion({"model": "m", "prompt": "x", "best_of": 1, "suffix": "",
                            "user": "u", "metadata": {"k": "v"}, "store": False,
                            "service_tier": "auto", "top_k": 0, "logprobs": 0,
                            "tools": [], "tool_choice": "none"})
    assert (req.top_k, req.logprobs_k(), req.prompt_logprobs_k()) == (0, 0, None)


def test_new_sampling_fields():
    req = parse_completion({"model": "m", "prompt": "x", "n": 3, "presence_penalty": -1.5,
                            "frequency_penalty": 2, "repetition_penalty": 1.2,
                            "min_tokens": 4, "logit_bias": {"17": -100, "3": 5.5},
                            "echo": True, "logprobs": 5, "stream": True,
                            "stream_options": {"continuous_usage_stats": True}})
    assert (req.n, req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == \
        (3, -1.5, 2.0, 1.2)
    assert req.bias == {17: -100.0, 3: 5.5}
    # vLLM's: stream_options given asks for the usage; continuous only with it.
    assert (req.logprobs_k(), req.prompt_logprobs_k(), req.continuous_usage) == (5, 5, True)
    assert req.include_usage
    off = {"model": "m", "prompt": "x", "stream": True,
           "stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    assert not parse_completion(off).include_usage and not parse_completion(off).continuous_usage
    nulls = parse_completion({**off, "stream_options": {"include_usage": None}})
    assert nulls.include_usage and not nulls.continuous_usage


def test_echo_alone_scores_the_prompt():
    """``echo`` with ``max_tokens`` 0 (vLLM's): one token computed for the prompt's
    logprobs, none returned; 0 without echo is a 400."""
    req = parse_completion({"model": "m", "prompt": "x", "echo": True, "max_tokens": 0,
                            "logprobs": 1})
    assert (req.echo_only, req.cap, req.prompt_logprobs_k()) == (True, 1, 1)
    assert _refused(parse_completion, {"model": "m", "prompt": "x", "max_tokens": 0}).param \
        == "max_tokens"


@pytest.mark.parametrize("extra, spec", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, ("json_object", None, None)),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object", "required": ["a"]}}}},
     ("json_schema", '{"required":["a"],"type":"object"}', None)),
    ({"guided_json": '{"type": "object"}'}, ("json_schema", '{"type":"object"}', None)),
    ({"guided_regex": "[ab]+"}, ("regex", "[ab]+", None)),
    ({"guided_choice": ["yes", "no"]}, ("choice", '["yes", "no"]', None)),
    ({"guided_grammar": 'root ::= "a"'}, ("grammar", 'root ::= "a"', None)),
    ({"structured_outputs": {"json": {"type": "integer"}}},
     ("json_schema", '{"type":"integer"}', None)),
    ({"structured_outputs": {"choice": ["a"]}}, ("choice", '["a"]', None)),
    ({"structured_outputs": {"json_object": True}}, ("json_object", None, None)),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, ("grammar", 'start: "a"', None)),
    # vLLM's layout options, this request's own
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     ("json_object", None, JsonLayout(disable_any_whitespace=True))),
    ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": "[ ]?",
                             "disable_additional_properties": True}},
     ("json_schema", '{"type":"object"}', JsonLayout(False, True, "[ ]?"))),
    ({"structured_outputs": {"structural_tag": {"triggers": ["<f="], "structures": [
        {"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}]}}},
     ("structural_tag", '{"structures": [{"begin": "<f=a>", "end": "</f>", "schema": '
      '{"type": "object"}}], "triggers": ["<f="]}', None)),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f="], "structures": [
        {"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}]}},
     ("structural_tag", '{"structures": [{"begin": "<f=a>", "end": "</f>", "schema": '
      '{"type": "object"}}], "triggers": ["<f="]}', None)),
])
def test_output_constraints(extra, spec):
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})
    assert req.grammar() == spec


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "structural_tag", "format": {"type": "triggered_tags"}}},
     "response_format", "xgrammar's structural tag language"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f="]}},
     "response_format", "needs 'structures' and 'triggers'"),
    ({"structured_outputs": {"grammar": 'start: "a"', "regex": "a"}},
     "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"structural_tag": "[1]"}}, "structured_outputs", "a JSON object"),
    ({"guided_grammar": 'start: "a"', "guided_regex": "a"}, "guided_grammar",
     "only one output constraint"),
])
def test_refused_output_constraints(extra, param, words):
    refusal = _refused(parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                    **extra})
    assert (refusal.param, words in refusal.message) == (param, True)


def test_chat_logprobs():
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert parse_chat(chat).logprobs_k() is None
    assert parse_chat({**chat, "logprobs": True}).logprobs_k() == 0
    assert parse_chat({**chat, "logprobs": True, "top_logprobs": 5}).logprobs_k() == 5
    assert _refused(parse_chat, {**chat, "top_logprobs": 5}).param == "top_logprobs"
    assert _refused(parse_chat, {**chat, "echo": True}).param == "echo"


@pytest.mark.parametrize("body, param", [
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": ["hi"]}, "messages[0]"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}],
      "max_completion_tokens": -3}, "max_completion_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
     "tool_choice"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}],
      "functions": [{"name": "f"}]}, "functions"),
])
def test_chat_rejects_bad_fields(body, param):
    assert _refused(parse_chat, body).param == param


@pytest.mark.parametrize("body", [None, [], "text", 3])
def test_body_must_be_an_object(body):
    error = _refused(parse_completion, body)
    assert error.body()["error"]["type"] == "invalid_request_error"
    assert set(error.body()["error"]) == {"message", "type", "code", "param"}


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70)
                     | st.floats(allow_nan=True) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
           "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "stream",
           "stream_options", "n", "logprobs", "top_logprobs", "echo", "user",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
           "logit_bias", "include_stop_str_in_output", "best_of", "metadata"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=8), st.booleans())
def test_any_body_is_either_a_400_or_valid_sampling_params(body, chat):
    import torch

    from kvledger.engine.server.request_fields import sampling_params

    try:
        req = (parse_chat if chat else parse_completion)(body)
        sampling_params(req)
    except ApiError as exc:
        assert exc.status == 400
        return
    if req.seed is not None:  # the engine seeds a generator with each choice's
        for index in range(req.n):
            torch.Generator().manual_seed((req.seed + index) % 2**64)
