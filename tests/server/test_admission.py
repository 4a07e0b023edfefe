"""Reservation admission against the real KV ledger: caps, 400/429 (admission's
refusals as the server answers them, ``admission_error``), FIFO wait, Retry-After estimated
from the running requests, and no leaked blocks."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvledger.engine.admission.due_back import JITTER_FRACTION
from kvledger.engine.admission.line import Admission
from kvledger.engine.errors import CapTooLarge, KVCacheFull, PoolTooSmall, PromptTooLong
from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.server.api_errors import ApiError, admission_error


@dataclass
class _Answer:
    value: ApiError | None = None


@contextlib.contextmanager
def refused() -> Iterator[_Answer]:
    """Expects admission's refusal; ``.value`` is the server's answer to it."""
    answer = _Answer()
    with pytest.raises((PromptTooLong, CapTooLarge, PoolTooSmall, KVCacheFull)) as info:
        yield answer
    answer.value = admission_error(info.value)


def _admission(num_blocks=10, block_size=16, max_model_len=160, rate=10.0, wait_s=0.0):
    ledger = KVLedger(num_blocks, block_size)
    return Admission(ledger, max_model_len=max_model_len, max_queue_wait_s=wait_s,
                     decode_tokens_per_s=lambda: rate, rng=random.Random(0))


def test_effective_cap_unset_is_the_rest_of_the_context():
    adm = _admission(max_model_len=100)
    assert adm.effective_cap(30, None) == 70
    assert adm.effective_cap(30, 70) == 70
    assert adm.effective_cap(30, 5) == 5


def test_prompt_at_the_context_is_400_and_explicit_overflow_is_400_naming_both():
    adm = _admission(max_model_len=100)
    with refused() as info:
        adm.effective_cap(100, None)
    assert info.value.status == 400 and "100" in info.value.message
    with refused() as info:
        adm.effective_cap(60, 41)
    assert info.value.status == 400
    assert "60" in info.value.message and "41" in info.value.message
    assert info.value.param == "max_tokens"


def test_the_engines_cap_rule_keeps_the_servers_answers():
    """``effective_cap`` applies ``output_cap`` and maps its two refusals to these."""
    adm = _admission(max_model_len=100)
    with refused() as info:
        adm.effective_cap(100, 5)
    error = info.value
    assert (error.status, error.code, error.param, error.reason) == (
        400, "context_length_exceeded", "prompt", "prompt_too_long")
    assert error.message == ("This model's maximum context length is 100 tokens. However, "
                             "your prompt contains 100 input tokens, which leaves no room for "
                             "an output token. Please reduce the length of the input prompt.")
    with refused() as info:
        adm.effective_cap(60, 41)
    error = info.value
    assert (error.status, error.code, error.param, error.reason) == (
        400, "context_length_exceeded", "max_tokens", "over_context")
    assert error.message == ("prompt (60 tokens) + max_tokens (41) = 101 exceeds the context "
                             "limit of 100 tokens; lower max_tokens to at most 40")


async def test_admit_reserves_prompt_plus_cap_and_release_returns_it():
    adm = _admission()
    ticket = await adm.admit("a", prompt_tokens=20, cap_tokens=30)  # 50 tokens -> 4 blocks
    assert adm.ledger.reserved_blocks == 4
    adm.ledger.release(ticket.reservation)
    adm.done(ticket)
    assert adm.ledger.reserved_blocks == 0 and not adm.running


async def test_429_carries_whole_seconds_and_ms_estimated_from_remaining_caps():
    adm = _admission(num_blocks=10, rate=10.0)
    slow = await adm.admit("slow", 16, 64)  # 5 blocks, 64 tokens left -> due in 6.4 s
    fast = await adm.admit("fast", 16, 64)  # 5 blocks
    adm.progress(fast, 54)                  # 10 tokens left -> due in 1.0 s
    assert adm.refusals.estimate_wait_s(3) == pytest.approx(1.0)   # the fast one frees enough
    assert adm.refusals.estimate_wait_s(8) == pytest.approx(6.4)   # needs both
    adm.progress(slow, 34)                                # 30 left -> 3.0 s
    assert adm.refusals.estimate_wait_s(8) == pytest.approx(3.0)
    with refused() as info:
        await adm.admit("c", 16, 100)  # 8 blocks
    error = info.value
    assert error.status == 429 and error.code == "kv_cache_full"
    retry_s = int(error.headers["Retry-After"])
    retry_ms = int(error.headers["retry-after-ms"])
    assert retry_s >= 1 and retry_s == math.ceil(retry_ms / 1000)
    assert 3000 <= retry_ms <= 3000 * (1 + JITTER_FRACTION) + 250
    assert adm.ledger.reserved_blocks == 10  # the refusal reserved nothing


async def test_retry_after_is_jittered_across_clients():
    adm = _admission(num_blocks=4, rate=10.0)
    await adm.admit("a", 16, 48)
    refused = [admission_error(adm.refusals.rejection(4)) for _ in range(20)]
    delays = {error.headers["retry-after-ms"] for error in refused}
    assert len(delays) > 10


async def test_queue_is_fifo_and_grants_as_blocks_return():
    adm = _admission(num_blocks=4, wait_s=5.0)
    first = await adm.admit("first", 16, 48)  # all 4 blocks
    big = asyncio.create_task(adm.admit("big", 16, 48))      # needs 4
    small = asyncio.create_task(adm.admit("small", 8, 8))    # needs 1, but queued behind
    await asyncio.sleep(0.05)
    assert adm.queue_length == 2 and not big.done() and not small.done()
    adm.ledger.release(first.reservation)
    adm.done(first)  # wakes the queue
    big_ticket = await asyncio.wait_for(big, 1)
    await asyncio.sleep(0.05)
    assert not small.done(), "the small request must not overtake, and 0 blocks are free"
    adm.ledger.release(big_ticket.reservation)
    adm.done(big_ticket)
    small_ticket = await asyncio.wait_for(small, 1)
    adm.ledger.release(small_ticket.reservation)
    adm.done(small_ticket)
    assert adm.ledger.reserved_blocks == 0 and adm.queue_length == 0


async def _until_queued(adm: Admission, waiters: int) -> None:
    """Until ``waiters`` requests wait in line: a task joins it within a few turns of the
    event loop, so this counts turns, not seconds."""
    for _ in range(1000):
        if adm.queue_length == waiters:
            return
        await asyncio.sleep(0)
    pytest.fail(f"{adm.queue_length} requests in line, expected {waiters}")


async def test_queue_wait_times_out_with_429_and_cancelled_waiters_leak_nothing():
    adm = _admission(num_blocks=4, wait_s=0.2)
    held = await adm.admit("held", 16, 48)
    with refused() as info:
        await adm.admit("late", 16, 16)  # waits its 0.2 s in line, then gives up
    assert info.value.status == 429 and adm.queue_length == 0
    # The next waiter leaves by cancellation alone: its wait could not run out first,
    # whenever this test gets to run again.
    adm.max_queue_wait_s = 60.0
    gone = asyncio.create_task(adm.admit("gone", 16, 16))
    await _until_queued(adm, 1)
    assert not gone.done()
    gone.cancel()  # client disconnected while waiting
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert adm.queue_length == 0
    adm.ledger.release(held.reservation)
    adm.done(held)
    assert adm.ledger.reserved_blocks == 0


async def test_close_refuses_waiters_with_503():
    adm = _admission(num_blocks=4, wait_s=5.0)
    await adm.admit("held", 16, 48)
    waiter = asyncio.create_task(adm.admit("w", 16, 16))
    await asyncio.sleep(0.05)
    adm.close(ApiError(503, "shutting down", code="shutting_down"))
    with pytest.raises(ApiError) as info:
        await waiter
    assert info.value.status == 503 and adm.queue_length == 0


async def test_request_larger_than_the_whole_pool_is_400():
    adm = _admission(num_blocks=2, max_model_len=1000)
    with refused() as info:
        await adm.admit("huge", 100, 100)
    assert info.value.status == 400 and "2" in info.value.message
    # The ledger's rule (``check_fits``), in the server's words.
    assert info.value.message == ("the request needs 13 KV blocks (200 tokens) but the whole "
                                  "pool holds 2; lower max_tokens")
    assert (info.value.code, info.value.param, info.value.reason) == (
        "kv_pool_too_small", "max_tokens", "over_pool")


async def test_early_rejection_only_when_the_answer_cannot_depend_on_the_prompt():
    adm = _admission(num_blocks=10, max_model_len=160)   # 160 tokens = 10 blocks
    assert adm.early_rejection(20, None) is None          # empty pool: tokenize and admit
    held = await adm.admit("held", 16, 16)                # 2 blocks held, 8 free
    early = admission_error(adm.early_rejection(20, None))  # unset cap: all 10 blocks
    assert early.status == 429 and int(early.headers["Retry-After"]) >= 1
    assert adm.early_rejection(20, 100) is None           # 1 + 100 tokens fits in 8 blocks
    assert adm.early_rejection(160, None) is None         # might be too long: tokenize
    assert adm.early_rejection(100, 100) is None          # might be a 400: tokenize
    adm.max_queue_wait_s = 1.0
    assert adm.early_rejection(20, None) is None          # it would queue instead
    adm.ledger.release(held.reservation)
    adm.done(held)


async def test_a_full_line_refuses_early_whatever_the_prompt_over_committing_or_not():
    """Nobody overtakes a live waiter (strict FIFO): once the line is full a request is a
    429 before tokenizing, even one that would fit now; over-committing (--admission safe)
    that is the only early refusal, since free blocks do not decide there."""
    for safe in (False, True):
        ledger = KVLedger(10, 16, overcommit=safe)
        adm = Admission(ledger, max_model_len=160, max_queue_len=1, max_queue_wait_s=5.0,
                        decode_tokens_per_s=lambda: 10.0, rng=random.Random(0))
        held = await adm.admit("held", 16, 144)           # all 10 blocks promised
        assert adm.early_rejection(20, 10) is None        # the line has room: it may wait
        waiter = asyncio.ensure_future(adm.admit("waiter", 16, 144))
        await asyncio.sleep(0)
        assert adm.queue_full
        early = adm.early_rejection(20, 10)               # 2 blocks: free or not, refused
        assert early is not None and admission_error(early).status == 429
        assert adm.early_rejection(20, 200) is None       # might be a 400: tokenize
        adm.backfill = True                               # it plans only those in line
        assert adm.early_rejection(20, 10) is not None
        ledger.release(held.reservation)
        adm.done(held)
        ticket = await waiter
        ledger.release(ticket.reservation)
        adm.done(ticket)
        assert ledger.used_blocks == ledger.reserved_blocks == 0


async def test_a_waiter_cancelled_in_the_instant_it_is_granted_gives_the_blocks_back():
    adm = _admission(num_blocks=4, wait_s=5.0)
    held = await adm.admit("held", 16, 48)
    waiter = asyncio.create_task(adm.admit("w", 16, 16))
    await asyncio.sleep(0.05)
    adm.ledger.release(held.reservation)
    adm.done(held)        # grants the waiter its 2 blocks...
    waiter.cancel()       # ...but its client is gone before it runs again
    try:                  # Python 3.11's wait_for may return the grant instead of raising
        ticket = await waiter
    except asyncio.CancelledError:
        ticket = None     # the grant was given back inside admit()
    if ticket is not None:  # the caller owns it, and its finally releases it
        assert adm.ledger.reserved_blocks == 2
        adm.ledger.release(ticket.reservation)
        adm.done(ticket)
    assert adm.ledger.reserved_blocks == 0 and adm.queue_length == 0 and not adm.running


async def test_estimate_counts_requests_queued_behind_the_engines_max_num_seqs():
    ledger = KVLedger(12, 16)
    adm = Admission(ledger, max_model_len=160, max_num_seqs=2,
                    decode_tokens_per_s=lambda: 10.0, rng=random.Random(0))
    for name in ("a", "b", "c"):  # 4 blocks each, 50 tokens to go: 5 s of decoding
        await adm.admit(name, 14, 50)
    # a and b run now and are done at 5 s; c waits for a slot and is done at 10 s.
    assert adm.refusals.estimate_wait_s(4) == pytest.approx(5.0)
    assert adm.refusals.estimate_wait_s(12) == pytest.approx(10.0)
    adm.max_num_seqs = None  # were all three running at once, all would be back at 5 s
    assert adm.refusals.estimate_wait_s(12) == pytest.approx(5.0)


async def test_retry_after_of_a_timed_out_waiter_counts_the_waiters_queued_ahead():
    adm = _admission(num_blocks=8, rate=10.0, wait_s=5.0)
    soon = await adm.admit("soon", 16, 48)    # 4 blocks
    adm.progress(soon, 38)                    # 10 tokens left -> due in 1.0 s
    await adm.admit("late", 16, 48)           # 4 blocks, 48 tokens left -> due in 4.8 s
    ahead = asyncio.create_task(adm.admit("ahead", 16, 48))  # needs 4, waits up to 5 s
    await asyncio.sleep(0.05)
    assert adm.queue_length == 1
    adm.max_queue_wait_s = 0.1  # the next request gives up long before `ahead` does
    with refused() as info:
        await adm.admit("behind", 16, 16)     # needs 2
    # Alone, its 2 blocks are back with `soon` at 1.0 s; behind `ahead`'s 4 it needs 6,
    # which only `late` returning at 4.8 s provides.
    assert adm.refusals.estimate_wait_s(2, ahead_blocks=0) == pytest.approx(1.0)
    retry_ms = int(info.value.headers["retry-after-ms"])
    assert 4800 <= retry_ms <= 4800 * (1 + JITTER_FRACTION) + 250
    ahead.cancel()
    with pytest.raises(asyncio.CancelledError):
        await ahead
    assert adm.queue_length == 0 and adm.ledger.reserved_blocks == 8


async def test_n_choices_reserve_prompt_plus_cap_each_all_or_none():
    adm = _admission(num_blocks=10)
    ticket = await adm.admit("n2", prompt_tokens=20, cap_tokens=30, n=2)  # 2 x 4 blocks
    assert adm.ledger.reserved_blocks == 8
    assert [r.num_blocks for r in ticket.reservations] == [4, 4]
    with refused() as info:      # 2 blocks free: a 429, nothing taken
        await adm.admit("late", 20, 30, n=1)
    assert info.value.status == 429 and adm.ledger.reserved_blocks == 8
    for reservation in ticket.reservations:
        adm.ledger.release(reservation)
    adm.done(ticket)
    assert adm.ledger.reserved_blocks == 0


async def test_n_choices_are_admitted_together_or_wait_together():
    adm = _admission(num_blocks=10, wait_s=5.0)
    held = await adm.admit("held", 16, 48)                          # 4 blocks, 6 free
    three = asyncio.create_task(adm.admit("three", 16, 16, n=3))    # 3 x 2 = 6: fits
    assert len((await three).reservations) == 3 and adm.ledger.reserved_blocks == 10
    four = asyncio.create_task(adm.admit("four", 16, 16, n=2))      # 4 blocks: waits whole
    await asyncio.sleep(0.05)
    assert not four.done() and adm.ledger.reserved_blocks == 10     # none taken piecemeal
    adm.ledger.release(held.reservation)
    adm.done(held)
    granted = await four
    assert [r.num_blocks for r in granted.reservations] == [2, 2]
    for ticket in (await three, granted):
        for reservation in ticket.reservations:
            adm.ledger.release(reservation)
        adm.done(ticket)
    assert adm.ledger.reserved_blocks == 0 and not adm.running


async def test_n_choices_beyond_the_pool_are_a_400_and_early_rejection_counts_them():
    adm = _admission(num_blocks=10)
    with refused() as info:
        await adm.admit("huge", 16, 48, n=3)   # 3 x 4 blocks > 10
    assert info.value.status == 400 and "3 choices" in info.value.message
    held = await adm.admit("held", 16, 48)     # 6 blocks free
    assert adm.early_rejection(20, 31, n=1) is None   # 1 + 31 tokens: 2 blocks fit
    early = adm.early_rejection(20, 31, n=4)          # 4 x 2 = 8 blocks do not
    assert early is not None and admission_error(early).status == 429
    adm.ledger.release(held.reservation)
    adm.done(held)


def _cached_admission(num_blocks=10, block_size=16, max_model_len=160):
    ledger = KVLedger(num_blocks, block_size, enable_prefix_caching=True)
    return Admission(ledger, max_model_len=max_model_len, decode_tokens_per_s=lambda: 10.0,
                     rng=random.Random(0))


def _computed(ledger, prompt, tokens):
    """A reservation whose prompt is computed and registered, as the engine leaves it."""
    reservation = ledger.try_reserve(tokens, prompt)
    ledger.grow(reservation, len(prompt))
    ledger.prefix_cache.register(reservation, prompt, len(prompt))
    return reservation


async def test_admit_with_the_prompt_pins_its_cached_blocks_and_counts_what_it_holds():
    adm = _cached_admission()
    prompt = list(range(40))                                     # 2 full blocks + 8 tokens
    adm.ledger.release(_computed(adm.ledger, prompt, 48))        # now cached
    two = await adm.admit("two", 40, 8, n=2, prompt_token_ids=prompt)
    assert [r.num_cached_blocks for r in two.reservations] == [2, 2]
    assert adm.ledger.reserved_blocks == 2 + 2 * 1  # shared blocks once
    echo = await adm.admit("echo", 40, 8, prompt_token_ids=prompt, use_cached=False)
    assert echo.reservation.num_cached_blocks == 0 and adm.ledger.reserved_blocks == 4 + 3
    for ticket in (two, echo):
        for reservation in ticket.reservations:
            adm.ledger.release(reservation)
        adm.done(ticket)
    assert adm.ledger.reserved_blocks == 0


async def test_early_rejection_leaves_room_for_what_the_cache_may_cover():
    adm = _cached_admission()
    prefix = list(range(32))
    holder = _computed(adm.ledger, prefix, 32)                   # 2 blocks in use, 8 free
    # Unset cap: 160 tokens = 10 blocks, but up to (40 - 1) // 16 = 2 of them may be
    # cached blocks already in use, so 8 may be enough: tokenize and admit.
    assert adm.early_rejection(40, None) is None
    ticket = await adm.admit("fits", 40, 120, prompt_token_ids=prefix + [7] * 8)
    assert ticket.reservation.num_cached_blocks == 2 and adm.ledger.free_blocks == 0
    # Without caching the same request needs all 10: refused before tokenizing.
    plain = _admission()
    plain.ledger.try_reserve(32)
    assert admission_error(plain.early_rejection(40, None)).status == 429
    # With a cap a choice draws at least blocks_for(1 + cap), cached prefix or not.
    adm.ledger.release(ticket.reservation)
    adm.done(ticket)
    assert admission_error(adm.early_rejection(30, 128)).status == 429            # 9 blocks, 8 free
    adm.ledger.release(holder)


async def test_a_waiter_cancelled_as_it_is_granted_wakes_the_next_one():
    adm = _admission(num_blocks=4, wait_s=30.0)  # lost, the wake-up would take 30 s
    held = await adm.admit("held", 16, 48)                        # all 4 blocks
    first = asyncio.create_task(adm.admit("first", 16, 48))       # needs 4: waits
    second = asyncio.create_task(adm.admit("second", 16, 16))     # needs 2: behind first
    await asyncio.sleep(0.05)
    assert adm.queue_length == 2
    first.cancel()                   # the client leaves ...
    adm.ledger.release(held.reservation)
    adm.done(held)                   # ... in the instant its 4 blocks are granted
    with pytest.raises(asyncio.CancelledError):
        await first
    ticket = await asyncio.wait_for(second, 10.0)  # not a 429 after the 30 s wait
    assert adm.ledger.reserved_blocks == 2 and adm.queue_length == 0
    adm.ledger.release(ticket.reservation)
    adm.done(ticket)
    assert adm.ledger.reserved_blocks == 0


async def test_a_head_waiter_that_leaves_lets_the_one_behind_it_in():
    adm = _admission(num_blocks=4, wait_s=30.0)
    held = await adm.admit("held", 16, 16)                         # 2 blocks, 2 free
    head = asyncio.create_task(adm.admit("head", 16, 48))          # needs 4: waits
    behind = asyncio.create_task(adm.admit("behind", 16, 16))      # 2 would fit: FIFO
    await asyncio.sleep(0.05)
    assert not behind.done()
    head.cancel()
    with pytest.raises(asyncio.CancelledError):
        await head
    ticket = await asyncio.wait_for(behind, 10.0)
    for done in (held, ticket):
        adm.ledger.release(done.reservation)
        adm.done(done)
    assert adm.ledger.reserved_blocks == 0 and adm.queue_length == 0


async def test_retry_after_counts_a_shared_prefix_once_as_the_pool_really_frees_it():
    """8 chats pin the same 24-block system prompt: the first to finish frees its own
    blocks only; the prefix comes back with the last of them."""
    block_size, prefix_blocks = 16, 24
    ledger = KVLedger(64, block_size, enable_prefix_caching=True)
    adm = Admission(ledger, max_model_len=1024, decode_tokens_per_s=lambda: 10.0,
                    rng=random.Random(0))
    system = list(range(prefix_blocks * block_size))
    ledger.release(_computed(ledger, [*system, 1000], len(system) + 1))   # cached now
    chats = []
    for i in range(8):  # prompt 24 blocks + 4 tokens, cap 28 tokens: 2 blocks of their own
        prompt = system + [2000 + i] * 4
        ticket = await adm.admit(f"chat{i}", len(prompt), 28, prompt_token_ids=prompt)
        assert ticket.reservation.num_cached_blocks == prefix_blocks
        adm.progress(ticket, 27 - 3 * i)  # chat0 is due first (0.1 s), chat7 last (2.2 s)
        chats.append(ticket)
    assert ledger.reserved_blocks == prefix_blocks + 8 * 2
    due_s = [t.remaining_tokens / 10.0 for t in chats]
    # The truth: release the chats in the order they are due, and watch free_blocks.
    free_after = []
    for ticket in chats:
        ledger.release(ticket.reservation)
        free_after.append(ledger.free_blocks)
    for ticket in chats:  # put them back as they were, to ask for estimates
        ticket.reservations = [ledger.try_reserve(len(system) + 4 + 28, system + [2000] * 4)]
    assert ledger.reserved_blocks == prefix_blocks + 8 * 2 and ledger.free_blocks == 24
    for needed in (25, 30, 40, 41, 64):
        truth = next(due_s[i] for i, free in enumerate(free_after) if free >= needed)
        assert adm.refusals.estimate_wait_s(needed) == pytest.approx(truth), needed
    # 40 of 64 free needs 16 more: seven chats' own blocks (14) are not enough; only the
    # last chat, releasing the prefix too, gets there. Counting the prefix in every chat
    # would have said the first one (0.1 s).
    assert adm.refusals.estimate_wait_s(40) == pytest.approx(due_s[-1])


async def test_a_large_promise_at_the_head_gets_the_blocks_as_they_come_back():
    """Head-of-line reservation: smaller requests that arrive later wait behind it, so
    returning blocks accumulate for it and it never starves."""
    adm = _admission(num_blocks=10, wait_s=None)                   # no time limit
    small = [await adm.admit(f"s{i}", 16, 16) for i in range(5)]    # 2 blocks each: full
    big = asyncio.create_task(adm.admit("big", 16, 112))            # 8 blocks
    await _until_queued(adm, 1)
    late = [asyncio.create_task(adm.admit(f"late{i}", 16, 16)) for i in range(3)]
    await _until_queued(adm, 4)
    for ticket in small[:4]:  # 8 blocks come back, one request at a time
        adm.give_back(ticket.reservations)
        adm.done(ticket)
        await asyncio.sleep(0)
        assert not any(task.done() for task in late)  # a 2-block late-comer would fit
    granted = await asyncio.wait_for(big, 10.0)
    assert not any(task.done() for task in late) and adm.queue_length == 3
    for ticket in (granted, small[4]):
        adm.give_back(ticket.reservations)
        adm.done(ticket)
    for ticket in [await asyncio.wait_for(task, 10.0) for task in late]:
        adm.give_back(ticket.reservations)
        adm.done(ticket)
    assert adm.ledger.reserved_blocks == 0 and adm.queue_length == 0


async def test_a_full_line_is_a_429_counting_the_requests_ahead_of_it():
    ledger = KVLedger(8, 16)
    adm = Admission(ledger, max_model_len=160, max_queue_wait_s=None, max_queue_len=2,
                    decode_tokens_per_s=lambda: 10.0, rng=random.Random(0))
    held = await adm.admit("held", 16, 112)                          # all 8 blocks, 11.2 s
    waiting = [asyncio.create_task(adm.admit(f"w{i}", 16, 48)) for i in range(2)]
    await _until_queued(adm, 2)
    with refused() as info:
        await adm.admit("third", 16, 16)                             # the line is full
    assert info.value.status == 429 and adm.queue_length == 2
    # Its 2 blocks come after the 4 + 4 of the two ahead: all 8 back when `held` ends.
    retry_ms = int(info.value.headers["retry-after-ms"])
    assert 11200 <= retry_ms <= 11200 * (1 + JITTER_FRACTION) + 250
    assert adm.early_rejection(2, 16) is not None  # full line: refused before tokenizing
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)  # they leave the line
    adm.give_back(held.reservations)
    adm.done(held)
    assert ledger.reserved_blocks == 0 and adm.queue_length == 0


async def test_no_line_or_no_wait_means_refused_at_once():
    for options in ({"max_queue_len": 0, "max_queue_wait_s": None},
                    {"max_queue_len": 256, "max_queue_wait_s": 0.0}):
        ledger = KVLedger(4, 16)
        adm = Admission(ledger, max_model_len=160, rng=random.Random(0), **options)
        held = await adm.admit("held", 16, 48)
        assert not adm.queues
        with refused() as info:
            await adm.admit("late", 16, 16)
        assert info.value.status == 429 and adm.queue_length == 0
        adm.give_back(held.reservations)
        adm.done(held)


def _backfill_admission(backfill=True, max_num_seqs=None):  # backfill is off by default
    """10 blocks of 16 tokens; ``held`` (8 blocks) is 12 tokens from its cap and ``short``
    (1 block) 8, so one block is free and a 10-block head can start in 12 steps."""
    ledger = KVLedger(10, 16)
    return Admission(ledger, max_model_len=160, max_queue_wait_s=None, backfill=backfill,
                     max_num_seqs=max_num_seqs, decode_tokens_per_s=lambda: 10.0,
                     rng=random.Random(0))


async def _held_and_short(adm):
    held = await adm.admit("held", 16, 112)
    adm.progress(held, 100)
    short = await adm.admit("short", 8, 8)
    return held, short


async def _finish(adm, *tickets):
    for ticket in tickets:
        adm.give_back(ticket.reservations)
        adm.done(ticket)
        await asyncio.sleep(0)


async def test_a_request_done_before_the_head_can_start_goes_ahead_in_free_blocks():
    """Backfilling: the head needs 10 blocks and gets them in 12 steps at the soonest; a
    1-block request done in 8 steps takes the free block now, one done in 4 takes the
    block an early finisher gives back, and neither delays the head."""
    adm = _backfill_admission()
    held, short = await _held_and_short(adm)
    head = asyncio.create_task(adm.admit("head", 16, 144))       # 10 blocks
    await _until_queued(adm, 1)
    ahead = await asyncio.wait_for(adm.admit("ahead", 8, 8), 1.0)  # 1 block, 8 steps
    assert adm.queue_length == 1 and adm.backfilled == 1
    later = asyncio.create_task(adm.admit("later", 4, 4))        # nothing free: in line
    await _until_queued(adm, 2)
    await _finish(adm, short)                    # stopped early: its block goes ahead too
    granted = await asyncio.wait_for(later, 1.0)
    assert adm.backfilled == 2 and not head.done()
    await _finish(adm, ahead, granted, held)
    await _finish(adm, await asyncio.wait_for(head, 1.0))
    assert adm.ledger.reserved_blocks == 0 and adm.queue_length == 0


async def test_a_request_not_done_before_the_head_can_start_waits_its_turn():
    adm = _backfill_admission()
    held, short = await _held_and_short(adm)
    head = asyncio.create_task(adm.admit("head", 16, 144))
    await _until_queued(adm, 1)
    too_long = asyncio.create_task(adm.admit("too-long", 3, 13))  # 1 block, but 13 steps
    await _until_queued(adm, 2)
    await _finish(adm, short)
    assert not too_long.done() and adm.backfilled == 0
    await _finish(adm, held)
    head_ticket = await asyncio.wait_for(head, 1.0)
    assert not too_long.done()  # behind the head, which holds the whole pool
    await _finish(adm, head_ticket)
    await _finish(adm, await asyncio.wait_for(too_long, 1.0))
    assert adm.ledger.reserved_blocks == 0


async def test_backfilling_delays_none_of_the_first_in_line_not_only_the_head():
    """Reserving, 10 blocks: r1 holds 4 for 10 more steps, r2 5 for 40, one is free. The
    head (10 blocks) is planned at step 40, w2 (5 blocks, 20 steps) at 10, between them.
    w3 (1 block, 15 steps) fits now and is done before the head starts, but would take
    a block w2 needs at step 10: it waits. w4 (1 block, 10 steps) is done by then: it goes."""
    adm = _backfill_admission()
    r1, r2 = await adm.admit("r1", 16, 48), await adm.admit("r2", 16, 64)
    adm.progress(r1, 38)
    adm.progress(r2, 24)
    line = [asyncio.create_task(adm.admit(name, prompt, cap))
            for name, prompt, cap in (("head", 16, 144), ("w2", 60, 20), ("w3", 1, 15))]
    await _until_queued(adm, 3)
    w4 = await asyncio.wait_for(adm.admit("w4", 6, 10), 1.0)
    head, w2, w3 = line
    assert adm.backfilled == 1 and not any(task.done() for task in line)
    await _finish(adm, r1, w4)                   # w2's 5 blocks are free 10 steps early
    w2_ticket = await asyncio.wait_for(w2, 1.0)
    assert adm.backfilled == 2 and not head.done() and not w3.done()
    await _finish(adm, w2_ticket, r2)
    await _finish_as_granted(adm, head, w3)
    assert adm.ledger.reserved_blocks == 0 and adm.queue_length == 0


async def test_over_committed_backfilling_plans_by_the_projection_not_the_free_blocks():
    """Safe admission, 10 blocks of 16: r (16 + 144 tokens) has written 96, so it holds 7
    blocks at the next step and 10 by its cap, 64 steps on: no block is free to reserve.
    The head (16 + 64) would hold 3 by step 16, with r's 8 over the pool: it waits for r.
    A 1-block request of 8 steps fits beside r and is gone before the head's start."""
    ledger = KVLedger(10, 16, overcommit=True)
    adm = Admission(ledger, max_model_len=160, max_queue_wait_s=None, backfill=True,
                    decode_tokens_per_s=lambda: 10.0, rng=random.Random(0))
    running = await adm.admit("r", 16, 144)
    ledger.grow(running.reservation, 96)
    adm.progress(running, 80)
    assert ledger.free_blocks == 0
    head = asyncio.create_task(adm.admit("head", 16, 64))
    await _until_queued(adm, 1)
    longer = asyncio.create_task(adm.admit("longer", 16, 48))   # 4 blocks by step 32
    await _until_queued(adm, 2)
    short = await asyncio.wait_for(adm.admit("short", 8, 8), 1.0)
    assert adm.backfilled == 1 and not head.done() and not longer.done()
    await _finish(adm, short, running)
    await _finish_as_granted(adm, head, longer)
    assert ledger.used_blocks == ledger.reserved_blocks == 0


