"""A grammar behind a gate (engine/sampling/grammar_gate.py), on a real compiled grammar:
closed, it leaves every logit and accepts any token, its grammar untouched; a gate token
opens it, and from there it masks and accepts exactly as the grammar alone would."""

from __future__ import annotations

import re

import pytest
import torch

from kvledger.engine.model.tokenizer import Tokenizer
from kvledger.engine.sampling.grammar import GrammarCompiler, GrammarSpec
from kvledger.engine.sampling.grammar_gate import GrammarGate

MINUS_INF = float("-inf")
REGEX = r"[a-c]{2}-[0-9]{3}"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer(tiny_llama_dir)


@pytest.fixture(scope="module")
def grammar(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.eos_token_ids, tokenizer.vocab_size)
    return compiler.compile(GrammarSpec("regex", REGEX))


def _id(tokenizer, text: str) -> int:
    (token_id,) = tokenizer.encode(text, add_special_tokens=False)
    return token_id


def _greedy(matcher, width: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    ids = []
    while not matcher.is_terminated:
        logits = torch.randn(width, generator=generator)
        matcher.fill_mask(logits)
        token = int(logits.argmax())
        assert matcher.accept(token)
        ids.append(token)
        assert len(ids) < 64
    return ids


@pytest.mark.parametrize("seed", range(3))
def test_closed_it_masks_nothing_and_accepts_anything_then_the_grammar_alone(
        tokenizer, grammar, seed):
    end = _id(tokenizer, " sky")
    matcher = GrammarGate(frozenset({end})).over(grammar).matcher()
    generator = torch.Generator().manual_seed(seed)
    for _ in range(20):  # random tokens, most of which REGEX refuses first; then EOS
        logits = torch.randn(tokenizer.vocab_size, generator=generator)
        before = logits.clone()
        matcher.fill_mask(logits)
        assert torch.equal(logits, before)
        token = int(logits.argmax())
        assert matcher.accept(token) and not matcher.dead_end and not matcher.is_terminated
        assert not matcher.open
    assert matcher.accept(min(tokenizer.eos_token_ids))  # EOS in reasoning: no grammar yet
    assert matcher.accept(end) and matcher.open
    # from here the grammar alone, from its first position: the same ids as an ungated one
    ids = _greedy(matcher, tokenizer.vocab_size, seed)
    assert ids == _greedy(grammar.matcher(), tokenizer.vocab_size, seed)
    assert re.fullmatch(REGEX, tokenizer.decode(ids))


def test_an_at_token_is_the_grammars_first(tokenizer, grammar):
    taken = _id(tokenizer, "a")  # REGEX's text may start with it
    matcher = GrammarGate(frozenset(), frozenset({taken})).over(grammar).matcher()
    assert matcher.accept(_id(tokenizer, " sky")) and not matcher.open
    assert matcher.accept(taken) and matcher.open
    ids = _greedy(matcher, tokenizer.vocab_size, 0)
    assert re.fullmatch(REGEX, "a" + tokenizer.decode(ids))

    refused = _id(tokenizer, " sky")  # one REGEX cannot start with: the output ends there
    matcher = GrammarGate(frozenset(), frozenset({refused})).over(grammar).matcher()
    assert not matcher.accept(refused)
    assert matcher.open and matcher.dead_end


def test_a_compiled_grammar_is_shared_not_advanced(tokenizer, grammar):
    """Each sequence's gated matcher has its grammar state of its own."""
    end = _id(tokenizer, " sky")
    gated = GrammarGate(frozenset({end})).over(grammar)
    first, second = gated.matcher(), gated.matcher()
    a = _id(tokenizer, "a")
    assert first.accept(end) and first.accept(a) and first.accept(a)
    assert second.accept(end)
    masks = []
    for matcher in (first, second):
        logits = torch.zeros(tokenizer.vocab_size)
        matcher.fill_mask(logits)
        masks.append(logits[a] > MINUS_INF)
    assert masks == [False, True]  # "aa" wants "-" next; the second is at its first place
