"""The choices of one request (``n > 1``) share their prompt's KV blocks in the reservation
as in the cache: one choice computes the prompt's full blocks, the others pin them. Each
still reserves its whole output cap, every choice's tokens equal its solo run, and a
choice that leaves before computing the prompt hands the work to the next one."""

from __future__ import annotations

import random

import pytest
from _engine_helpers import assert_pool_empty, drain, make_engine

from kvledger.engine.admission.line import Admission
from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.sampling.params import SamplingParams

BLOCK = 16


def test_five_choices_claim_the_prompt_once_and_every_cap():
    """190 prompt tokens + a cap of 5: 13 blocks each; alone, 5 choices need 65."""
    ledger = KVLedger(30, BLOCK)
    prompt = list(range(190))
    assert ledger.check_fits(195, 5, 190, share=True) == 13 + 4 * (13 - 11)
    reservations = ledger.try_reserve_each(195, 5, prompt)
    assert reservations is not None and ledger.reserved_blocks == 21
    owner, *others = reservations
    assert owner.share.owner is owner and owner.share.waiting == others
    assert all(r.awaits_share and r.draws_left == 2 for r in others)
    assert owner.draws_left == 13
    # Prompt logprobs need every position computed by every choice: nothing shared.
    assert ledger.try_reserve_each(195, 5, prompt, use_cached=False) is None
    for r in reservations:
        ledger.release(r)
    assert ledger.reserved_blocks == 0


async def test_admission_no_longer_refuses_choices_that_fit_together():
    adm = Admission(KVLedger(30, BLOCK), max_model_len=512, rng=random.Random(0))
    ticket = await adm.admit("n5", 190, 5, 5, prompt_token_ids=list(range(190)))
    assert len(ticket.reservations) == 5 and adm.ledger.reserved_blocks == 21
    for reservation in ticket.reservations:
        adm.ledger.release(reservation)
    adm.done(ticket)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir, max_model_len=256, max_num_seqs=8,
                       max_num_batched_tokens=64, enable_prefix_caching=False)


PROMPT = [(7 * i + 3) % 900 + 5 for i in range(100)]  # 6 full blocks + 4 tokens
PARAMS = [SamplingParams(temperature=0.9, seed=100 + i, max_tokens=10, ignore_eos=True)
          for i in range(3)]


def solo(engine, params) -> list[int]:
    engine.add_request("solo", PROMPT, params)
    return drain(engine)["solo"].token_ids


def test_choices_sharing_a_prompt_compute_it_once_and_equal_their_solo_runs(engine):
    """With the prefix cache off, so the sharing is the reservation's alone; chunked
    prefill (64 tokens a step), so the owner's prompt takes two steps."""
    alone = [solo(engine, p) for p in PARAMS]
    before = engine.num_prefill_tokens
    reservations = engine.ledger.try_reserve_each(len(PROMPT) + 10, 3, PROMPT)
    assert engine.ledger.reserved_blocks == 7 + 2 * (7 - 6)
    for i, reservation in enumerate(reservations):
        engine.add_request(f"c{i}", PROMPT, PARAMS[i], reservation=reservation)
    final = drain(engine)
    assert [final[f"c{i}"].token_ids for i in range(3)] == alone
    # The owner computed all 100 prompt tokens; the others only what follows 6 blocks.
    assert engine.num_prefill_tokens - before == 100 + 2 * (100 - 6 * BLOCK)
    assert_pool_empty(engine)


def test_a_choice_that_leaves_before_computing_hands_the_prompt_to_the_next(engine):
    alone = [solo(engine, p) for p in PARAMS]
    reservations = engine.ledger.try_reserve_each(len(PROMPT) + 10, 3, PROMPT)
    for i, reservation in enumerate(reservations):
        engine.add_request(f"d{i}", PROMPT, PARAMS[i], reservation=reservation)
    engine.abort_request("d0")  # before any step: the owner never computes anything
    final = drain(engine)
    assert final["d0"].finish_reason == "abort"
    assert [final[f"d{i}"].token_ids for i in (1, 2)] == alone[1:]
    assert_pool_empty(engine)


def test_an_owner_aborted_mid_prompt_leaves_the_others_whole(engine):
    alone = [solo(engine, p) for p in PARAMS]
    reservations = engine.ledger.try_reserve_each(len(PROMPT) + 10, 3, PROMPT)
    for i, reservation in enumerate(reservations):
        engine.add_request(f"e{i}", PROMPT, PARAMS[i], reservation=reservation)
    engine.step()  # the owner's first 64 prompt tokens: it now holds drawn shared blocks
    engine.abort_request("e0")
    final = drain(engine)
    assert [final[f"e{i}"].token_ids for i in (1, 2)] == alone[1:]
    assert_pool_empty(engine)
