"""The block keys KV events publish: vLLM's own, so a router sees the keys it would get
from vLLM for the same tokens.

A router that routes by prefix turns a prompt into block keys itself and looks them up
among those each pod published (llm-d's indexer does, for vLLM run with
``--prefix-caching-hash-algo sha256_cbor``); the keys must then be computed as vLLM
computes them, whatever the engine uses inside. vLLM 0.32 (``kv_cache_utils.hash_block_tokens``):

    key(block) = H((parent key, tuple(block's tokens), extra keys or None))
    parent of a prompt's first block = H(seed)    # "vllm-none-hash", or $PYTHONHASHSEED

with ``H`` sha256 of the pickled tuple (``sha256``, vLLM's default) or of its canonical
CBOR (``sha256_cbor``), and extra keys tagged by source: ``("lora", name, path)`` on every
block of an adapter's request, then ``("cache_salt", salt)`` on its first. Published as
the low 64 bits (``external_hash``). tests/server/test_kv_events_wire.py checks them
against the keys vLLM published for the same prompts. kvledger's prefix cache keys its
lookups its own way (BLAKE2b, ``block_pool.py``); these are computed only with events on.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_SEED = "vllm-none-hash"  # vLLM 0.32's DEFAULT_NONE_HASH_SEED


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    import cbor2  # only with --prefix-caching-hash-algo sha256_cbor

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def hash_function(algo: str) -> Callable[[Any], bytes]:
    return {"sha256": _sha256, "sha256_cbor": _sha256_cbor}[algo]


def external_hash(key: bytes) -> int:
    """A key as vLLM publishes it by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``):
    the low 64 bits, big-endian."""
    return int.from_bytes(key, "big") & 0xFFFF_FFFF_FFFF_FFFF


class EventKeys:
    """vLLM's key chain for one hash algorithm (and the process's seed, as vLLM reads it)."""

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        self._hash = hash_function(algo)
        self.root = self._hash(seed if seed is not None
                               else os.environ.get("PYTHONHASHSEED", DEFAULT_SEED))

    def extend(self, chain: list[bytes], token_ids: Sequence[int], count: int,
               block_size: int, extra: Callable[[int], tuple | None]) -> None:
        """Make ``chain`` (a sequence's keys, in place) its first ``count`` blocks' keys;
        ``extra(i)``: block ``i``'s tagged extra keys, or None."""
        for i in range(len(chain), count):
            parent = chain[-1] if chain else self.root
            tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
            chain.append(self._hash((parent, tokens, extra(i))))
