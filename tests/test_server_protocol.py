"""Request parsing: every malformed body is a 400 naming the field, never an exception."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.engine.server.errors import ApiError
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
    assert (req.kind, req.prompt, req.max_tokens, req.temperature, req.top_p) == \
        ("completion", "hi", 5, 0.0, 0.5)
    assert (req.seed, req.stop, req.stream, req.include_usage) == (7, ["\n"], True, True)
    assert parse_completion({"model": "m", "prompt": "x"}).max_tokens is None
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_completion({"model": "m", "prompt": ["one"]}).prompt == "one"


def test_chat_prefers_max_completion_tokens_and_joins_text_parts():
    req = parse_chat({"model": "m", "max_tokens": 9, "max_completion_tokens": 4,
                      "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}]})
    assert req.max_tokens == 4
    assert req.messages == [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "ab"}]
    assert parse_chat({"model": "m", "max_tokens": 9,
                       "messages": [{"role": "user", "content": "x"}]}).max_tokens == 9


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x"}, "model"),
    ({"model": 3, "prompt": "x"}, "model"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": 12}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": [1, -2]}, "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"model": "m", "prompt": "x", "n": 2}, "n"),
    ({"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "seed": 1.5}, "seed"),
    ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "x", "logprobs": 3}, "logprobs"),
    ({"model": "m", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
])
def test_completion_rejects_bad_fields(body, param):
    assert _refused(parse_completion, body).param == param


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
           "stream_options", "n", "logprobs", "user"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=8), st.booleans())
def test_any_body_is_either_a_400_or_valid_sampling_params(body, chat):
    import torch

    from kvledger.engine.server.openai_api import _sampling_params

    try:
        req = (parse_chat if chat else parse_completion)(body)
        _sampling_params(req, 10)
    except ApiError as exc:
        assert exc.status == 400
        return
    if req.seed is not None:
        torch.Generator().manual_seed(req.seed)  # the engine seeds a generator with it
