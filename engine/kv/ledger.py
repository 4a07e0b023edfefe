"""The KV reservation ledger: an admitted request can always reach its output cap, and
requests whose prompts begin alike share the blocks of that prefix (prefix caching).

Admitting a request reserves ``blocks_for(prompt + cap)`` blocks for its life (a
``Reservation``: cached blocks it pinned, those it may draw): it never runs out mid-decode.

Accounting. Each physical block is in use (held by a reservation), cached (held by none
but registered, so it can be pinned again; see ``block_pool``) or free. Reserving
(``--admission reserve``) the ledger keeps ``in_use + outstanding <= num_blocks``,
``outstanding`` being the draws all live reservations may still make:

- admission adds the request's draws (per choice) and the hits it pins that were cached
  (ref 0 -> 1; a hit already in use costs nothing, and ``n`` choices pinning the same
  block count it once); it succeeds iff the sum stays within the pool. Cached blocks
  thus count as free for admission, and a pinned block cannot be evicted;
- a request about to start pins the blocks cached since its admission (``pin_cached``),
  each in place of a draw;
- a draw moves one block from outstanding to in use: it never fails, and evicts a cached
  block, least recently released first, only when no free block is left;
- a release drops each of its blocks' reference counts (at zero a registered block is
  cached, an unregistered one free) and gives up the draws it did not make.

``--admission safe`` (``overcommit``, the default) keeps a weaker invariant that keeps the
promise: admissions, draws and pins are allowed while every live reservation can still
reach its cap in some order (``safety.py``, the banker's algorithm); a draw that would
break that is refused (``grow`` returns short) and its request pauses a step.

Prefix caching (``prefix_cache.py``) decides which cached blocks a prompt finds; the
ledger pins them and keeps the counts.

Figures: ``used_blocks`` = in use; ``reserved_blocks`` = in use + outstanding;
``free_blocks`` = ``num_blocks - reserved_blocks``, what admission may still claim
(cached included; negative when over-committed); ``cached_blocks`` (evictable);
``evicted_blocks``. What a request would claim now, with the cache as it is, is its quote
(``quote.py``).

Thread-safe: the server reserves and releases on the asyncio thread, the engine draws,
registers and releases in its worker thread; one lock guards it all.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvledger.engine.errors import BadInput
from kvledger.engine.kv import claims
from kvledger.engine.kv.block_pool import BlockPool, Salt
from kvledger.engine.kv.events import KVEventLog
from kvledger.engine.kv.prefix_cache import PrefixCache
from kvledger.engine.kv.reservation import PromptShare, Reservation
from kvledger.engine.kv.safety import Overcommit


class KVLedger:
    """Verb-based allocator over ``num_blocks`` blocks of ``block_size`` tokens each:
    ``try_reserve``, ``pin_cached``, ``grow``, ``release`` (module docstring); what its
    prompts find and register is its ``prefix_cache``."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False,
                 overcommit: bool = False, max_live: int | None = None,
                 max_adapters: int | None = None, events: KVEventLog | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise BadInput(f"a KV pool needs >= 1 block of >= 1 token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._pool = BlockPool(num_blocks, events)
        self._outstanding = 0
        self.overcommit = (Overcommit(num_blocks, block_size, max_live, self._pool, max_adapters)
                           if overcommit else None)  # --admission safe (safety.py)
        self._lock = threading.Lock()
        self.prefix_cache = PrefixCache(self._pool, block_size, self._lock,
                                        enabled=enable_prefix_caching, events=events)

    # -- figures ------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        return self._pool.num_in_use

    @property
    def reserved_blocks(self) -> int:
        with self._lock:  # two counters: read them together
            return self._pool.num_in_use + self._outstanding

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self.reserved_blocks

    @property
    def cached_blocks(self) -> int:
        return self._pool.num_cached

    @property
    def paused_reservations(self) -> int:  # refused a draw on their last try (--admission safe)
        return len(self.overcommit.paused) if self.overcommit else 0

    @property
    def evicted_blocks(self) -> int:  # cached blocks a draw evicted, finding no free one
        return self._pool.num_evictions

    def blocks_for(self, num_tokens: int) -> int:
        return claims.blocks_for(num_tokens, self.block_size)

    def timelines(self) -> list[tuple[int, ...]] | None:
        """Over-committing, the live reservations as admission projects them (``peak_blocks``)."""
        with self._lock:
            return None if self.overcommit is None else [*map(tuple, self.overcommit.live.values())]

    # -- admission ----------------------------------------------------------------------
    def try_reserve(self, num_tokens: int, prompt_token_ids: Sequence[int] | None = None, *,
                    use_cached: bool = True, salt: Salt | str | None = None,
                    adapter: object | None = None) -> Reservation | None:
        """Claim blocks for ``num_tokens`` tokens (prompt + cap), or None: see ``try_reserve_each``."""
        reservations = self.try_reserve_each(num_tokens, 1, prompt_token_ids,
                                             use_cached=use_cached, salt=salt, adapter=adapter)
        return reservations[0] if reservations else None

    def try_reserve_each(self, num_tokens: int, count: int,
                         prompt_token_ids: Sequence[int] | None = None, *,
                         use_cached: bool = True, salt: Salt | str | None = None,
                         adapter: object | None = None, kept: tuple[int, int] = (0, 0)
                         ) -> list[Reservation] | None:
        """``count`` reservations of ``num_tokens`` tokens each (one per choice of an
        ``n > 1`` request), all or none: None when they do not all fit now.

        With prefix caching on and the prompt's ids, each reservation pins the cached
        blocks its prompt begins with, unless ``use_cached`` is False (the request needs
        every prompt position computed); the prompt's keys are kept for ``register``. A
        ``salt`` (vLLM's ``cache_salt``) keys its blocks apart: only a request with the
        same salt finds them, or is found by it. ``adapter``: the request's LoRA adapter
        (None: the base model), for the slot it will take: one per adapter object. It is
        admitted only while safe without the ``kept`` blocks and seats (headroom)."""
        quote = self.prefix_cache.quote(num_tokens, count, prompt_token_ids, use_cached, salt)
        with self._lock:
            price = quote.price(self._pool)
            hits, shared = price.hits, price.shared
            if self.overcommit is None:
                if (self._pool.num_in_use + self._outstanding + price.blocks
                        > self.num_blocks - kept[0]):
                    return None
            elif not self.overcommit.admits(self._pool.num_in_use, self._outstanding,
                                            self._pool.ref_counts, count, price.draws, hits,
                                            price.revived, quote.prompt_tokens, num_tokens,
                                            shared, adapter, kept=kept):
                return None
            for block in hits:
                self._pool.pin(block, count)
            self._outstanding += price.promised
            self.prefix_cache.admitted(quote, len(hits))
            prompt = prompt_token_ids if self.prefix_cache.enabled else None
            reservations = [Reservation(quote.needed, hits, self.block_size, quote.hashes,
                                        prompt, quote.root, adapter, salt)
                            for _ in range(count)]
            if self.overcommit is not None:
                self.overcommit.admit(reservations, quote.prompt_tokens, num_tokens, shared)
        if shared:
            PromptShare.begin(reservations, len(hits), len(hits) + shared)
        return reservations

    def check_fits(self, num_tokens: int, count: int = 1, prompt_tokens: int = 0, *,
                   share: bool = False, kept_blocks: int = 0) -> int:
        """``claims.check_fits`` against this pool."""
        return claims.check_fits(num_tokens, count, prompt_tokens, self.block_size,
                                 self.num_blocks, share=share, kept_blocks=kept_blocks)

    def blocks_needed(self, num_tokens: int, count: int = 1,
                      prompt_token_ids: Sequence[int] | None = None, *,
                      use_cached: bool = True, salt: Salt | str | None = None) -> int:
        """The blocks ``try_reserve_each`` would claim now (its draws, and the cached
        blocks it would pin); without a prompt or caching, ``count * blocks_for``."""
        quote = self.prefix_cache.quote(num_tokens, count, prompt_token_ids, use_cached, salt)
        with self._lock:
            return quote.price(self._pool).blocks

    def blocks_returned(self, groups: Sequence[Sequence[Reservation]]) -> list[int]:
        """``claims.returned_in_order`` against the pool's holders now."""
        with self._lock:
            return claims.returned_in_order(groups, self._pool.ref_counts)

    # -- the engine's verbs ---------------------------------------------------------------
    def seat(self, reservation: Reservation) -> bool:
        """Its request is about to be scheduled (it takes a seat, and a slot for its
        adapter): True, unless over-committing that could leave a request that must finish
        first without a seat or slot (it then waits in line)."""
        with self._lock:
            if reservation.released:
                return False
            if self.overcommit is not None and not reservation.seated and not (
                    self.overcommit.may_seat(reservation, self._pool.num_in_use,
                                             self._outstanding, self._pool.ref_counts)):
                return False
            reservation.seated = True
            return True

    def head(self) -> Reservation | None:
        """Over-committing, the reservation to run first this step: its draws, a seat and
        a slot for its adapter are what the safety check counted on (``safety.py``).
        None when every promise can be drawn at once, or when reserving."""
        if self.overcommit is None:
            return None
        with self._lock:
            return self.overcommit.head(self._pool.num_in_use, self._outstanding)

    def pin_cached(self, reservation: Reservation, prompt_token_ids: Sequence[int]) -> int:
        """Before a reservation has drawn a block (its request is about to start): pin the
        cached blocks its prompt begins with that were registered since admission. Each
        one replaces a draw, so the claim never grows (it shrinks by one per block that
        was already in use). Returns the prompt tokens now cached; does nothing with
        caching off. Only for a request that may use cached blocks (no prompt logprobs)."""
        start = reservation.num_cached_blocks
        keys = self.prefix_cache.keys_to_pin(reservation, prompt_token_ids)
        if keys is None:
            return reservation.num_cached_tokens
        with self._lock:
            if reservation.released:
                return reservation.num_cached_tokens
            found = self.prefix_cache.find(keys)
            if self.overcommit is not None and not self.overcommit.may_pin(
                    reservation, found, self._pool.num_in_use, self._pool.ref_counts):
                found = []  # it draws them instead, as the check allows
            for block in found:
                self._pool.pin(block)
                reservation.block_ids.append(block)
                reservation.draws_left -= 1
                self._outstanding -= 1
            return self.prefix_cache.pinned(reservation, start)

    def grow(self, reservation: Reservation, num_tokens: int) -> int:
        """Hold blocks for the reservation's first ``num_tokens`` tokens; returns the tokens
        held: fewer when a safe admission refuses a draw (it pauses until one succeeds)."""
        needed = self.blocks_for(num_tokens)
        if needed > reservation.num_blocks:
            raise RuntimeError(f"{reservation!r} cannot hold {num_tokens} tokens")  # engine bug
        if reservation.released:
            raise RuntimeError("grow() on a released reservation")
        safety = self.overcommit
        with self._lock:
            while len(reservation.block_ids) < needed:
                if safety is not None and not safety.may_draw(
                        reservation, self._pool.num_in_use, self._outstanding,
                        self._pool.ref_counts):
                    safety.pause(reservation)
                    return len(reservation.block_ids) * self.block_size
                # Never fails: reserving, this draw is in outstanding; else checked above.
                reservation.block_ids.append(self._pool.draw())
                reservation.draws_left -= 1
                self._outstanding -= 1
            if safety is not None:
                safety.advance(reservation, num_tokens)
        return num_tokens

    def share_prompt(self, owner: Reservation) -> list[Reservation]:
        """Once ``owner`` has computed its prompt: pin its shared blocks for the choices
        waiting for them, which then start after them. Returns those choices."""
        with self._lock:
            share = owner.share
            if share is None or share.owner is not owner or owner.released:
                return []
            waiting = len(share.waiting)
            handed = share.hand_out(self._pool, self.block_size,
                                    self.overcommit and self.overcommit.may_share)
            self._outstanding += (waiting - len(handed)) * (share.end - share.start)
            return handed

    def release(self, reservation: Reservation, *, uncache: bool = False) -> None:
        """Give back the reservation's blocks and undrawn claim; a second call does nothing.
        An owner of a prompt share released before sharing hands its claim on the shared
        blocks to the first choice still waiting (see ``PromptShare``). ``uncache``: the
        blocks it computed are not to be found by later requests (its forward pass went
        non-finite: their K/V may be too)."""
        with self._lock:
            if reservation.released:
                return
            if uncache:
                self.prefix_cache.forget(reservation.block_ids[reservation.num_cached_blocks:])
            reservation.released = True
            if self.overcommit is not None:
                self.overcommit.forget(reservation)
            if reservation.share is not None:
                self._outstanding += reservation.share.leave(reservation)
            # The tail first: it is evicted before the head, which stays useful without it.
            for block in reversed(reservation.block_ids):
                self._pool.unpin(block)
            reservation.block_ids = []
            self._outstanding -= reservation.draws_left
            reservation.draws_left = 0
