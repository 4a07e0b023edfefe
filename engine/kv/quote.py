"""A quote: what a request would claim of the pool now, before it claims it. Its prompt's
keys are hashed before the ledger's lock is taken (the slow part); under the lock, the
cached blocks they find price it: the draws each of its ``count`` choices may make, the
cached blocks held by none that pinning takes out of the cache (revived), and the prompt
blocks the choices share (drawn once). ``KVLedger.try_reserve_each`` claims what the price
says, ``KVLedger.blocks_needed`` only reads it; neither changes the quote."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvledger.engine.kv import claims
from kvledger.engine.kv.block_pool import BlockHash, BlockPool, Salt, salt_root


@dataclass(frozen=True)
class Price:
    """A quote against the pool's cache now: each choice pins ``hits`` and may draw
    ``draws`` blocks; ``revived`` of the hits are cached blocks held by none; the choices
    but the first pin ``shared`` prompt blocks the first draws."""

    hits: list[int]
    draws: int
    revived: int
    shared: int
    count: int

    @property
    def promised(self) -> int:
        """The draws promised: each choice's, the shared blocks once."""
        return self.draws * self.count - self.shared * (self.count - 1)

    @property
    def blocks(self) -> int:
        """What admitting claims of the pool: the draws promised and the hits revived."""
        return self.promised + self.revived


@dataclass(frozen=True)
class Quote:
    """``count`` reservations of ``num_tokens`` (prompt + cap), ``needed`` blocks each: the
    keys of the prompt's full blocks (``hashes``, chained from ``root``, its salt), of which
    the first ``lookups`` may be hits (None: the cache is not consulted), and the
    ``shareable`` prompt blocks its choices can share."""

    num_tokens: int
    count: int
    prompt_tokens: int
    needed: int
    hashes: list[BlockHash]
    lookups: int | None
    shareable: int
    root: BlockHash | None

    @classmethod
    def of(cls, num_tokens: int, count: int, prompt_token_ids: Sequence[int] | None,
           block_size: int, *, caching: bool, use_cached: bool,
           salt: Salt | str | None) -> Quote:
        """The quote for a request, outside the lock (``claims.prompt_keys``: BadInput for
        no tokens, or a prompt longer than ``num_tokens``)."""
        root = salt_root(salt)
        needed, hashes, lookups = claims.prompt_keys(
            num_tokens, count, prompt_token_ids, block_size, caching=caching,
            use_cached=use_cached, root=root)
        prompt_tokens = len(prompt_token_ids or ())
        shareable = claims.shareable_blocks(count, prompt_tokens, block_size, use_cached)
        return cls(num_tokens, count, prompt_tokens, needed, hashes, lookups, shareable, root)

    def price(self, pool: BlockPool) -> Price:
        """What it claims with the blocks ``pool`` has cached now (the hits: up to the
        first miss). Under the ledger's lock."""
        hits = pool.find(self.hashes[:self.lookups or 0])
        revived = sum(1 for block in hits if pool.ref_counts[block] == 0)
        return Price(hits, self.needed - len(hits), revived,
                     max(0, self.shareable - len(hits)), self.count)
