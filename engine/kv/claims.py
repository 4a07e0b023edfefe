"""What a request claims of the KV pool, worked out before the ledger's lock is taken:
the pure arithmetic of blocks (no pool state), shared by admission and the ledger."""

from __future__ import annotations

from collections.abc import Sequence

from kvledger.engine.errors import BadInput
from kvledger.engine.kv.block_pool import BlockHash, hash_blocks


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def shareable_blocks(count: int, prompt_tokens: int, block_size: int, share: bool) -> int:
    """The full prompt blocks ``count`` choices of one request can share: those before the
    block of the prompt's last token, which each choice computes itself (its logits
    start it); 0 when they do not share (``share`` False, or a single choice)."""
    if count < 2 or prompt_tokens < 1 or not share:
        return 0
    return (prompt_tokens - 1) // block_size


def prompt_keys(num_tokens: int, count: int, prompt_token_ids: Sequence[int] | None,
                block_size: int, *, caching: bool, use_cached: bool,
                root: BlockHash | None) -> tuple[int, list[BlockHash], int | None]:
    """Blocks per reservation of ``num_tokens`` (prompt + cap), the keys of the prompt's
    full blocks (hashing is the slow part: it runs outside the lock) and how many of them
    may be hits (None when the cache is not consulted at all)."""
    if num_tokens < 1 or count < 1:
        raise BadInput(f"a reservation needs at least one token, got {count} x {num_tokens}")
    needed = blocks_for(num_tokens, block_size)
    if not caching or not prompt_token_ids:
        return needed, [], None
    if len(prompt_token_ids) > num_tokens:
        raise BadInput(f"a prompt of {len(prompt_token_ids)} tokens does not fit a "
                       f"reservation of {num_tokens}")
    hashes = hash_blocks(prompt_token_ids, block_size, len(prompt_token_ids) // block_size, root)
    # The last prompt token is always computed: it gives the first output's logits.
    lookups = (len(prompt_token_ids) - 1) // block_size if use_cached else None
    return needed, hashes, lookups