async def test_after_an_engine_step_the_plan_is_redone_once_nine_times_its_cost_passed(
        monkeypatch):
    """Called after every engine step, backfilling replans no more than a tenth of the
    time; a release or a new waiter (a call without ``step``) always replans."""
    now = [0.0]
    adm = Admission(KVLedger(10, 16), max_model_len=160, max_queue_wait_s=None,
                    backfill=True, clock=lambda: now[0], rng=random.Random(0))
    held = await adm.admit("held", 16, 144)
    waiter = asyncio.create_task(adm.admit("waiter", 16, 16))
    await _until_queued(adm, 1)
    plans = []

    def plan():  # a plan that takes 2 ms
        plans.append(now[0])
        now[0] += 0.002

    monkeypatch.setattr(adm, "_backfill_line", plan)
    adm.capacity_changed(step=True)                 # due: plans, then not before +18 ms
    now[0] += 0.017
    adm.capacity_changed(step=True)
    assert len(plans) == 1
    adm.capacity_changed()                          # not a step: plans
    now[0] += 0.019
    adm.capacity_changed(step=True)
    assert len(plans) == 3
    await _finish(adm, held)
    await _finish(adm, await asyncio.wait_for(waiter, 1.0))


@pytest.mark.parametrize("options", [{"backfill": False}, {"max_num_seqs": 2}])
async def test_no_backfill_when_off_or_when_every_seat_is_taken(options):
    """Off (the default) is strict FIFO; at max_num_seqs a request would wait for a seat, not
    decode a token a step, so it may not go ahead either."""
    adm = _backfill_admission(**options)
    held, short = await _held_and_short(adm)
    head = asyncio.create_task(adm.admit("head", 16, 144))
    await _until_queued(adm, 1)
    ahead = asyncio.create_task(adm.admit("ahead", 8, 8))
    await _until_queued(adm, 2)
    assert adm.backfilled == 0 and adm.ledger.free_blocks == 1
    await _finish(adm, held, short)  # a seat came free first: "ahead" may then go first
    await _finish_as_granted(adm, head, ahead)
    assert adm.ledger.reserved_blocks == 0


