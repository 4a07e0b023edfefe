"""A running request's step outputs cost what the step adds: its ids and logprobs so far
are views of its sequence's lists (``core/so_far.py``), not copies, counted here by the
items read from those lists; and the views still read as the lists they stand for."""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from kvledger.engine.core.outputs import request_output
from kvledger.engine.core.sequence import Sequence, SequenceStatus
from kvledger.engine.core.so_far import SoFar
from kvledger.engine.model.tokenizer import Tokenizer
from kvledger.engine.sampling.logprobs import TokenLogprobs
from kvledger.engine.sampling.params import SamplingParams


class CountingList(list):
    """A list that counts the items read out of it by iteration or slicing (a copy)."""

    read = 0

    def __iter__(self):
        CountingList.read += len(self)
        return super().__iter__()

    def __getitem__(self, index):
        item = super().__getitem__(index)
        if isinstance(index, slice):
            CountingList.read += len(item)
        return item


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return Tokenizer(tiny_llama_dir)


def _sequence(tokenizer, tokens: int, **params) -> Sequence:
    prompt = tokenizer.encode("Why is the sky blue?")
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, **params)
    seq = Sequence("r", prompt, params, tokens, None, tokenizer.detokenizer(prompt), None)
    seq.output_token_ids = CountingList()
    seq.logprobs = CountingList() if params.logprobs is not None else None
    return seq


def _stream(tokenizer, seq: Sequence, tokens: int) -> list:
    """Each step's output, read as the server's stream reads it (the new ids and logprobs
    sliced off the views)."""
    ids = tokenizer.encode(" the sky is blue because" * tokens, add_special_tokens=False)
    outputs, seen = [], 0
    for token_id in ids[:tokens]:
        reason = seq.append(token_id, TokenLogprobs(token_id, -0.5, 1, []), set())
        if reason is not None:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        output = request_output(seq, [token_id])
        assert output.token_ids[seen:] == [token_id]
        if output.logprobs is not None:
            assert [e.token_id for e in output.logprobs[seen:]] == [token_id]
        seen = len(output.token_ids)
        outputs.append(output)
    return outputs


@pytest.mark.parametrize("logprobs", [None, 1])
def test_a_step_reads_only_what_it_adds(tokenizer, logprobs):
    """2,000 steps read each list's items about once (each step's new item, then one copy
    at the finish), where a copy a step read 2,000 x 2,001 / 2 of them."""
    tokens = 2000
    seq = _sequence(tokenizer, tokens, logprobs=logprobs)
    CountingList.read = 0
    outputs = _stream(tokenizer, seq, tokens)
    lists = 1 if logprobs is None else 2
    assert CountingList.read <= 3 * tokens * lists, CountingList.read
    assert outputs[-1].finished and type(outputs[-1].token_ids) is list
    assert outputs[-1].token_ids == list(seq.output_token_ids)


def test_a_running_output_shows_its_step_not_later_ones(tokenizer):
    """An output the server has not read yet still shows its own step's ids after the
    engine appended more (the engine thread runs ahead of the event loop)."""
    seq = _sequence(tokenizer, 50)
    outputs = _stream(tokenizer, seq, 10)
    assert [len(o.token_ids) for o in outputs] == list(range(1, 11))
    assert outputs[3].token_ids == seq.output_token_ids[:4]
    assert outputs[3].outputs[0].token_ids == seq.output_token_ids[:4]
    assert isinstance(outputs[3].token_ids, SoFar)


def test_a_view_reads_as_its_list():
    items = [5, 6, 7, 8]
    view = SoFar(items, 3)
    items.append(9)  # appended after the view: not in it
    assert len(view) == 3 and list(view) == [5, 6, 7] and view == [5, 6, 7]
    assert view != [5, 6, 7, 8] and view == SoFar(items, 3) and view != "567"
    assert (view[0], view[-1], view[1:], view[::-1], view[5:]) == (5, 7, [6, 7], [7, 6, 5], [])
    with pytest.raises(IndexError):
        view[3]
    assert 7 in view and 8 not in view and view.index(6) == 1 and view.count(5) == 1
    assert list(reversed(view)) == [7, 6, 5] and repr(view) == "[5, 6, 7]"
    assert view.__add__([1]) == [5, 6, 7, 1] and view.__radd__([1]) == [1, 5, 6, 7]
    assert sorted(view, reverse=True) == [7, 6, 5] and sum(view) == 18
    for other in (pickle.loads(pickle.dumps(view)), copy.copy(view), copy.deepcopy(view)):
        assert type(other) is list and other == [5, 6, 7]
    assert json.dumps(list(view)) == "[5, 6, 7]"
    with pytest.raises(TypeError):
        hash(view)
