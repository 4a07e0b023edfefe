"""The promise of ``required``/a named function for qwen3_coder and pythonic, checked on the
grammar itself: random walks through it (any allowed token, as a model with any weights
may pick), on a tokenizer holding ``<tool_call>`` as an added token, read back by the
parser (whole and a character at a time), always give calls to declared functions whose
arguments validate against their schemas, and one call when ``parallel_tool_calls`` is
false. (Numbers a schema leaves unbounded are the exception the docs name.)"""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from _server_helpers import with_added_tokens

from kvledger.engine.model.tokenizer import Tokenizer
from kvledger.engine.sampling.grammar import GrammarCompiler, GrammarSpec
from kvledger.engine.server.tools.calls import control_token_ids, tool_plan
from kvledger.engine.server.tools.parsers import CallScanner, ToolCall
from kvledger.engine.server.tools.protocol import Tool

SCHEMAS = {
    "book": {"type": "object", "additionalProperties": False, "required": ["city", "code"],
             "properties": {
                 "city": {"type": "string", "enum": ["Paris", "New York", "a<b"]},
                 "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                 "nights": {"type": "integer", "minimum": 1, "maximum": 9},
                 "note": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]},
                 # bounded: an unbounded number may be written past a float (1e400),
                 # which vLLM reads back as a string (docs/serving.md#tool-calling)
                 "price": {"type": ["number", "null"], "minimum": -1e6, "maximum": 1e6},
                 "when": {"type": "object", "required": ["day"],
                          "properties": {"day": {"type": "string", "enum": ["mon", "tue"]}},
                          "additionalProperties": False},
                 "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}},
    "ping": {"type": "object", "properties": {}, "additionalProperties": False},
}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": s}})
         for n, s in SCHEMAS.items()]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir, tmp_path_factory) -> Tokenizer:
    out = with_added_tokens(tiny_llama_dir, tmp_path_factory.mktemp("grammar-walks") / "m",
                            ["<tool_call>", "</tool_call>"])
    return Tokenizer(out)


def _walks(tokenizer: Tokenizer, grammar: str, count: int, seed: int) -> list[str]:
    """Texts the grammar allows, each token drawn at random among those it allows (the
    end, once allowed, one time in four)."""
    compiler = GrammarCompiler(tokenizer, tokenizer.eos_token_ids, tokenizer.vocab_size)
    compiled = compiler.compile(GrammarSpec("lark", grammar))
    rng, texts = random.Random(seed), []
    eos = sorted(tokenizer.eos_token_ids)
    while len(texts) < count:
        matcher, ids = compiled.matcher(), []
        for _ in range(300):
            matcher.compute_mask()
            bits = np.unpackbits(matcher._bitmask.view(np.uint8), bitorder="little")
            allowed = np.flatnonzero(bits[:tokenizer.vocab_size])
            ends = [t for t in eos if bits[t]]
            token = ends[0] if ends and rng.random() < 0.25 else int(rng.choice(allowed))
            assert matcher.accept(token)
            if matcher.is_terminated:
                texts.append(tokenizer.decode(ids))
                break
            ids.append(token)
    compiler.close()
    return texts


def _check(parser: str, text: str, max_calls: int | None) -> list[ToolCall]:
    whole = CallScanner(parser, max_calls, TOOLS)
    whole.feed(text, final=True)
    streamed = CallScanner(parser, max_calls, TOOLS)
    for end in range(1, len(text) + 1):
        streamed.feed(text[:end], final=end == len(text))
    assert [(c.name, c.arguments) for c in streamed.calls] == \
        [(c.name, c.arguments) for c in whole.calls]
    assert whole.calls and not whole.content, text
    for call in whole.calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return whole.calls


@pytest.mark.parametrize("parser", ["qwen3_coder", "pythonic"])
@pytest.mark.parametrize("parallel", [True, False])
def test_every_text_the_grammar_allows_reads_back_as_valid_calls(tokenizer, parser,
                                                                 parallel) -> None:
    plan = tool_plan(TOOLS, "required", parallel, auto_enabled=False, parser=parser,
                     chat_template=None, specials=control_token_ids(tokenizer))
    counts = []
    for text in _walks(tokenizer, plan.grammar, 25, seed=7 + parallel):
        counts.append(len(_check(parser, text, plan.max_calls)))
    assert max(counts) == 1 if not parallel else max(counts) > 1
