"""The physical KV blocks: reference counts, the free list, and the prefix cache.

Every block is in exactly one state:

- **in use**: ``ref_count > 0``, held by one or more live reservations;
- **cached**: ``ref_count == 0`` but registered under its ``block_hash``, so a request
  whose prompt begins with the same tokens can pin it again; evicted least recently
  released first, and only when a draw finds no free block;
- **free**: ``ref_count == 0``, holding nothing anyone can find.

Not thread-safe on its own: ``KVLedger`` calls it under its lock.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvledger.engine.kv.events import KVEventLog

BlockHash = bytes


@dataclass(frozen=True)
class Salt:
    """A prompt's cache salt: ``text`` keys its blocks apart (every part of it: an
    adapter's, an API key's, the client's); ``published`` is the client's own
    ``cache_salt`` as sent, the one part KV events carry (vLLM's ``extra_keys``)."""

    text: str
    published: str | None = None


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The key of a full block: its tokens and, through ``parent`` (the previous block's
    key, None for the first), every token before them. BLAKE2b, so a crafted prompt
    cannot collide with another request's prefix to read its cache."""
    return _hash(parent, array("q", token_ids).tobytes())


def salt_root(salt: Salt | str | bytes | None) -> BlockHash | None:
    """The parent key of a salted prompt's first block (None: unsalted). Requests whose
    salts differ never find each other's blocks, since every key chains from this one
    (vLLM's ``cache_salt``)."""
    if salt is None:
        return None
    if isinstance(salt, Salt):
        salt = salt.text
    data = salt.encode("utf-8", "surrogatepass") if isinstance(salt, str) else salt
    return _hash(b"kvledger-cache-salt", data)


def hash_blocks(token_ids: Sequence[int], block_size: int, num_blocks: int,
                parent: BlockHash | None = None) -> list[BlockHash]:
    """The keys of the first ``num_blocks`` full blocks of ``token_ids``."""
    data = memoryview(array("q", token_ids[:num_blocks * block_size]).tobytes())
    width = 8 * block_size
    hashes = []
    for start in range(0, num_blocks * width, width):
        parent = _hash(parent, data[start:start + width])
        hashes.append(parent)
    return hashes


def _hash(parent: BlockHash | None, data: bytes | memoryview) -> BlockHash:
    return hashlib.blake2b((parent or b"") + data, digest_size=16).digest()


class BlockPool:
    """``events``: where a block becoming findable no more is logged (KV events), or None."""

    def __init__(self, num_blocks: int, events: KVEventLog | None = None) -> None:
        self.num_blocks = num_blocks
        self.events = events
        self.ref_counts = [0] * num_blocks
        self.shared: set[int] = set()  # blocks held more than once (``ref_counts`` >= 2)
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._by_hash: dict[BlockHash, int] = {}
        self.num_in_use = 0
        self.num_evictions = 0

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block registered under ``block_hash`` (in use or cached), if any."""
        return self._by_hash.get(block_hash)

    def find(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The blocks registered under ``hashes``, in order, up to the first missing one."""
        found = []
        for block_hash in hashes:
            block = self._by_hash.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def draw(self) -> int:
        """A block to write, held once: a free one, else the least recently released
        cached one, evicted. The ledger only draws while one of the two exists."""
        if self._free:
            block = self._free.popleft()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            block_hash = self._hash_of[block]
            del self._by_hash[block_hash]
            self._hash_of[block] = None
            self.num_evictions += 1
            if self.events is not None:
                self.events.removed(block_hash)
        else:
            raise RuntimeError("no free or cached block to draw")  # a ledger bug
        self.ref_counts[block] = 1
        self.num_in_use += 1
        return block

    def pin(self, block: int, times: int = 1) -> None:
        """Hold a registered block ``times`` more (a cached one is in use again)."""
        if self.ref_counts[block] == 0:
            del self._cached[block]
            self.num_in_use += 1
        self.ref_counts[block] += times
        if self.ref_counts[block] >= 2:
            self.shared.add(block)

    def unpin(self, block: int) -> None:
        """Drop one hold; at zero a registered block is cached (most recent), others free."""
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} released more often than held")  # a ledger bug
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 1:
            self.shared.discard(block)
        elif self.ref_counts[block] == 0:
            self.num_in_use -= 1
            if self._hash_of[block] is None:
                self._free.append(block)
            else:
                self._cached[block] = None

    def forget(self, block: int) -> None:
        """Make ``block`` findable no more (its K/V are not to be trusted); held by none,
        it is free rather than cached."""
        block_hash = self._hash_of[block]
        if block_hash is None:
            return
        del self._by_hash[block_hash]
        self._hash_of[block] = None
        if self.ref_counts[block] == 0:
            del self._cached[block]
            self._free.append(block)
        if self.events is not None:
            self.events.removed(block_hash)

    def forget_all(self) -> int:
        """Nothing registered is findable any more (vLLM's reset of the prefix cache):
        cached blocks are free, how many is returned; blocks running requests hold stay
        theirs, to be freed when released. One ``AllBlocksCleared`` says it all."""
        freed = len(self._cached)
        self._free.extend(self._cached)
        self._cached.clear()
        self._by_hash.clear()
        self._hash_of = [None] * self.num_blocks
        if self.events is not None:
            self.events.cleared()
        return freed

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """Make a full, computed block findable under ``block_hash``; False (it stays
        private) when another block already holds that key."""
        if block_hash in self._by_hash or self._hash_of[block] is not None:
            return False
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash
        return True
