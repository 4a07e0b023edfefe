"""What reading one model before planning may take: the bytes pulled from a hub (config.json,
the index and every shard's safetensors header together), the shards, the tensors.

A planner reads only a checkpoint's metadata, and even the largest published checkpoints
have little of it: a Llama-3-70B-shaped one 0.14 MiB of index and headers in 30 shards and
723 tensors, a 405B one 0.22 MiB in 191 shards, Qwen3-235B-A22B in FP8 15.7 MiB and 73,416
tensors, the 1T Kimi K2 (DeepSeek-V3's architecture, with FP8 scales) 30.0 MiB and 138,916
tensors in 61 shards (tests/planner/test_read_limits.py lays these out). A hub repo can
claim far more (an index of thousands of shards, headers of 100 MB each, millions of
tensors), and whoever reads it pays in memory: so each read stops at these limits, with a
refusal that names the one it met, before the bytes past it are asked for. The tensors'
records are what a read keeps (~300 bytes each), so their count bounds its memory.

``ReadLimits()`` are kvledger's own (the pre-flight, ``plan``, ``fetch`` sizing); a caller
that holds less (the operator's webhook) passes tighter ones, with ``whose`` naming it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvledger.engine.errors import BadInput

MiB = 2**20
MAX_MODEL_BYTES = 64 * MiB  # about twice Kimi K2's 30.0 MiB
MAX_SHARDS = 1024  # the largest published checkpoints have a few hundred
MAX_TENSORS = 262_144  # about twice Kimi K2's 138,916
MAX_CONFIG_BYTES = MiB  # config.json is parsed whole; published ones are a few KiB


@dataclass(frozen=True)
class ReadLimits:
    model_bytes: int = MAX_MODEL_BYTES
    shards: int = MAX_SHARDS
    tensors: int = MAX_TENSORS
    whose: str = "kvledger"  # who holds to them, as a refusal says it


class OverLimit(BadInput):
    """A model whose metadata is more than a read may take: not necessarily a bad one
    (under ``ReadLimits()`` it is bigger than any published checkpoint)."""


class ReadBudget:
    """One model read's count against its limits; thread-safe (shards are read at once)."""

    def __init__(self, limits: ReadLimits, what: str) -> None:
        self.limits, self.what = limits, what
        self._bytes = self._tensors = 0
        self._lock = threading.Lock()
        self.stopped = False  # one part of the read failed: the others stop where they are

    def take_bytes(self, count: int) -> None:
        """``count`` more bytes to read, OverLimit (before reading them) past the limit."""
        with self._lock:
            if self._bytes + count > self.limits.model_bytes:
                self.stopped = True
                raise OverLimit(
                    f"{self.what}: its config.json, index and safetensors headers come to "
                    f"more than {self.limits.model_bytes / MiB:g} MiB, the most "
                    f"{self.limits.whose} reads of one model")
            self._bytes += count

    def stop(self) -> None:
        self.stopped = True

    @property
    def taken_bytes(self) -> int:
        return self._bytes

    def check_shards(self, count: int) -> None:
        if count > self.limits.shards:
            raise OverLimit(f"{self.what}: its index names {count} shards, more than the "
                            f"{self.limits.shards} {self.limits.whose} reads of one model")

    def take_tensors(self, count: int) -> None:
        """``count`` more tensors read in the shards' headers, OverLimit past the limit."""
        with self._lock:
            self._tensors += count
            if self._tensors > self.limits.tensors:
                raise self._too_many()

    def check_index(self, entries: int) -> None:
        """The index maps ``entries`` tensors so far: OverLimit past the limit."""
        if entries > self.limits.tensors:
            raise self._too_many()

    def _too_many(self) -> OverLimit:
        return OverLimit(f"{self.what}: it declares more than {self.limits.tensors:,} "
                         f"tensors, the most {self.limits.whose} reads of one model")
