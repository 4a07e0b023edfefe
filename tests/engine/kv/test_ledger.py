"""The KV reservation ledger: never over-commits, hands out blocks lazily, always returns
to zero. Property tests drive random interleavings of reserve / grow / finish / abort."""

from __future__ import annotations

import threading

import pytest
from _engine_helpers import evictions
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvledger.engine.errors import BadInput
from kvledger.engine.kv.ledger import KVLedger


def test_reservation_covers_prompt_plus_cap_rounded_up_to_blocks():
    ledger = KVLedger(num_blocks=10, block_size=16)
    assert ledger.blocks_for(1) == 1 and ledger.blocks_for(16) == 1 and ledger.blocks_for(17) == 2
    r = ledger.try_reserve(33)
    assert r.num_blocks == 3 and r.used_blocks == 0
    assert (ledger.reserved_blocks, ledger.used_blocks, ledger.free_blocks) == (3, 0, 7)


def test_try_reserve_returns_none_when_it_does_not_fit_and_changes_nothing():
    ledger = KVLedger(num_blocks=4, block_size=16)
    first = ledger.try_reserve(48)
    assert ledger.try_reserve(17) is None
    assert ledger.reserved_blocks == 3
    assert ledger.try_reserve(16) is not None
    ledger.release(first)
    assert ledger.reserved_blocks == 1


def test_blocks_are_handed_out_lazily_and_never_beyond_the_reservation():
    ledger = KVLedger(num_blocks=8, block_size=4)
    r = ledger.try_reserve(10)  # 3 blocks
    ledger.grow(r, 1)
    assert r.used_blocks == 1 and ledger.used_blocks == 1
    ledger.grow(r, 8)
    assert r.used_blocks == 2 and len(set(r.block_ids)) == 2
    ledger.grow(r, 12)
    assert r.used_blocks == 3
    with pytest.raises(RuntimeError):
        ledger.grow(r, 13)


def test_release_is_idempotent_and_returns_blocks():
    ledger = KVLedger(num_blocks=2, block_size=4)
    r = ledger.try_reserve(8)
    ledger.grow(r, 8)
    ledger.release(r)
    ledger.release(r)
    assert (ledger.reserved_blocks, ledger.used_blocks, ledger.free_blocks) == (0, 0, 2)
    with pytest.raises(RuntimeError):
        ledger.grow(r, 1)


def test_bad_sizes_are_refused():
    with pytest.raises(BadInput):
        KVLedger(num_blocks=0, block_size=16)
    with pytest.raises(BadInput):
        KVLedger(num_blocks=4, block_size=16).try_reserve(0)


def test_concurrent_reserve_and_release_never_over_commit():
    ledger = KVLedger(num_blocks=50, block_size=1)
    peak = []

    def worker():
        for _ in range(2000):
            r = ledger.try_reserve(3)
            if r is not None:
                peak.append(ledger.reserved_blocks)
                ledger.grow(r, 3)
                ledger.release(r)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(peak) <= 50
    assert (ledger.reserved_blocks, ledger.used_blocks) == (0, 0)


