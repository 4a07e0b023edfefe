"""The prefix cache as a tenant attacking another would use it (``kv/prefix_cache.py``):
what one request computes may be found only by a request with the same salt and the same
tokens before it, never written by anyone who finds it, and never found once its K/V are
suspect or the cache is reset. Each at both moments a prompt looks the cache up: at
admission (its quote) and as its request starts (``pin_cached``)."""

from __future__ import annotations

import pytest

from kvledger.engine.kv.block_pool import Salt
from kvledger.engine.kv.ledger import KVLedger

BLOCK = 4
VICTIM = list(range(100, 113))  # 3 full blocks and one token


def _ledger(**kwargs) -> KVLedger:
    return KVLedger(32, BLOCK, enable_prefix_caching=True, **kwargs)


def _compute(ledger: KVLedger, reservation, tokens: list[int]) -> None:
    ledger.grow(reservation, len(tokens))
    ledger.prefix_cache.register(reservation, tokens, len(tokens))


def _victim_computes(ledger: KVLedger, salt=None) -> list[int]:
    victim = ledger.try_reserve(len(VICTIM) + 4, VICTIM, salt=salt)
    _compute(ledger, victim, VICTIM)
    return victim.block_ids[:3]


def _found(ledger: KVLedger, prompt: list[int], salt=None, *, at_start: bool) -> int:
    """The cached tokens an attacker's request finds: reserved after the victim computed
    (its quote finds them), or before (found as it starts)."""
    attacker = ledger.try_reserve(len(prompt) + 4, prompt, salt=salt)
    if at_start:
        return ledger.pin_cached(attacker, prompt)
    return attacker.num_cached_tokens


@pytest.mark.parametrize("at_start", [False, True])
@pytest.mark.parametrize(("victim_salt", "attacker_salt"), [
    ("tenant-a", None), (None, "tenant-a"), ("tenant-a", "tenant-b"),
    (Salt("key-a", "same"), Salt("key-b", "same")),  # one client salt under two API keys
])
def test_another_salt_finds_nothing_of_the_victims_prompt(victim_salt, attacker_salt, at_start):
    ledger = _ledger()
    if at_start:  # the attacker is admitted first, then looks again as it starts
        attacker = ledger.try_reserve(len(VICTIM) + 4, VICTIM, salt=attacker_salt)
        _victim_computes(ledger, victim_salt)
        assert ledger.pin_cached(attacker, VICTIM) == 0
    else:
        _victim_computes(ledger, victim_salt)
        assert _found(ledger, VICTIM, attacker_salt, at_start=False) == 0
    assert ledger.prefix_cache.hits == 0


@pytest.mark.parametrize("at_start", [False, True])
def test_the_same_salt_and_tokens_find_only_the_blocks_before_the_first_difference(at_start):
    ledger = _ledger()
    prompts = (VICTIM, [*VICTIM[:4], 0, *VICTIM[5:]], [0, *VICTIM[1:]])
    if at_start:
        probes = [ledger.try_reserve(len(VICTIM) + 4, p, salt="t") for p in prompts]
        _victim_computes(ledger, "t")
        found = [ledger.pin_cached(r, p) for r, p in zip(probes, prompts, strict=True)]
    else:
        _victim_computes(ledger, "t")
        found = [_found(ledger, p, "t", at_start=False) for p in prompts]
    # Whole blocks only, chained: one token changed in block 1 loses blocks 1 and 2 too.
    assert found == [12, 4, 0]


def test_a_finder_never_writes_what_it_found():
    """Hits end before the prompt's last token; the finder's prefill starts after them
    and every block it grows into is drawn, not found."""
    ledger = _ledger()
    shared = _victim_computes(ledger, "t")
    # The attacker's prompt is exactly the victim's full blocks: the last one is computed
    # again (it gives the logits), into a block of its own.
    prompt = VICTIM[:12]
    attacker = ledger.try_reserve(16, prompt, salt="t")
    assert attacker.num_cached_tokens == 8 and attacker.block_ids == shared[:2]
    ledger.grow(attacker, 16)
    assert not set(attacker.block_ids[2:]) & set(shared)
    ledger.prefix_cache.register(attacker, [*prompt, 7, 7, 7, 7], 16)
    assert shared[2] not in attacker.block_ids  # its own copy stayed private
    # And its registration took nothing of the victim's: the victim's key still finds its own.
    assert _found(ledger, VICTIM, "t", at_start=False) == 12


def test_blocks_of_a_non_finite_step_are_never_found():
    ledger = _ledger()
    poisoned = ledger.try_reserve(len(VICTIM) + 4, VICTIM)
    _compute(ledger, poisoned, VICTIM)
    ledger.release(poisoned, uncache=True)
    assert ledger.cached_blocks == 0
    assert _found(ledger, VICTIM, at_start=False) == 0


def test_a_released_reservation_registers_nothing():
    ledger = _ledger()
    gone = ledger.try_reserve(len(VICTIM) + 4, VICTIM)
    ledger.grow(gone, len(VICTIM))
    ledger.release(gone)  # aborted between its step and the engine's register
    ledger.prefix_cache.register(gone, VICTIM, len(VICTIM))
    assert _found(ledger, VICTIM, at_start=False) == 0


def test_reset_frees_the_cached_and_leaves_the_held_held():
    ledger = _ledger()
    _victim_computes(ledger)  # held still: the victim runs
    done = ledger.try_reserve(12, list(range(8)))
    _compute(ledger, done, list(range(8)))
    ledger.release(done)
    assert ledger.prefix_cache.reset() == 2  # done's two blocks, not the victim's three
    assert _found(ledger, list(range(9)), at_start=False) == 0
    assert ledger.used_blocks == 4  # the victim's blocks and last token's block, untouched


def test_pinning_at_start_never_grows_a_claim_under_the_safe_check():
    """A request admitted before the victim's blocks were cached may pin them as it
    starts only in place of its own draws: the pool's promise counts it once."""
    ledger = _ledger(overcommit=True, max_live=8)
    attacker = ledger.try_reserve(len(VICTIM) + 4, VICTIM)
    claimed = ledger.reserved_blocks
    _victim_computes(ledger)
    assert ledger.pin_cached(attacker, VICTIM) == 12
    assert attacker.draws_left + len(attacker.block_ids) == attacker.num_blocks
    assert ledger.reserved_blocks <= claimed + 5  # the victim's 5, the attacker's no more
