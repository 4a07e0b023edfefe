"""allowed_token_ids (engine/sampling/allowed_tokens.py) cost a request once: checked and
sorted when its params are made, not again for each of its choices (``choice_params``
replaces the params per choice), and its index built once for all of them."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from _engine_helpers import make_engine

from kvledger.engine.core.sequence import Sequence
from kvledger.engine.errors import BadInput
from kvledger.engine.frontend.checks import choice_params
from kvledger.engine.frontend.submission import Submission
from kvledger.engine.sampling import allowed_tokens
from kvledger.engine.sampling.allowed_tokens import AllowedTokenIds
from kvledger.engine.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir)


def test_they_are_checked_and_sorted_once_not_per_choice(engine, monkeypatch):
    vocab = engine.runner.config.vocab_size
    ids = [*range(vocab - 1, -1, -3), 4, 4]
    params = SamplingParams(allowed_token_ids=ids, seed=7)
    allowed = params.allowed_token_ids
    assert allowed == tuple(sorted(set(ids))) and isinstance(allowed, AllowedTokenIds)
    sorts = []
    monkeypatch.setattr(allowed_tokens, "sorted", lambda values: sorts.append(1) or [],
                        raising=False)
    sub = Submission("r", [[5, 6, 7]], params, n=128)
    choices = choice_params(engine, sub, [8], None)
    assert len({c.seed for c in choices}) == 128  # each its own params...
    assert not sorts and all(c.allowed_token_ids is allowed for c in choices)  # ...one list


def test_a_requests_choices_share_one_index(engine, monkeypatch):
    params = SamplingParams(allowed_token_ids=[9, 3, 700], seed=1)
    choices = choice_params(engine, Submission("r", [[5, 6, 7]], params, n=16), [8], None)
    seqs = [Sequence(f"c{k}", [0], p, 8, None, None, None) for k, p in enumerate(choices)]
    builds = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: builds.append(1) or real(*a, **k))
    cpu = torch.device("cpu")
    index = seqs[0].allowed_index(cpu)
    for _ in range(3):  # steps: never built again
        assert all(seq.allowed_index(cpu) is index for seq in seqs)
    assert len(builds) == 1 and index.tolist() == [3, 9, 700]


def test_a_copy_carries_the_ids_not_the_index():
    params = SamplingParams(allowed_token_ids=[5, 2])
    params.allowed_token_ids.index(torch.device("cpu"))
    for other in (copy.deepcopy(params), pickle.loads(pickle.dumps(params))):
        assert other == params and isinstance(other.allowed_token_ids, AllowedTokenIds)
        assert not other.allowed_token_ids._indexes


@pytest.mark.parametrize("bad", [[], [-1], [True], ["3"], 5, {3}])
def test_anything_but_a_list_of_token_ids_is_refused(bad):
    with pytest.raises(BadInput, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=bad)