class LedgerMachine(RuleBasedStateMachine):
    """Requests are admitted, grow token by token, finish or are aborted, in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = KVLedger(num_blocks=12, block_size=4)
        self.live: dict[int, tuple] = {}  # id -> (reservation, capacity_tokens, tokens_written)
        self.next_id = 0

    @rule(prompt=st.integers(1, 30), cap=st.integers(1, 30))
    def reserve(self, prompt, cap):
        free_before = self.ledger.free_blocks
        r = self.ledger.try_reserve(prompt + cap)
        fits = self.ledger.blocks_for(prompt + cap) <= free_before
        assert (r is not None) == fits
        if r is not None:
            self.live[self.next_id] = (r, prompt + cap, 0)
            self.next_id += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.integers(1, 12))
    def grow(self, data, tokens):
        key = data.draw(st.sampled_from(sorted(self.live)))
        r, capacity, written = self.live[key]
        written = min(capacity, written + tokens)
        self.ledger.grow(r, written)
        assert r.used_blocks == self.ledger.blocks_for(written)
        self.live[key] = (r, capacity, written)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), twice=st.booleans())
    def finish_or_abort(self, data, twice):
        key = data.draw(st.sampled_from(sorted(self.live)))
        r, _, _ = self.live.pop(key)
        self.ledger.release(r)
        if twice:  # an abort racing a finish
            self.ledger.release(r)

    @invariant()
    def never_over_committed(self):
        reservations = [r for r, _, _ in self.live.values()]
        assert self.ledger.reserved_blocks == sum(r.num_blocks for r in reservations)
        assert self.ledger.reserved_blocks <= self.ledger.num_blocks
        assert all(r.used_blocks <= r.num_blocks for r in reservations)
        assert self.ledger.used_blocks == sum(r.used_blocks for r in reservations)
        handed_out = [b for r in reservations for b in r.block_ids]
        assert len(handed_out) == len(set(handed_out))  # no block in two places

    def teardown(self):
        for r, _, _ in self.live.values():
            self.ledger.release(r)
        assert (self.ledger.reserved_blocks, self.ledger.used_blocks) == (0, 0)
        assert self.ledger.free_blocks == self.ledger.num_blocks


TestLedgerInterleavings = LedgerMachine.TestCase
TestLedgerInterleavings.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_try_reserve_each_is_all_or_none():
    ledger = KVLedger(10, 16)
    three = ledger.try_reserve_each(40, 3)          # 3 blocks each
    assert [r.num_blocks for r in three] == [3, 3, 3] and ledger.reserved_blocks == 9
    assert ledger.try_reserve_each(16, 2) is None   # 2 blocks, 1 free: nothing taken
    assert ledger.reserved_blocks == 9
    for reservation in three:
        ledger.release(reservation)
    assert ledger.reserved_blocks == 0


# -- prefix caching -----------------------------------------------------------------------

def _cached_ledger(num_blocks=8, block_size=4) -> KVLedger:
    return KVLedger(num_blocks, block_size, enable_prefix_caching=True)


def _compute(ledger: KVLedger, r, tokens: list[int]) -> None:
    """What the engine does for a prompt computed in one go: draw, then register."""
    ledger.grow(r, len(tokens))
    ledger.prefix_cache.register(r, tokens, len(tokens))


def test_caching_off_or_without_prompt_ids_is_the_plain_ledger():
    for ledger, ids in ((KVLedger(8, 4), list(range(12))), (_cached_ledger(), None)):
        first = ledger.try_reserve(16, ids)
        _compute(ledger, first, list(range(12)))
        ledger.release(first)
        again = ledger.try_reserve(16, ids)
        assert again.num_cached_blocks == 0 and again.num_cached_tokens == 0
        assert (ledger.reserved_blocks, ledger.used_blocks, ledger.free_blocks) == (4, 0, 4)
        assert (ledger.prefix_cache.queries, ledger.prefix_cache.hits) == (0, 0)
    # Off, nothing is even kept: without prompt ids a block is still offered to others.
    assert KVLedger(8, 4).cached_blocks == 0 and ledger.cached_blocks == 3


def test_a_repeated_prefix_pins_its_cached_blocks_and_draws_only_the_rest():
    ledger = _cached_ledger()
    prompt = list(range(10))                                    # 2 full blocks + 2 tokens
    first = ledger.try_reserve(14, prompt)
    _compute(ledger, first, prompt)
    full_blocks = first.block_ids[:2]
    ledger.release(first)
    assert (ledger.used_blocks, ledger.cached_blocks, ledger.free_blocks) == (0, 2, 8)
    second = ledger.try_reserve(14, [*prompt, 99])              # 11 tokens: 2 blocks hit
    assert second.block_ids == full_blocks
    assert (second.num_cached_blocks, second.num_cached_tokens, second.draws_left) == (2, 8, 2)
    assert (ledger.used_blocks, ledger.reserved_blocks, ledger.cached_blocks) == (2, 4, 0)
    assert (ledger.prefix_cache.queries, ledger.prefix_cache.hits) == (10 + 11, 8)


def test_sharing_counts_a_block_once_and_admission_counts_cached_blocks_as_free():
    ledger = _cached_ledger(num_blocks=6)
    prompt = list(range(9))
    first = ledger.try_reserve(12, prompt)                      # 3 blocks
    _compute(ledger, first, prompt)
    # Held by `first`: pinning costs nothing; each choice draws its own last block.
    two = ledger.try_reserve_each(12, 2, prompt)
    assert [r.num_cached_blocks for r in two] == [2, 2] and two[0].block_ids == first.block_ids[:2]
    assert (ledger.used_blocks, ledger.reserved_blocks) == (3, 5)
    assert ledger.try_reserve(8, [50] * 7) is None              # 2 blocks, 1 left
    for r in (first, *two):
        ledger.release(r)
    assert (ledger.reserved_blocks, ledger.used_blocks, ledger.cached_blocks) == (0, 0, 2)
    # Cached blocks are free to admission: six blocks of new tokens fit, evicting both.
    everything = ledger.try_reserve(24, [60] * 20)
    ledger.grow(everything, 24)
    assert evictions(ledger) == 2 and ledger.cached_blocks == 0


def test_a_fully_cached_prompt_still_computes_its_last_block():
    ledger = _cached_ledger()
    prompt = list(range(8))                                     # exactly 2 blocks
    first = ledger.try_reserve(10, prompt)
    _compute(ledger, first, prompt)
    ledger.release(first)
    again = ledger.try_reserve(10, prompt)
    assert again.num_cached_blocks == 1 and again.num_cached_tokens == 4  # the last hit dropped


def test_prompt_logprobs_take_no_hits_but_their_blocks_are_registered():
    ledger = _cached_ledger()
    prompt = list(range(10))
    echo = ledger.try_reserve(12, prompt, use_cached=False)
    assert echo.num_cached_blocks == 0
    _compute(ledger, echo, prompt)
    assert ledger.try_reserve(12, prompt, use_cached=False).num_cached_blocks == 0
    assert ledger.try_reserve(12, prompt).num_cached_blocks == 2
    assert ledger.prefix_cache.queries == 10                    # only the one that could hit


def test_a_block_whose_tokens_are_already_cached_stays_private():
    ledger = _cached_ledger()
    prompt = list(range(8))
    a, b = ledger.try_reserve(10, prompt), ledger.try_reserve(10, prompt)  # admitted together
    _compute(ledger, a, prompt)
    _compute(ledger, b, prompt)
    ledger.release(a)
    ledger.release(b)
    assert ledger.cached_blocks == 2 and ledger.free_blocks == 8  # b's copies went back free


def test_eviction_waits_for_pressure_and_takes_the_least_recently_released_first():
    ledger = _cached_ledger(num_blocks=6, block_size=2)
    old, new = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    for prompt in (old, new):                                   # 2 full blocks each
        r = ledger.try_reserve(6, prompt)
        _compute(ledger, r, prompt)
        ledger.release(r)
    assert (ledger.cached_blocks, evictions(ledger)) == (4, 0)
    r = ledger.try_reserve(4, [20, 21, 22])                     # 2 never-used blocks: no eviction
    ledger.grow(r, 4)
    assert (ledger.cached_blocks, evictions(ledger)) == (4, 0)
    more = ledger.try_reserve(4, [30, 31, 32])                  # now 2 must be evicted
    ledger.grow(more, 4)
    assert evictions(ledger) == 2
    ledger.release(r)
    ledger.release(more)
    assert ledger.try_reserve(6, old).num_cached_blocks == 0    # released first, evicted first
    assert ledger.try_reserve(6, new).num_cached_blocks == 2


def test_generated_blocks_are_registered_so_a_resent_history_hits():
    ledger = _cached_ledger()
    prompt, reply = list(range(6)), [40, 41, 42, 43]
    r = ledger.try_reserve(12, prompt)
    tokens = prompt + reply
    ledger.grow(r, len(tokens))
    ledger.prefix_cache.register(r, tokens, len(tokens) - 1)                 # the last token's K/V is not in yet
    ledger.release(r)
    assert ledger.try_reserve(16, [*tokens, 7, 8]).num_cached_blocks == 2


class PrefixLedgerMachine(RuleBasedStateMachine):
    """Prompts over a two-token alphabet (so prefixes repeat) are admitted, pin cached
    blocks, are computed chunk by chunk and decoded, register their full blocks and are
    released in any order, in a pool small enough that draws evict. The model records
    what each block's K/V encode (the tokens up to its last written position), so a hit
    is checked to hold exactly the prompt's prefix."""

    BLOCK = 2

    def __init__(self) -> None:
        super().__init__()
        self.ledger = KVLedger(num_blocks=8, block_size=self.BLOCK, enable_prefix_caching=True)
        self.live: dict[int, dict] = {}
        self.written: dict[int, tuple[int, ...]] = {}  # block -> the prefix its K/V encode
        self.next_id = 0

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=9), cap=st.integers(1, 4),
          count=st.integers(1, 3), use_cached=st.booleans())
    def reserve(self, prompt, cap, count, use_cached):
        free_before = self.ledger.free_blocks
        claim = self.ledger.blocks_needed(len(prompt) + cap, count, prompt, use_cached=use_cached)
        reservations = self.ledger.try_reserve_each(len(prompt) + cap, count, prompt,
                                                    use_cached=use_cached)
        assert (reservations is not None) == (claim <= free_before)
        if reservations is None:
            assert self.ledger.free_blocks == free_before
            return
        assert self.ledger.free_blocks == free_before - claim
        for r in reservations:
            assert r.num_cached_tokens < len(prompt)            # one token is always computed
            assert use_cached or r.num_cached_blocks == 0
            for i, block in enumerate(r.block_ids):             # a hit holds this very prefix
                assert self.written[block] == tuple(prompt[:(i + 1) * self.BLOCK])
            self.live[self.next_id] = {"r": r, "tokens": list(prompt), "prompt": len(prompt),
                                       "capacity": len(prompt) + cap, "use_cached": use_cached,
                                       "computed": r.num_cached_tokens}
            self.next_id += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 5), token=st.integers(0, 1), then_register=st.booleans())
    def compute(self, data, chunk, token, then_register):
        """One engine step for a request: a prompt chunk, or a decode of a new token; the
        engine registers what it filled after each step (``register`` also runs alone)."""
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        r, tokens = req["r"], req["tokens"]
        if r.awaits_share:
            return  # the engine starts it once another choice computed their prompt
        if req["computed"] < req["prompt"]:
            end = min(req["computed"] + chunk, req["prompt"])
        elif len(tokens) < req["capacity"]:
            if req["computed"] == len(tokens):                  # sample, then compute it
                tokens.append(token)
            end = len(tokens)
        else:
            return
        self.ledger.grow(r, end)                                # never fails once admitted
        holders = [b for key, other in self.live.items() if other is not req
                   for b in other["r"].block_ids]
        for position in range(req["computed"], end):
            block = r.block_ids[position // self.BLOCK]
            assert position // self.BLOCK >= r.num_cached_blocks  # never into a pinned hit
            assert block not in holders                         # nor into anyone else's block
            self.written[block] = tuple(tokens[:position + 1])
        req["computed"] = end
        if then_register:
            self.ledger.prefix_cache.register(r, tokens, end)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def start(self, data):
        """A request about to run pins the blocks cached since its admission."""
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        r = req["r"]
        if not req["use_cached"] or len(r.block_ids) > r.num_cached_blocks or r.awaits_share:
            return  # the engine pins only before a request's first draw, as it starts
        reserved = self.ledger.reserved_blocks
        req["computed"] = self.ledger.pin_cached(r, req["tokens"][:req["prompt"]])
        assert self.ledger.reserved_blocks <= reserved           # the claim never grows
        assert req["computed"] == r.num_cached_tokens < req["prompt"]
        for i, block in enumerate(r.block_ids):
            assert self.written[block] == tuple(req["tokens"][:(i + 1) * self.BLOCK])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def share(self, data):
        """The engine hands a request's computed prompt blocks to its other choices."""
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        r, share = req["r"], req["r"].share
        if share is None or share.owner is not r or req["computed"] < share.end * self.BLOCK:
            return
        reserved = self.ledger.reserved_blocks
        members = self.ledger.share_prompt(r)
        assert self.ledger.reserved_blocks == reserved          # pinning shared blocks is free
        for other in self.live.values():
            if other["r"] in members:
                other["computed"] = other["r"].num_cached_tokens
                assert other["r"].block_ids[share.start:share.end] == r.block_ids[share.start:share.end]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def register(self, data):
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        self.ledger.prefix_cache.register(req["r"], req["tokens"], req["computed"])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def draw_everything(self, data):
        """Draw a reservation's whole claim at once: admission promised it."""
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if not req["r"].awaits_share:
            self.ledger.grow(req["r"], req["capacity"])

    @precondition(lambda self: self.live)
    @rule(data=st.data(), twice=st.booleans())
    def release(self, data, twice):
        req = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.ledger.release(req["r"])
        if twice:
            self.ledger.release(req["r"])

    @invariant()
    def accounts_balance(self):
        ledger, pool = self.ledger, self.ledger._pool
        reservations = [req["r"] for req in self.live.values()]
        held = [b for r in reservations for b in r.block_ids]
        assert ledger.reserved_blocks <= ledger.num_blocks
        assert ledger.used_blocks == len(set(held))
        assert ledger.reserved_blocks == ledger.used_blocks + sum(r.draws_left for r in reservations)
        assert all(len(r.block_ids) + r.draws_left + r.awaited_blocks == r.num_blocks
                   for r in reservations)
        registered = set(pool._by_hash.values())  # findable under a prefix's key
        for block in range(ledger.num_blocks):
            assert pool.ref_counts[block] == held.count(block)
            holders = [r for r in reservations if block in r.block_ids]
            if len(holders) > 1:  # shared only when cached, or by the choices of one request
                one_request = (all(r.share is not None for r in holders)
                               and len({id(r.share) for r in holders}) == 1)
                assert block in registered or one_request
        # Every block is in exactly one state: in use, cached or free.
        free, cached = list(pool._free), list(pool._cached)
        assert sorted(free + cached + sorted(set(held))) == list(range(ledger.num_blocks))
        assert ledger.cached_blocks == len(cached)

    def teardown(self):
        for req in self.live.values():
            self.ledger.release(req["r"])
        assert (self.ledger.reserved_blocks, self.ledger.used_blocks) == (0, 0)
        assert self.ledger.free_blocks == self.ledger.num_blocks
        assert self.ledger.cached_blocks + len(self.ledger._pool._free) == self.ledger.num_blocks


TestPrefixLedgerInterleavings = PrefixLedgerMachine.TestCase
TestPrefixLedgerInterleavings.settings = settings(max_examples=300, stateful_step_count=60,
                                                  deadline=None)


def test_a_request_about_to_start_pins_what_was_cached_since_its_admission():
    ledger = _cached_ledger()
    prompt = list(range(10))
    first, waiting = ledger.try_reserve(14, prompt), ledger.try_reserve(14, prompt)
    assert waiting.num_cached_blocks == 0 and ledger.reserved_blocks == 8
    _compute(ledger, first, prompt)                              # registers 2 blocks
    assert ledger.pin_cached(waiting, prompt) == 8
    assert waiting.block_ids == first.block_ids[:2] and waiting.draws_left == 2
    assert ledger.reserved_blocks == 6                           # in use already: 2 draws fewer
    assert (ledger.prefix_cache.queries, ledger.prefix_cache.hits) == (20, 8)
    ledger.grow(waiting, 12)
    assert ledger.pin_cached(waiting, prompt) == 8               # once it has drawn: no more


def test_a_query_is_counted_once_whether_found_at_admission_or_at_start():
    ledger = _cached_ledger()
    short = ledger.try_reserve(5, [1, 2, 3])                     # under a block: nothing to find
    assert ledger.pin_cached(short, [1, 2, 3]) == 0
    blind = ledger.try_reserve(12)                               # reserved without its prompt
    assert ledger.pin_cached(blind, list(range(9))) == 0
    assert (ledger.prefix_cache.queries, ledger.prefix_cache.hits) == (3 + 9, 0)
