"""Structured outputs (engine/sampling/grammar.py): masked greedy decoding of random logits on the
tiny-llama tokenizer always yields text the grammar describes, ending with EOS."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest
import torch
from _engine_helpers import heavy_schema

from kvledger.engine.errors import BadInput
from kvledger.engine.model.tokenizer import Tokenizer
from kvledger.engine.sampling.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    GrammarTooCostly,
)

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
MINUS_INF = float("-inf")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer(tiny_llama_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.eos_token_ids, tokenizer.vocab_size)


@pytest.fixture(scope="module")
def closing_ids(tokenizer) -> list[int]:
    """Tokens made only of '"', '}', ']' (and spaces), and the EOS ids."""
    ids = [i for i in range(tokenizer.vocab_size)
           if (text := tokenizer.decode([i]).strip()) and set(text) <= set('"}]')]
    return ids + sorted(tokenizer.eos_token_ids)


def schema_spec(schema: dict) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True))


def allowed(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(logits > MINUS_INF).flatten().tolist())


def decode(matcher, width: int, seed: int, steer: list[int] | None = None,
           limit: int = 600) -> tuple[list[int], set[int]]:
    """Greedy decoding of random logits under ``matcher`` until it accepts EOS: the ids and
    the last step's allowed ids. ``steer`` ids gain step/20, so open-ended JSON closes."""
    generator = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for step in range(limit):
        logits = torch.randn(width, generator=generator)
        if steer:
            logits[steer] += step / 20
        matcher.fill_mask(logits)
        token = int(logits.argmax())
        assert logits[token] > MINUS_INF, "the mask allowed nothing"
        assert matcher.accept(token), f"a token the mask allowed was refused at step {step}"
        ids.append(token)
        if matcher.is_terminated:
            return ids, allowed(logits)
    raise AssertionError(f"no EOS within {limit} tokens")


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_output_parses_validates_and_ends_with_eos(tokenizer, compiler, closing_ids,
                                                              seed):
    matcher = compiler.compile(schema_spec(SCHEMA)).matcher()
    ids, last_allowed = decode(matcher, tokenizer.vocab_size, seed, steer=closing_ids)
    assert ids[-1] in tokenizer.eos_token_ids
    assert last_allowed == tokenizer.eos_token_ids  # complete: every EOS id and nothing else
    jsonschema.validate(json.loads(tokenizer.decode(ids)), SCHEMA)


@pytest.mark.parametrize("seed", range(4))
def test_json_object_output_is_a_json_object(tokenizer, compiler, closing_ids, seed):
    matcher = compiler.compile(GrammarSpec("json_object")).matcher()
    ids, _ = decode(matcher, tokenizer.vocab_size, seed, steer=closing_ids)
    assert ids[-1] in tokenizer.eos_token_ids
    assert isinstance(json.loads(tokenizer.decode(ids)), dict)


@pytest.mark.parametrize("seed", range(4))
def test_regex_and_choice(tokenizer, compiler, seed):
    matcher = compiler.compile(GrammarSpec("regex", r"[a-c]{2}-[0-9]{3}")).matcher()
    ids, _ = decode(matcher, tokenizer.vocab_size, seed)
    assert re.fullmatch(r"[a-c]{2}-[0-9]{3}", tokenizer.decode(ids))

    choices = ["red", "green", "blue", "dark blue"]
    matcher = compiler.compile(GrammarSpec("choice", json.dumps(choices))).matcher()
    ids, _ = decode(matcher, tokenizer.vocab_size, seed)
    assert tokenizer.decode(ids) in choices


@pytest.mark.parametrize(("spec", "expected"), [  # expected: a regex the message starts with
    (schema_spec({"type": "nonsense"}), "invalid json_schema: Invalid type: nonsense"),
    (schema_spec({"type": "object", "properties": {"a": {"$ref": "#/missing"}}}),
     "invalid json_schema: Pointer '/missing' does not exist"),
    (GrammarSpec("json_schema", "false"), "invalid json_schema: Unsatisfiable schema"),
    (GrammarSpec("json_schema", "{not json"), "invalid json_schema: not JSON"),
    (GrammarSpec("json_schema", "[1]"), r"invalid json_schema: a schema is an object or a boolean, not list"),
    (GrammarSpec("regex", "(("), "invalid regex: .*unclosed group"),
    (GrammarSpec("choice", "[]"), "invalid choice: expected a non-empty list"),
])
def test_a_refused_grammar_is_a_one_line_grammar_error(compiler, spec, expected):
    with pytest.raises(GrammarError) as caught:
        compiler.compile(spec)
    assert isinstance(caught.value, BadInput)
    message = str(caught.value)
    assert re.match(expected, message), message
    assert "\n" not in message and len(message) <= 200


