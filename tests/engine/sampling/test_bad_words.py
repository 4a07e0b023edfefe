"""bad_words' incremental matching (engine/sampling/bad_words.py): the same bans as
comparing every sequence with the output's end, at a step's cost that does not grow with
the sequences' length; its tables built once per request, however many choices."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from kvledger.engine.errors import BadInput
from kvledger.engine.sampling import bad_words
from kvledger.engine.sampling.bad_words import BadWordSequences, BadWordsMatcher
from kvledger.engine.sampling.params import SamplingParams


def reference_bans(sequences: list[tuple[int, ...]], output: list[int]) -> list[int]:
    """vLLM's rule, read straight: a sequence's last token when its other tokens end the
    output (a one-token sequence's always)."""
    return [seq[-1] for seq in sequences
            if len(seq) - 1 <= len(output)
            and (len(seq) == 1 or output[len(output) - len(seq) + 1:] == list(seq[:-1]))]


EDGES = [(7,), (1, 1, 1, 2), (1, 1, 2), (1, 2, 1, 2, 3), (1, 2, 1, 1), (2, 1, 2, 1, 2),
         (1, 1, 1, 1, 1, 1, 1, 1), (3, 3)]


@pytest.mark.parametrize("seed", range(40))
def test_the_matcher_bans_what_comparing_every_sequence_bans(seed):
    rng = random.Random(seed)
    alphabet = rng.randint(1, 4)  # few tokens: prefixes overlap and repeat
    sequences = [tuple(rng.randint(1, alphabet) for _ in range(rng.randint(1, 7)))
                 for _ in range(rng.randint(1, 12))]
    if seed % 2:
        sequences += EDGES
    table = BadWordSequences(sequences)
    matcher = BadWordsMatcher(table)
    output: list[int] = []
    for _ in range(rng.randint(0, 60)):
        # One token a step, as the engine appends them; the output is often shorter
        # than a sequence's prefix at first.
        assert matcher.banned(output) == reference_bans(sequences, output), (sequences, output)
        output.append(rng.randint(1, alphabet))
    # Several tokens at once (read since the last call), and an output read from scratch.
    assert matcher.banned(output) == reference_bans(sequences, output)
    assert BadWordsMatcher(table).banned(output) == reference_bans(sequences, output)
    cut = output[:rng.randint(0, len(output))]  # shorter than what it read: starts over
    assert matcher.banned(cut) == reference_bans(sequences, cut)


def test_a_steps_cost_does_not_grow_with_the_sequences_length():
    """128 sequences of 1,000 tokens that the output keeps matching (an attacker forces it
    with allowed_token_ids) cost a step what 128 of 2 tokens do: comparing each whole
    sequence with the output cost ~40 times more."""

    def seconds_per_step(length: int) -> float:
        sequences = [tuple([461] * (length - 1) + [k]) for k in range(128)]
        best = float("inf")
        for _ in range(5):  # the fastest run: the machine is shared
            matcher = BadWordsMatcher(BadWordSequences(sequences))
            output = [461] * length
            assert len(matcher.banned(output)) == 128
            start = time.perf_counter()
            for _ in range(100):
                output.append(461)
                assert len(matcher.banned(output)) == 128
            best = min(best, (time.perf_counter() - start) / 100)
        return best

    short, long = seconds_per_step(2), seconds_per_step(1000)
    assert long < 3 * short + 20e-6, (short, long)


def test_a_requests_choices_share_its_tables(monkeypatch):
    params = SamplingParams(bad_words_token_ids=[[5, 6, 5, 7], [8]], seed=1)
    table = params.bad_words_token_ids
    assert isinstance(table, BadWordSequences) and table == ((5, 6, 5, 7), (8,))
    built = []
    monkeypatch.setattr(bad_words, "_failure_table", lambda prefix: built.append(prefix))
    choices = [dataclasses.replace(params, seed=k, max_tokens=4) for k in range(128)]
    assert not built and all(c.bad_words_token_ids is table for c in choices)
    assert table.failure_tables == ((0, 0, 1), ())  # 5, 6, 5: the last 5 starts it again


def test_one_token_bad_words_that_are_every_allowed_id_are_refused():
    with pytest.raises(BadInput, match="no token is left") as refused:
        SamplingParams(allowed_token_ids=[461, 265], bad_words_token_ids=[[461], [265], [3, 4]])
    assert refused.value.param == "bad_words"
    SamplingParams(allowed_token_ids=[461, 999], bad_words_token_ids=[[461], [265]])
    SamplingParams(allowed_token_ids=[461], bad_words_token_ids=[[9, 461]])  # only after 9
    for bad in ([[]], [[-1]], [["a"]], [5]):
        with pytest.raises(BadInput):
            SamplingParams(bad_words_token_ids=bad)


def test_a_dead_end_is_when_the_bans_take_every_allowed_id():
    params = SamplingParams(allowed_token_ids=[70, 71], bad_words_token_ids=[[70, 70], [70, 71]])
    matcher = BadWordsMatcher(params.bad_words_token_ids, params.allowed_token_ids)
    assert matcher.banned([]) == [] and not matcher.dead_end
    assert matcher.banned([71]) == [] and not matcher.dead_end
    assert matcher.banned([71, 70]) == [70, 71] and matcher.dead_end
