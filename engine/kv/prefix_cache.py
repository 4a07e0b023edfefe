"""The prefix cache: requests whose prompts begin alike find the blocks of that prefix
again (vLLM's automatic prefix caching), keyed by a chain of hashes of their tokens.

The ledger (``ledger.py``) owns who holds which block and what each reservation may still
draw; this part owns what can be *found*: a prompt's keys and the blocks they find at
admission (``quote``) and again as its request starts (``keys_to_pin``, ``find``), the
blocks made findable as their K/V are computed (``register``, with their KV events),
those made unfindable (``forget``, ``reset``) and vLLM's figures, ``queries`` and
``hits`` in prompt tokens. It shares the ledger's pool and lock.

A block found is never written: hits are whole blocks before the prompt's last token
(when every prompt block is cached the last hit is dropped, so at least one token is
computed and gives the logits), the sequence starts its prefill after them and writes
only blocks it drew. A drawn block becomes findable once it is full and its K/V computed
(prompt blocks, and blocks of generated tokens, so a chat that re-sends its history
hits); when its key already names another block it stays private. A ``salt`` (vLLM's
``cache_salt``) roots the chain apart: only a request with the same salt finds its
blocks, or is found by them. A request that needs the logits of every prompt position
(``prompt_logprobs``) quotes with ``use_cached=False``: it finds nothing, though its
blocks are still registered for others. With caching off nothing is looked up or
registered and every quote is ``blocks_for(prompt + cap)`` per choice.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvledger.engine.kv import claims
from kvledger.engine.kv.block_pool import BlockHash, BlockPool, Salt
from kvledger.engine.kv.events import KVEventLog
from kvledger.engine.kv.quote import Quote
from kvledger.engine.kv.reservation import Reservation


class PrefixCache:
    """What of the ledger's pool can be found again by a prompt (module docstring)."""

    def __init__(self, pool: BlockPool, block_size: int, lock: threading.Lock, *,
                 enabled: bool, events: KVEventLog | None = None) -> None:
        self.enabled = enabled
        self.events = events  # KV events (kv/events.py), or None
        self.queries = 0  # prompt tokens looked up, as vLLM's prefix_cache_queries
        self.hits = 0     # of them found cached
        self._pool = pool
        self._block_size = block_size
        self._lock = lock  # the ledger's

    def quote(self, num_tokens: int, count: int, prompt_token_ids: Sequence[int] | None,
              use_cached: bool, salt: Salt | str | None) -> Quote:
        """What ``count`` choices of ``num_tokens`` would claim, its keys hashed now
        (outside the lock); ``Quote.price`` finds them under it."""
        return Quote.of(num_tokens, count, prompt_token_ids, self._block_size,
                        caching=self.enabled, use_cached=use_cached, salt=salt)

    def admitted(self, quote: Quote, hits: int) -> None:
        """Count an admitted quote's look-up: each choice's prompt, ``hits`` blocks of it
        found. Under the lock."""
        if quote.lookups is not None:  # the cache was consulted for this prompt
            self.queries += quote.prompt_tokens * quote.count
            self.hits += hits * self._block_size * quote.count

    def keys_to_pin(self, reservation: Reservation,
                    prompt_token_ids: Sequence[int]) -> list[BlockHash] | None:
        """Before it draws (its request is about to start), the keys of the prompt blocks
        past ``reservation``'s hits that may have been registered since admission; None
        when there are none to look up (caching off, a block drawn, no full block left).
        Outside the lock: hashing is the slow part."""
        start = reservation.num_cached_blocks
        if not self.enabled or len(reservation.block_ids) > start:
            return None
        if reservation.prompt_token_ids is None:  # reserved without its prompt: not counted yet
            with self._lock:
                self.queries += len(prompt_token_ids)
        lookups = claims.cacheable_blocks(len(prompt_token_ids), self._block_size)
        if start >= lookups:
            return None
        keys = claims.extend_keys(reservation.block_hashes, reservation.root,
                                  prompt_token_ids, self._block_size, lookups)
        return keys[start:lookups]

    def find(self, keys: Sequence[BlockHash]) -> list[int]:
        """The blocks cached under ``keys``, up to the first miss. Under the lock."""
        return self._pool.find(keys)

    def pinned(self, reservation: Reservation, start: int) -> int:
        """``reservation`` now holds hits up to its blocks drawn so far, ``start`` of them
        at admission: count them. Returns its cached tokens. Under the lock."""
        cached = len(reservation.block_ids)
        self.hits += (cached - start) * self._block_size
        reservation.num_cached_blocks = reservation.num_registered_blocks = cached
        reservation.num_cached_tokens = cached * self._block_size
        return reservation.num_cached_tokens

    def register(self, reservation: Reservation, token_ids: Sequence[int],
                 num_computed_tokens: int) -> None:
        """Make the reservation's full blocks among its first ``num_computed_tokens``
        tokens (whose K/V are now in the cache; ``token_ids`` are its tokens so far)
        findable by later requests. Does nothing with caching off."""
        full = min(num_computed_tokens // self._block_size, len(reservation.block_ids))
        if not self.enabled or full <= reservation.num_registered_blocks:
            return
        hashes = claims.extend_keys(reservation.block_hashes, reservation.root, token_ids,
                                    self._block_size, full)
        with self._lock:
            if reservation.released:
                return
            stored = [i for i in range(reservation.num_registered_blocks, full)
                      if self._pool.register(reservation.block_ids[i], hashes[i])]
            reservation.num_registered_blocks = full
            if self.events is not None and stored:
                self.events.stored(reservation, hashes, stored, token_ids)

    def forget(self, blocks: Sequence[int]) -> None:
        """``blocks`` are not to be found again (their K/V may be wrong). Under the lock."""
        for block in blocks:
            self._pool.forget(block)

    def reset(self) -> int:
        """vLLM's reset: nothing cached is found again; those blocks are freed. Returns them."""
        with self._lock:
            return self._pool.forget_all()