UNSATISFIABLE = [
    GrammarSpec("json_schema", json.dumps({"$defs": {"a": {"$ref": "#/$defs/b"},
                                                     "b": {"$ref": "#/$defs/a"}},
                                           "$ref": "#/$defs/a"}, sort_keys=True)),
    GrammarSpec("regex", r"[^\x00-\x{10FFFF}]"),
]


@pytest.mark.parametrize("spec", UNSATISFIABLE, ids=["ref-cycle", "empty-class"])
def test_a_grammar_that_allows_no_output_is_refused_when_compiled(compiler, spec):
    with pytest.raises(GrammarError, match=f"^the {spec.kind} allows no output"):
        compiler.compile(spec)


def test_the_cache_is_bounded_in_bytes_and_a_grammar_over_it_is_refused(tokenizer):
    first, second = (schema_spec(heavy_schema(seed, objects=60)) for seed in (21, 22))
    # A compile's size is the process's heap growth meanwhile (mallinfo2): another thread of
    # this test process allocating at that moment inflates it (a 3 MiB schema measured 7 MiB
    # once, in a worker beside other tests), so a try whose compile went over the cap that
    # way is made again, three at most.
    for attempt in range(3):
        probe = GrammarCompiler(tokenizer, tokenizer.eos_token_ids, tokenizer.vocab_size)
        one = probe.compile(schema_spec(heavy_schema(20, objects=60))).nbytes
        assert one > 2**20  # measured: the library's allocations while it compiled
        bounded = GrammarCompiler(tokenizer, tokenizer.eos_token_ids, tokenizer.vocab_size,
                                  cache_bytes=int(one * 1.5))
        try:
            bounded.compile(first)
            first_cached = bounded.lookup(first) is not None
            kept = bounded.compile(second)
            break
        except GrammarTooCostly:  # a compile measured another thread's allocations too
            if attempt == 2:
                raise
    assert first_cached
    assert bounded.lookup(first) is None and bounded.lookup(second) is kept  # LRU out
    assert bounded.cached_bytes <= bounded.cache_bytes
    small = GrammarCompiler(tokenizer, tokenizer.eos_token_ids, tokenizer.vocab_size,
                            cache_bytes=2**20)
    with pytest.raises(GrammarTooCostly, match=r"over the server's limit of 1\.0 MiB "
                                                r"\(--grammar-cache-bytes\)"):
        small.compile(first)
    assert small.compile(GrammarSpec("json_object")).nbytes < 2**20  # small ones still fit


def test_compiles_run_at_once_per_spec_and_abandoned_queued_ones_are_dropped(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.eos_token_ids, tokenizer.vocab_size,
                               workers=1)
    running, queued = (schema_spec(heavy_schema(seed, objects=60)) for seed in (30, 31))
    first = compiler.submit(running)
    assert compiler.submit(running) is first  # the same spec twice: one compile
    behind = compiler.submit(queued)          # waits for the one worker
    compiler.abandon(queued, behind)
    assert behind.cancelled()                 # nobody waits for it: never compiled
    with pytest.raises(GrammarTooCostly, match="did not compile within"):
        compiler.compile(schema_spec(heavy_schema(32, objects=60)), timeout_s=0.01)
    assert first.result(timeout=60) is compiler.lookup(running)
    compiler.close()


def test_a_disallowed_token_is_refused_and_the_state_kept(tokenizer, compiler):
    matcher = compiler.compile(schema_spec(SCHEMA)).matcher()
    letter, brace = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("x", "{"))
    eos = min(tokenizer.eos_token_ids)
    assert not matcher.accept(letter)
    assert not matcher.accept(eos)  # the object is not complete
    assert not matcher.accept(tokenizer.vocab_size)  # out of range
    assert matcher.accept(brace)  # still usable after the refusals
    assert not matcher.is_terminated


