"""vLLM's ``bad_words``: words a request must never write. Each word is the token
sequences it is written as (``word_sequences``: alone and after a space, as vLLM tokenizes
it); at every step a sequence whose tokens but the last end the output so far has its last
token taken out of that request's own logits row.

Which sequences those are is found incrementally (Knuth-Morris-Pratt): the request's
``BadWordSequences`` hold each sequence's failure table, built once per request; each
choice's ``BadWordsMatcher`` keeps, per sequence, how much of it the output ends with, and
reads each new output token once. A step costs O(number of sequences), amortised, however
long the sequences are (comparing each whole sequence with the output's end cost 1 ms a
choice a step for 128 sequences of 1,000 tokens)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvledger.engine.errors import BadInput

if TYPE_CHECKING:
    from kvledger.engine.sampling.allowed_tokens import AllowedTokenIds


def word_sequences(encode: Callable[[str], list[int]],
                   words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences ``words`` are written as: each word's own tokens (its leading
    spaces dropped), and the tokens of it after a space when those are a different word
    of the same length (a tokenizer that marks a word's start, as byte-level BPE's ``Ġ``),
    as vLLM's ``SamplingParams.update_from_tokenizer`` reads them."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(encode(word.lstrip()))
        if not alone:
            continue
        sequences.append(alone)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return tuple(sequences)


def resolved(params: Any, tokenizer: Any) -> Any:
    """``params`` (``SamplingParams``) with its bad words' token sequences found with
    ``tokenizer``; unchanged when it has none, or has them already."""
    if not params.bad_words or params.bad_words_token_ids:
        return params
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)
    return dataclasses.replace(params,
                               bad_words_token_ids=word_sequences(encode, params.bad_words))


def _failure_table(prefix: tuple[int, ...]) -> tuple[int, ...]:
    """KMP's: entry ``i`` is the length of the longest proper start of ``prefix[:i + 1]``
    that also ends it."""
    table = [0] * len(prefix)
    k = 0
    for i in range(1, len(prefix)):
        while k and prefix[i] != prefix[k]:
            k = table[k - 1]
        if prefix[i] == prefix[k]:
            k += 1
        table[i] = k
    return tuple(table)


class BadWordSequences(tuple[tuple[int, ...], ...]):
    """A request's bad words' token sequences (each a non-empty tuple of non-negative
    ids; BadInput otherwise), with what its choices' matchers share: each sequence's
    prefix (all but its last token), last token and the prefix's failure table. Built once
    per request: its choices' params carry the same object."""

    prefixes: tuple[tuple[int, ...], ...]
    last_tokens: tuple[int, ...]
    failure_tables: tuple[tuple[int, ...], ...]
    single_tokens: frozenset[int]  # the one-token sequences': banned at every step

    def __new__(cls, sequences: Iterable[Sequence[int]]) -> BadWordSequences:
        checked = []
        for seq in sequences:
            if not isinstance(seq, list | tuple) or not seq or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in seq):
                raise BadInput("bad_words_token_ids must be lists of token ids, none empty",
                               "bad_words")
            checked.append(tuple(seq))
        table = super().__new__(cls, checked)
        table.prefixes = tuple(seq[:-1] for seq in checked)
        table.last_tokens = tuple(seq[-1] for seq in checked)
        table.failure_tables = tuple(_failure_table(prefix) for prefix in table.prefixes)
        table.single_tokens = frozenset(seq[0] for seq in checked if len(seq) == 1)
        return table

    def __reduce__(self) -> tuple[Any, ...]:
        return (BadWordSequences, (tuple(self),))


class BadWordsMatcher:
    """One choice's progress through its request's bad words: per sequence, KMP's state,
    the length of the longest start of its prefix that ends the output read so far (the
    prefix's length: the output ends with it, its last token is banned).

    ``dead_end``: the last ``banned`` took out every one of ``allowed_token_ids`` (the
    request's, when it has them): no token is left to write, and the sequence finishes
    with ``"grammar"`` rather than write one outside them."""

    def __init__(self, sequences: BadWordSequences,
                 allowed_token_ids: AllowedTokenIds | None = None) -> None:
        self.sequences = sequences
        self.allowed_token_ids = allowed_token_ids
        self.states = [0] * len(sequences)
        self.tokens_read = 0  # how much of the output the states have read
        self.dead_end = False

    def banned(self, output_ids: Sequence[int]) -> list[int]:
        """The tokens that must not follow ``output_ids`` (the choice's output so far): the
        last token of every sequence whose other tokens end it, as vLLM bans them (a
        one-token sequence's at every step). ``output_ids`` extends the one of the previous
        call (only the tokens added since are read); a shorter one is read from its start."""
        if len(output_ids) < self.tokens_read:
            self.states, self.tokens_read = [0] * len(self.sequences), 0
        for token_id in output_ids[self.tokens_read:]:
            self._read(token_id)
        self.tokens_read = len(output_ids)
        sequences = self.sequences
        banned = [last for last, prefix, state
                  in zip(sequences.last_tokens, sequences.prefixes, self.states, strict=True)
                  if state == len(prefix)]
        self.dead_end = (self.allowed_token_ids is not None
                         and self.allowed_token_ids.all_in(banned))
        return banned

    def _read(self, token_id: int) -> None:
        """Each state after one more output token: KMP's step, amortised O(1) a sequence."""
        states = self.states
        sequences = self.sequences
        for i, (prefix, table) in enumerate(zip(sequences.prefixes, sequences.failure_tables,
                                                strict=True)):
            if not prefix:  # a one-token sequence: always banned, nothing to follow
                continue
            state = states[i]
            if state == len(prefix):  # it ended the output: how much of it still could
                state = table[state - 1]
            while state and prefix[state] != token_id:
                state = table[state - 1]
            states[i] = state + 1 if prefix[state] == token_id else state
