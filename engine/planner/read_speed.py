"""A timed read of a checkpoint's files, as the engine will read them: the largest file's
middle through a memory map (each page a fault, as safetensors loads it), or several files
at once as a read ahead reads them (``checkpoint/read_ahead.py``), for at most
``SAMPLE_BYTES`` or ``SAMPLE_SECONDS``. The start's read is predicted from it
(``ready_time.predict``).

Torch-free: the planner's room.
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvledger.engine.checkpoint.read_ahead import cache_span

SAMPLE_BYTES = 256 << 20  # what a prediction reads, at most
SAMPLE_SECONDS = 1.0  # and for at most this long
CHUNK = 8 << 20


@dataclass(frozen=True)
class ReadSpeed:
    """A timed sequential read: ``bytes`` in ``seconds``."""

    bytes: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


def measure_read(files: list[Path], sample_bytes: int = SAMPLE_BYTES,
                 max_seconds: float = SAMPLE_SECONDS, threads: int = 1) -> ReadSpeed | None:
    """Read the largest of ``files`` from its middle on, in large blocks, until
    ``sample_bytes`` or ``max_seconds``; None when there is nothing to read (no file, or a
    sparse one: a header mirror's, a benchmark's). The middle:
    the plan has just read each file's header, which the page cache now holds. Read as
    safetensors reads it, through a memory map: each page a fault, cached or not (a plain
    ``read()`` of a warm file is about twice as fast as loading it). With ``threads`` (a
    read ahead's, ``checkpoint/read_ahead.py``), the ``threads`` largest files at once, a
    share of the sample each, as the read ahead reads them (``cache_span``), side by side
    (a memory map's copy holds Python's lock through its page faults: threads would take
    turns)."""
    sized = sorted(((f.stat().st_size, f) for f in files if f.is_file()), reverse=True)
    sized = [(size, path) for size, path in sized[:max(1, threads)]
             if size and _data_in_middle(path, size)]
    if not sized:
        return None
    started = time.perf_counter()
    share = sample_bytes // len(sized)
    if threads <= 1:
        read = _read_middle(sized[0][1], share, started, max_seconds)
    else:
        with ThreadPoolExecutor(len(sized)) as pool:
            read = sum(pool.map(lambda item: _read_middle(item[1], share, started, max_seconds,
                                                          mapped=False), sized))
    elapsed = time.perf_counter() - started
    return ReadSpeed(read, elapsed) if read else None


def _data_in_middle(path: Path, size: int) -> bool:
    """Whether ``path`` holds data from its middle on, not a hole to its end (a header
    mirror's shard). Asked of the filesystem (``SEEK_DATA``); one that cannot say (the
    call unsupported) counts as data, as does a file whose blocks are not reported (FUSE
    mounts of buckets report none)."""
    try:
        with open(path, "rb") as handle:
            os.lseek(handle.fileno(), size // 2, os.SEEK_DATA)
        return True
    except OSError as exc:
        return exc.errno != errno.ENXIO  # ENXIO: nothing but a hole from the middle on


def _read_middle(path: Path, sample_bytes: int, started: float, max_seconds: float, *,
                 mapped: bool = True) -> int:
    """The bytes of ``path`` read from its middle on, up to ``sample_bytes``, until
    ``max_seconds`` after ``started``: through a memory map (``mapped``) or as the read
    ahead reads (``cache_span``)."""
    size = path.stat().st_size
    offset = size // 2 if size > 2 * CHUNK else 0
    read = 0
    with open(path, "rb", buffering=0) as handle:
        if mapped:
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                while (read < sample_bytes and offset + read < size
                       and time.perf_counter() - started < max_seconds):
                    read += len(mm[offset + read:offset + read + CHUNK])  # every page faulted
            return read
        with open(os.devnull, "wb") as sink:
            while read < sample_bytes and time.perf_counter() - started < max_seconds:
                count = cache_span(handle.fileno(), offset + read, CHUNK, sink.fileno())
                if not count:
                    break
                read += count
    return read