async def _finish_as_granted(adm, *tasks):
    """Finish each admission task as soon as it is granted, in whatever order."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, timeout=1.0,
                                           return_when=asyncio.FIRST_COMPLETED)
        assert done, "nobody was granted"
        await _finish(adm, *[task.result() for task in done])


def test_line_up_without_an_event_loop_grants_in_line_order():
    """``LLM.generate``'s use: plain futures, no cap on the line nor the wait; each grant
    comes from ``capacity_changed`` as blocks return, the head first."""
    from concurrent.futures import Future

    ledger = KVLedger(4, 16)
    adm = Admission(ledger, max_model_len=160, max_queue_wait_s=None, max_queue_len=None)
    futures = {name: Future() for name in ("a", "b", "c")}
    adm.line_up("a", 16, 48, futures["a"])            # all 4 blocks, at once
    adm.line_up("b", 16, 48, futures["b"])            # 4 blocks: waits
    adm.line_up("c", 8, 8, futures["c"])              # 1 block, but behind b
    assert futures["a"].done() and not futures["b"].done() and not futures["c"].done()
    assert adm.queue_length == 2 and adm.queues and not adm.queue_full
    first = futures["a"].result()
    ledger.release(first.reservation)
    adm.done(first)
    assert futures["b"].done() and not futures["c"].done()
    second = futures["b"].result()
    ledger.release(second.reservation)
    adm.done(second)
    third = futures["c"].result()
    ledger.release(third.reservation)
    adm.done(third)
    assert ledger.reserved_blocks == 0 and adm.queue_length == 0 and not adm.running
