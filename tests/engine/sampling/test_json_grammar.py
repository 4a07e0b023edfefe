"""``--structured-outputs-config`` in the grammar (engine/sampling/json_grammar.py): each
backend's JSON layout on llguidance, checked on texts the compiled grammar takes or
refuses token by token (the tiny-llama tokenizer), and vLLM's walk that closes objects."""

from __future__ import annotations

import json

import pytest

from kvledger.engine.model.tokenizer import Tokenizer
from kvledger.engine.sampling.grammar import GrammarCompiler, GrammarSpec
from kvledger.engine.sampling.json_grammar import close_objects
from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"},
                                           "b": {"type": "array", "items": {"type": "integer"}}}}
COMPACT, SPACED = '{"a":1,"b":[2,3]}', '{"a": 1, "b": [2, 3]}'
NEWLINES, WIDE = '{\n  "a": 1\n}', '{"a":' + " " * 13 + "1}"
EXTRA_KEY = '{"a":1,"c":2}'
TEXTS = (COMPACT, SPACED, NEWLINES, WIDE, EXTRA_KEY)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer(tiny_llama_dir)


def taken(tokenizer: Tokenizer, config: StructuredOutputsConfig, spec: GrammarSpec,
          texts=TEXTS) -> set[str]:
    """The texts the grammar of ``spec`` under ``config`` takes whole, EOS after them."""
    compiler = GrammarCompiler(tokenizer, tokenizer.eos_token_ids, tokenizer.vocab_size,
                               structured_outputs=config)
    grammar = compiler.compile(spec)
    out = set()
    for text in texts:
        matcher = grammar.matcher()
        ids = [*tokenizer.encode(text, add_special_tokens=False),
               min(tokenizer.eos_token_ids)]
        if all(matcher.accept(token) for token in ids):
            out.add(text)
    compiler.close()
    return out


@pytest.mark.parametrize(("config", "expected"), [
    ({}, set(TEXTS)),  # llguidance's own: any whitespace, keys as the schema allows
    ({"backend": "guidance"}, set(TEXTS)),
    ({"backend": "guidance", "disable_any_whitespace": True}, {COMPACT, EXTRA_KEY}),
    ({"backend": "guidance", "disable_additional_properties": True},
     {COMPACT, SPACED, NEWLINES, WIDE}),
    ({"backend": "xgrammar"}, {COMPACT, SPACED, NEWLINES, WIDE}),
    ({"backend": "xgrammar", "disable_any_whitespace": True}, {COMPACT}),
    ({"backend": "outlines"}, {COMPACT, SPACED}),  # outlines_core's [ ]?
    ({"backend": "lm-format-enforcer"}, {COMPACT, SPACED, NEWLINES}),  # at most 12
])
def test_each_backend_writes_json_as_its_library_does(tokenizer, config, expected) -> None:
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA, sort_keys=True))
    assert taken(tokenizer, StructuredOutputsConfig(**config), spec) == expected


def test_json_object_has_no_whitespace_either(tokenizer) -> None:
    config = StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True)
    texts = ('{"x":1}', '{"x": 1}', '{ "x":1}')
    assert taken(tokenizer, config, GrammarSpec("json_object"), texts) == {'{"x":1}'}
    assert taken(tokenizer, StructuredOutputsConfig(), GrammarSpec("json_object"),
                 texts) == set(texts)


def test_a_schema_that_says_additional_properties_keeps_them(tokenizer) -> None:
    schema = {**SCHEMA, "additionalProperties": {"type": "integer"}}
    spec = GrammarSpec("json_schema", json.dumps(schema, sort_keys=True))
    assert EXTRA_KEY in taken(tokenizer, StructuredOutputsConfig(backend="xgrammar"), spec)


def test_objects_are_closed_as_vllms_walk_closes_them() -> None:
    """vLLM's ``process_for_additional_properties``: every object schema with properties
    (or patternProperties) and no additionalProperties, however nested."""
    schema = {
        "type": "object",
        "properties": {"inner": {"type": "object", "properties": {"x": {}}},
                       "list": {"type": "array", "items": {"properties": {"y": {}}}}},
        "$defs": {"d": {"patternProperties": {"^z": {}}}},
        "anyOf": [{"properties": {"w": {}}}, {"type": "string"}],
        "additionalProperties": {"properties": {"v": {}}, "additionalProperties": True},
    }
    close_objects(schema)
    assert schema["properties"]["inner"]["additionalProperties"] is False
    assert schema["properties"]["list"]["items"]["additionalProperties"] is False
    assert schema["$defs"]["d"]["additionalProperties"] is False
    assert schema["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema["anyOf"][1]
    assert schema["additionalProperties"]["additionalProperties"] is True  # as written
    assert isinstance(schema["additionalProperties"], dict)  # the root's own: kept
