"""The KV reservation ledger: admission never over-commits the block pool.

Admitting a request reserves ``ceil((prompt + output cap) / block_size)`` blocks for its
whole life. Physical blocks are handed out lazily from the reservation as tokens are
written (``grow``), so a running request can never run out of KV mid-decode: the sum of
all reservations is at most the pool, and each reservation draws at most its own count.

Thread-safe: the HTTP server reserves and releases on the asyncio thread while the
engine grows reservations in its worker thread.
"""

from __future__ import annotations

import threading
from collections import deque

from kvledger.engine.errors import BadInput


class Reservation:
    """A claim on ``num_blocks`` blocks; ``block_ids`` are the physical blocks drawn so far."""

    __slots__ = ("block_ids", "num_blocks", "released")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.block_ids: list[int] = []
        self.released = False

    @property
    def used_blocks(self) -> int:
        return len(self.block_ids)

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self.used_blocks}/{self.num_blocks} used"
        return f"Reservation({state})"


class KVLedger:
    """Verb-based allocator over ``num_blocks`` blocks of ``block_size`` tokens each.

    ``reserved_blocks``: claimed by live reservations; ``used_blocks``: physically handed
    out; ``free_blocks``: not reserved, i.e. what the next admission may claim.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise BadInput(f"a KV pool needs >= 1 block of >= 1 token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._reserved = 0
        self._lock = threading.Lock()

    @property
    def reserved_blocks(self) -> int:
        return self._reserved

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free_block_ids)

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self._reserved

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_reserve(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.free_blocks

    def try_reserve(self, num_tokens: int) -> Reservation | None:
        """Claim blocks for ``num_tokens`` tokens, or return None when they are not free."""
        reservations = self.try_reserve_each(num_tokens, 1)
        return reservations[0] if reservations else None

    def try_reserve_each(self, num_tokens: int, count: int) -> list[Reservation] | None:
        """``count`` reservations of ``num_tokens`` tokens each (one per choice of an
        ``n > 1`` request), all or none: None when they do not all fit now."""
        if num_tokens < 1 or count < 1:
            raise BadInput(f"a reservation needs at least one token, got {count} x {num_tokens}")
        needed = self.blocks_for(num_tokens)
        with self._lock:
            if needed * count > self.num_blocks - self._reserved:
                return None
            self._reserved += needed * count
        return [Reservation(needed) for _ in range(count)]

    def grow(self, reservation: Reservation, num_tokens: int) -> None:
        """Make the reservation hold physical blocks for its first ``num_tokens`` tokens."""
        needed = self.blocks_for(num_tokens)
        if needed > reservation.num_blocks:
            raise RuntimeError(f"{reservation!r} cannot hold {num_tokens} tokens")  # engine bug
        if reservation.released:
            raise RuntimeError("grow() on a released reservation")
        with self._lock:
            # Never empty here: reservations sum to <= num_blocks, each draws <= its own.
            while len(reservation.block_ids) < needed:
                reservation.block_ids.append(self._free_block_ids.popleft())

    def release(self, reservation: Reservation) -> None:
        """Return the reservation's blocks to the pool; a second call does nothing."""
        with self._lock:
            if reservation.released:
                return
            reservation.released = True
            self._free_block_ids.extend(reservation.block_ids)
            reservation.block_ids = []
            self._reserved -= reservation.num_blocks
