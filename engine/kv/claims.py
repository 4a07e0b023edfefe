"""What a request claims of the KV pool, worked out before the ledger's lock is taken:
the pure arithmetic of blocks (no pool state), shared by admission and the ledger."""

from __future__ import annotations

from collections.abc import Sequence

from kvledger.engine.errors import BadInput, PoolTooSmall
from kvledger.engine.kv.block_pool import BlockHash, hash_blocks
from kvledger.engine.planner.pool import blocks_for


def cacheable_blocks(prompt_tokens: int, block_size: int) -> int:
    """The full blocks of a prompt a cache hit may cover: those before the block of its
    last token, which is always computed (it gives the first output's logits). THE rule:
    the ledger, the claims and the admission line call it."""
    return (prompt_tokens - 1) // block_size


def shareable_blocks(count: int, prompt_tokens: int, block_size: int, share: bool) -> int:
    """The full prompt blocks ``count`` choices of one request can share: those before the
    block of the prompt's last token, which each choice computes itself (its logits
    start it); 0 when they do not share (``share`` False, or a single choice)."""
    if count < 2 or prompt_tokens < 1 or not share:
        return 0
    return cacheable_blocks(prompt_tokens, block_size)


def choices_blocks(num_tokens: int, count: int, prompt_tokens: int, block_size: int,
                   share: bool) -> int:
    """What ``count`` choices of ``num_tokens`` (prompt + cap) claim with nothing cached:
    the shared prompt blocks (``share``) once."""
    shared = shareable_blocks(count, prompt_tokens, block_size, share)
    return blocks_for(num_tokens, block_size) * count - shared * (count - 1)



def check_fits(num_tokens: int, count: int, prompt_tokens: int, block_size: int,
               num_blocks: int, *, share: bool = False, kept_blocks: int = 0) -> int:
    """The rule "fits the pool": what ``choices_blocks`` claims, or PoolTooSmall when more
    than the pool less ``kept_blocks`` (headroom). Nothing cached counts, so the verdict is
    on the request, never on the moment."""
    blocks = choices_blocks(num_tokens, count, prompt_tokens, block_size, share)
    if blocks > num_blocks - kept_blocks:
        raise PoolTooSmall(blocks, num_blocks, num_tokens=num_tokens, count=count,
                           kept_blocks=kept_blocks)
    return blocks

def returned_in_order(groups: Sequence[Sequence], ref_counts: Sequence[int]) -> list[int]:
    """For groups of reservations released one group after another in this order, what
    each release would add to the free blocks: its undrawn claim, and each block it holds
    whose last holder it is by then (``ref_counts``: each block's holders now; a block
    also held by a later group, or by a reservation in none, comes back later or not at
    all)."""
    holds: dict[int, int] = {}  # block -> holders left after the releases so far
    returned = []
    for group in groups:
        freed = 0
        for reservation in group:
            if reservation.released:
                continue
            freed += reservation.draws_left
            for block in reservation.block_ids:
                holds[block] = holds.get(block, ref_counts[block]) - 1
                if holds[block] == 0:
                    freed += 1
        returned.append(freed)
    return returned


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
    lookups = cacheable_blocks(len(prompt_token_ids), block_size) if use_cached else None
    return needed, hashes, lookups


def extend_keys(hashes: list[BlockHash], root: BlockHash | None, token_ids: Sequence[int],
                block_size: int, count: int) -> list[BlockHash]:
    """``hashes``, the keys of a reservation's first full blocks known so far (chained from
    ``root``, its salt), extended in place to the first ``count`` full blocks of
    ``token_ids``; returned."""
    if len(hashes) < count:
        parent = hashes[-1] if hashes else root
        hashes += hash_blocks(token_ids[len(hashes) * block_size:], block_size,
                              count - len(hashes), parent)
    return hashes