def test_nothing_is_accepted_after_eos(tokenizer, compiler):
    matcher = compiler.compile(GrammarSpec("choice", '["yes"]')).matcher()
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert matcher.accept(token)
    logits = torch.zeros(tokenizer.vocab_size)
    matcher.fill_mask(logits)
    assert allowed(logits) == tokenizer.eos_token_ids
    assert matcher.accept(max(tokenizer.eos_token_ids)) and matcher.is_terminated
    assert not matcher.accept(min(tokenizer.eos_token_ids))
    assert not matcher.accept(tokenizer.encode("yes", add_special_tokens=False)[0])


def test_ids_past_the_tokenizer_vocab_are_never_allowed(tokenizer):
    width = tokenizer.vocab_size + 40
    compiler = GrammarCompiler(tokenizer, tokenizer.eos_token_ids, width)
    matcher = compiler.compile(GrammarSpec("json_schema", '{"type": "string"}')).matcher()
    assert matcher.accept(tokenizer.encode('"', add_special_tokens=False)[0])
    batch = torch.zeros(2, width)
    matcher.fill_mask(batch[1])  # a row of the batch's logits, masked in place
    assert torch.all(batch[1, tokenizer.vocab_size:] == MINUS_INF)
    assert len(allowed(batch[1])) > tokenizer.vocab_size // 2  # inside a string: most tokens
    assert torch.all(batch[0] == 0)
    assert not matcher.accept(tokenizer.vocab_size + 1)


def test_compiled_grammars_are_cached_and_matchers_independent(tokenizer, compiler):
    grammar = compiler.compile(schema_spec(SCHEMA))
    assert compiler.compile(schema_spec(SCHEMA)) is grammar
    first, second = grammar.matcher(), grammar.matcher()
    assert first.accept(tokenizer.encode("{", add_special_tokens=False)[0])
    logits = torch.zeros(tokenizer.vocab_size)
    second.fill_mask(logits)
    assert tokenizer.encode("{", add_special_tokens=False)[0] in allowed(logits)


def test_importing_the_modules_does_not_import_the_library():
    code = ("import sys, kvledger.engine.sampling.grammar, kvledger.engine.sampling.grammar_matcher; "
            "assert 'llguidance' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_text_that_spells_a_special_token_is_refused_when_compiled(compiler):
    """The library's mask allows the special token such text tokenizes to, and refuses it
    when it comes: the grammar allows no output, a 400 that names the token."""
    for spec in (GrammarSpec("regex", r"<\|user\|>hello"), GrammarSpec("choice", '["<s>"]')):
        with pytest.raises(GrammarError, match=f"^the {spec.kind} allows no output: its text "
                                               f"starts with '<"):
            compiler.compile(spec)


@pytest.mark.parametrize("seed", range(3))
def test_a_special_token_spelled_after_some_text_is_a_dead_end_not_a_refusal(tokenizer, compiler,
                                                                             seed):
    """Every token the mask allows is accepted; where the text would turn into a special
    token the mask allows nothing and the matcher is at a dead end (the request ends with
    "grammar"), never a token refused, which fails the request."""
    matcher = compiler.compile(GrammarSpec("regex", r"hi<\|user\|>")).matcher()
    generator = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    while not matcher.dead_end:
        logits = torch.randn(tokenizer.vocab_size, generator=generator)
        matcher.fill_mask(logits)
        if matcher.dead_end:
            break
        token = int(logits.argmax())
        assert matcher.accept(token), f"a token the mask allowed was refused after {ids}"
        ids.append(token)
    assert tokenizer.decode(ids) == "hi"
    assert not allowed(logits)


def test_a_lark_grammar_may_still_ask_for_a_special_token_by_name(tokenizer, compiler):
    user = tokenizer.encode("<|user|>", add_special_tokens=False)
    assert len(user) == 1 and user[0] not in tokenizer.eos_token_ids
    matcher = compiler.compile(GrammarSpec("lark", 'start: "hi" <|user|>')).matcher()
    ids, _ = decode(matcher, tokenizer.vocab_size, seed=0)
    assert tokenizer.decode(ids[:-2]) == "hi" and ids[-2:-1] == user
    assert ids[-1] in tokenizer.eos_token_ids
