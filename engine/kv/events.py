"""KV-cache events: what the prefix cache gained and lost, as vLLM 0.32 publishes them.

A router that routes by prefix (llm-d's, the Gateway API Inference Extension's endpoint
picker) keeps an index of the blocks each pod holds from these events. The types below
encode exactly as vLLM's (``vllm/distributed/kv_events.py``: msgspec structs, a batch as
an array ``[ts, events, data_parallel_rank]``, each event a map tagged by ``type`` with
defaults omitted, in vLLM's field order), so a consumer decodes kvledger's frames with
vLLM's schema; tests/data/kv_events holds vLLM's own frames, recorded, and the test
decodes both with these types.

- ``BlockStored``: full blocks became findable (``KVLedger.register``): their keys, the
  key before the first (``parent_block_hash``; None for a prompt's first block), their
  tokens, the block size, the LoRA adapter, ``extra_keys`` per block as vLLM's: the
  adapter's name, then the client's ``cache_salt`` on a prompt's first block.
- ``BlockRemoved``: a block is findable no more (evicted by a draw, or forgotten), one
  event per block as vLLM sends them.
- ``AllBlocksCleared``: ``/reset_prefix_cache``; nothing registered before it is findable.

Published keys are vLLM's for the same tokens (``event_keys.py``), not the ledger's own:
a router that computes keys from a prompt finds kvledger's blocks as it finds vLLM's.

The log is written (under its own lock) from whichever thread draws or registers, and
sealed into a batch after every engine step (and after a reset); the publisher's thread
(``core/kv_publisher.py``) takes sealed batches, so encoding and sending stay off the
step. With events off the ledger has no log and none of this runs.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from kvledger.engine.kv.event_keys import EventKeys, external_hash


class Stored(Protocol):
    """What a stored block's event reads of its reservation (``reservation.py``)."""

    event_keys: list[bytes]  # vLLM's keys of its blocks so far
    adapter: Any  # its LoRA adapter (name, lora_int_id, path), or None
    salt: Any  # its Salt (the client's part published), or None

MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV pool, whatever the device


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to the prefix cache (vLLM's base class)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVEventLog:
    """The events since the last ``seal``, and the sealed batches the publisher has not
    taken yet (at most ``max_batches``: a publisher that cannot keep up loses the oldest,
    as vLLM's queue does when full, rather than holding memory without bound).

    ``sliding_window``: the model's, which every stored block carries (vLLM's cache spec:
    ``sliding_window`` with its size, else ``full_attention``). ``hash_algo``: how the
    published keys are made (``event_keys.py``: vLLM's, for the same tokens)."""

    def __init__(self, block_size: int, sliding_window: int | None = None,
                 max_batches: int = 100_000, hash_algo: str = "sha256") -> None:
        self.block_size = block_size
        self.keys = EventKeys(hash_algo)
        self._kind = "full_attention" if sliding_window is None else "sliding_window"
        self._window = sliding_window
        self._events: list[KVCacheEvent] = []
        self._published: dict[bytes, bytes] = {}  # each findable block's published key
        self._batches: deque[KVEventBatch] = deque(maxlen=max_batches)
        self._lock = threading.Lock()  # the events: written by any thread, sealed by one
        self._sealed = threading.Condition()

    def stored(self, reservation: Stored, hashes: Sequence[bytes],
               indices: Sequence[int], token_ids: Sequence[int]) -> None:
        """The blocks at ``indices`` (ascending) of ``reservation`` became findable under
        the ledger's keys ``hashes``: one ``BlockStored`` per run of consecutive blocks,
        keyed as vLLM keys them (its ``event_keys``, extended), with its adapter and its
        client's salt."""
        chain, adapter = reservation.event_keys, reservation.adapter
        client_salt = reservation.salt.published if reservation.salt else None
        lora = () if adapter is None else (("lora", adapter.name, adapter.path),)

        def extra(i: int) -> tuple | None:
            tagged = (*lora, ("cache_salt", client_salt)) if i == 0 and client_salt else lora
            return tagged or None

        known = self._published  # blocks found cached: their keys need no hashing again
        while len(chain) < indices[0] and hashes[len(chain)] in known:
            chain.append(known[hashes[len(chain)]])
        self.keys.extend(chain, token_ids, indices[-1] + 1, self.block_size, extra)
        runs: list[list[int]] = []
        for i in indices:
            if runs and i == runs[-1][-1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        with self._lock:
            for run in runs:
                for i in run:
                    self._published[hashes[i]] = chain[i]
                self._events.append(self._block_stored(run, chain, token_ids, adapter, extra))

    def _block_stored(self, run: list[int], chain: list[bytes], token_ids: Sequence[int],
                      adapter: Any, extra: Any) -> BlockStored:
        first, size = run[0], self.block_size
        untagged = [None if extra(i) is None else tuple(key[1] for key in extra(i))
                    for i in run]  # vLLM publishes the values alone: name, then salt
        return BlockStored(
            block_hashes=[external_hash(chain[i]) for i in run],
            parent_block_hash=None if first == 0 else external_hash(chain[first - 1]),
            token_ids=list(token_ids[first * size:(run[-1] + 1) * size]),
            block_size=size,
            lora_id=None if adapter is None else adapter.lora_int_id,
            medium=MEDIUM_GPU,
            lora_name=None if adapter is None else adapter.name,
            extra_keys=untagged, group_idx=0, kv_cache_spec_kind=self._kind,
            kv_cache_spec_sliding_window=self._window)

    def removed(self, block_hash: bytes) -> None:
        """The block the ledger keyed ``block_hash`` is findable no more."""
        with self._lock:
            key = self._published.pop(block_hash, None)
            if key is not None:  # else it was never published (stored before events)
                self._events.append(BlockRemoved(block_hashes=[external_hash(key)],
                                                 medium=MEDIUM_GPU, group_idx=0))

    def cleared(self) -> None:
        with self._lock:
            self._published.clear()
            self._events.append(AllBlocksCleared())

    def seal(self) -> None:
        """Close the events so far into one batch (none if there are none) for the
        publisher: after each engine step, and after a reset."""
        if not self._events:
            return
        with self._lock:
            batch = KVEventBatch(ts=time.time(), events=self._events)
            self._events = []
        with self._sealed:
            self._batches.append(batch)
            self._sealed.notify()

    def take(self, timeout: float) -> list[KVEventBatch]:
        """The sealed batches, oldest first, waiting up to ``timeout`` s for one."""
        with self._sealed:
            if not self._batches:
                self._sealed.wait(timeout)
            batches = list(self._batches)
            self._batches.clear()
        return batches
