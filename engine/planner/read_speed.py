"""A timed read of a checkpoint's files, as the engine will read them: the largest file's
middle through a memory map (each page a fault, as safetensors loads it), or several files
at once as a read ahead reads them (``checkpoint/read_ahead.py``), for at most
``SAMPLE_BYTES`` or ``SAMPLE_SECONDS``. The start's read is predicted from it
(``ready_time.predict``).

Torch-free: the planner's room.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
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
                 max_seconds: float = SAMPLE_SECONDS, threads: int = 1,
                 faults: int = 1) -> ReadSpeed | None:
    """Read the largest of ``files`` from its middle on, in large blocks, until
    ``sample_bytes`` or ``max_seconds``; None when there is nothing to read (no file, or a
    sparse one: a header mirror's, a benchmark's). The middle:
    the plan has just read each file's header, which the page cache now holds. Read as
    the loader reads it, through a memory map: each page a fault, cached or not (a plain
    ``read()`` of a warm file is about twice as fast as loading it), in ``faults`` threads
    at once, each its share of the sample (``_fault_in``: on the CPU the loader's first
    pass over a tensor, a copy or a reorder, splits it among torch's threads, and a disk
    that serves several reads at once fills them faster: on this machine's virtual disk,
    cold, a 256 MiB copy ran at 0.35-0.52 GB/s in one thread and 1.1-1.5 in two). With
    ``threads`` (a read ahead's, ``checkpoint/read_ahead.py``), the ``threads`` largest
    files at once, a share of the sample each, as the read ahead reads them
    (``cache_span``), side by side."""
    sized = sorted(((f.stat().st_size, f) for f in files if os.path.isfile(f)), reverse=True)
    sized = [(size, path) for size, path in sized[:max(1, threads)]
             if size and _data_in_middle(path, size)]
    if not sized:
        return None
    started = time.perf_counter()
    share = sample_bytes // len(sized)
    if threads <= 1:
        read = _fault_in(sized[0][1], share, started, max_seconds, max(1, faults))
    else:
        with ThreadPoolExecutor(len(sized)) as pool:
            read = sum(pool.map(lambda item: _read_middle(item[1], share, started, max_seconds),
                                sized))
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


def _middle(path: Path) -> tuple[int, int]:
    """Where a sample of ``path`` starts (its middle, past the header the page cache holds;
    the start of a small file), and the file's size."""
    size = path.stat().st_size
    return (size // 2 if size > 2 * CHUNK else 0), size


def _read_middle(path: Path, sample_bytes: int, started: float, max_seconds: float) -> int:
    """The bytes of ``path`` read from its middle on, up to ``sample_bytes``, until
    ``max_seconds`` after ``started``, as the read ahead reads (``cache_span``)."""
    offset, _ = _middle(path)
    read = 0
    with open(path, "rb", buffering=0) as handle, open(os.devnull, "wb") as sink:
        while read < sample_bytes and time.perf_counter() - started < max_seconds:
            count = cache_span(handle.fileno(), offset + read, CHUNK, sink.fileno())
            if not count:
                break
            read += count
    return read


def _fault_in(path: Path, sample_bytes: int, started: float, max_seconds: float,
              faults: int) -> int:
    """The bytes of ``path`` copied out of a private memory map of it from its middle on,
    up to ``sample_bytes``, until ``max_seconds`` after ``started``: ``faults`` threads,
    each over its own contiguous share, a block at a time into a new buffer (the loader's
    copies go to new pages too). The copies are ``ctypes.memmove``, which lets go of
    Python's lock, so the threads' faults run side by side (a map's slice holds the lock
    through its faults: threads would take turns)."""
    offset, size = _middle(path)
    total = min(sample_bytes, size - offset)
    bounds = [offset + total * i // faults for i in range(faults + 1)]
    with open(path, "rb", buffering=0) as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    anchor = ctypes.c_char.from_buffer(mapped)
    base = ctypes.addressof(anchor)

    def share(begin: int, end: int) -> int:
        read = 0
        while begin + read < end and time.perf_counter() - started < max_seconds:
            count = min(CHUNK, end - begin - read)
            ctypes.memmove(ctypes.create_string_buffer(count), base + begin + read, count)
            read += count
        return read

    try:
        if faults == 1:
            return share(bounds[0], bounds[1])
        read = [0] * faults
        threads = [threading.Thread(target=lambda i=i: read.__setitem__(
            i, share(bounds[i], bounds[i + 1]))) for i in range(faults)]
        for thread in threads:  # one thread a share, all at once
            thread.start()
        for thread in threads:
            thread.join()
        return sum(read)
    finally:
        del anchor  # the map's buffer exported no more: it can close
        mapped.close()
