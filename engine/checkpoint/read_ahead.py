"""How a checkpoint's files are read, as vLLM's ``--safetensors-load-strategy`` says.

The loader takes each tensor as a view of its file's memory map (``lazy``): a page is read
when a tensor first touches it. On a network filesystem that is many small reads, each a
round trip, so vLLM reads the files ahead, and so does kvledger:

- ``prefetch``: a background pool of ``threads`` reads the files whole, in blocks of
  ``block_bytes``, several files at once, into the page cache while the loader goes on;
  the loader then finds its pages in memory. The kernel reads them for the threads
  (``sendfile`` to /dev/null): no copy into this process, no buffer per thread.
- ``eager``: each file read whole, in large blocks, before its tensors are taken. vLLM
  reads it into the process's memory and deserializes it from there; here it goes through
  the page cache, so no second copy of a shard sits in the process beside the weights
  and the plan's promise while loading holds.
- ``lazy``: the memory map alone.
- not given: ``lazy``, but prefetched when the files lie on NFS or Lustre (vLLM's rule) or
  on FUSE over remote storage (gcsfuse, mountpoint-s3, blobfuse2...: where a model bucket
  is mounted; ``REMOTE_FUSE``) and fit in 90% of the host memory available; the loader
  logs which and why. FUSE is kvledger's addition: on a FUSE volume answering each read
  after 1 ms, reading ahead loaded 9 files 1.4-1.5x faster cold and 1.6x warm
  (docs/benchmarks.md, "Reading ahead on a slow volume").

A failed read ahead is a warning: the loader reads what it needs itself.

Torch-free: the checkpoint room.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

STRATEGIES = ("lazy", "eager", "prefetch")
DEFAULT_THREADS = 8  # vLLM's --safetensors-prefetch-num-threads
DEFAULT_BLOCK_BYTES = 16 << 20  # and --safetensors-prefetch-block-size
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "lustre")  # vLLM's
# FUSE mounts of remote storage, by /proc/mounts' "fuse.SUBTYPE" (a bare "fuse" names none):
# model buckets and remote folders. Not the local ones (fuse-overlayfs, a rootless
# container's own files; squashfuse), which a read ahead would only slow.
REMOTE_FUSE = ("", "gcsfuse", "mountpoint-s3", "blobfuse2", "s3fs", "geesefs", "goofys",
               "rclone", "sshfs", "juicefs")
FITS_SHARE = 0.9  # prefetched unasked only within this share of the host memory available
FALLBACK_BYTES = 16 << 20  # a read's buffer where sendfile cannot serve

log = logging.getLogger("kvledger.engine")


@dataclass(frozen=True)
class WeightReading:
    """``--safetensors-load-strategy`` (None: not given) and the read-ahead's threads and
    block size; ``share``: (index, count) of the processes loading the same files (ranks),
    each of which reads ahead every ``count``-th file from its ``index``-th, as vLLM's
    ranks split them."""

    strategy: str | None = None
    threads: int = DEFAULT_THREADS
    block_bytes: int = DEFAULT_BLOCK_BYTES
    share: tuple[int, int] = (0, 1)


AS_VLLM_DEFAULTS = WeightReading()  # no flag given


def filesystem_type(path: Path, mounts: Path = Path("/proc/mounts")) -> str:
    """The type of the filesystem holding ``path`` (the longest mount point that holds
    it, as the kernel chooses); "" where /proc/mounts cannot be read."""
    resolved = os.path.realpath(path)
    best, kind = "", ""
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (resolved == point or resolved.startswith(os.path.join(point, ""))) \
                and len(point) > len(best):
            best, kind = point, fields[2]
    return kind


def remote_fuse(kind: str) -> bool:
    """Whether a filesystem of type ``kind`` is FUSE over remote storage (``REMOTE_FUSE``)."""
    base, _, subtype = kind.partition(".")
    return base == "fuse" and subtype in REMOTE_FUSE


@dataclass(frozen=True)
class Verdict:
    """Whether the files are read ahead, and why (``reason``, the loader's log line;
    ``warn``: logged as a warning)."""

    prefetch: bool
    reason: str
    warn: bool = False


def verdict(reading: WeightReading, files: list[Path], available_bytes: int | None,
            mounts: Path = Path("/proc/mounts")) -> Verdict:
    """Whether ``files`` are read ahead in the background: asked (``prefetch``), or not
    asked and on a network or FUSE filesystem where they fit in ``FITS_SHARE`` of
    ``available_bytes``."""
    if reading.strategy in ("lazy", "eager") or not files:
        return Verdict(False, f"read {reading.strategy or 'as the loader takes them'}")
    size = sum(f.stat().st_size for f in files)
    kind = filesystem_type(files[0], mounts)
    fits = available_bytes is None or size <= FITS_SHARE * available_bytes
    where = (f"{len(files)} checkpoint files, {size / 2**30:.2f} GiB, on {kind or 'an unknown'} "
             f"filesystem; {'?' if available_bytes is None else f'{available_bytes / 2**30:.2f}'}"
             f" GiB of host memory available")
    if reading.strategy == "prefetch":
        if not fits:
            return Verdict(True, f"{where}: prefetching all the same (--safetensors-load-"
                                 f"strategy prefetch), though they do not fit in "
                                 f"{round(FITS_SHARE * 100)}% of it", warn=True)
        return Verdict(True, f"{where}: prefetching them (--safetensors-load-strategy "
                             "prefetch)")
    network = kind in NETWORK_FILESYSTEMS or remote_fuse(kind)
    if network and fits:
        return Verdict(True, f"{where}: prefetching them (a network or FUSE filesystem; "
                             "--safetensors-load-strategy lazy does not)")
    return Verdict(False, f"{where}: read as the loader takes them ("
                          f"{'more than fits in memory' if network else 'not a network or FUSE filesystem'}"
                          "; --safetensors-load-strategy prefetch reads them ahead)")


def prefetches(reading: WeightReading, files: list[Path], available_bytes: int | None,
               mounts: Path = Path("/proc/mounts")) -> bool:
    """``verdict``'s answer, its reason logged (the loader's)."""
    said = verdict(reading, files, available_bytes, mounts)
    if files and reading.strategy not in ("lazy", "eager"):
        log.log(logging.WARNING if said.warn else logging.INFO, "%s", said.reason)
    return said.prefetch


def cache_span(fd: int, offset: int, count: int, sink: int) -> int:
    """Read up to ``count`` bytes of the file ``fd`` at ``offset`` into the page cache, no
    copy reaching this process: the kernel moves them to ``sink``, an open /dev/null
    (``sendfile``); the bytes read, 0 at the end. A file ``sendfile`` cannot take is
    read (``os.pread``, ``FALLBACK_BYTES`` at most) instead."""
    try:
        return os.sendfile(sink, fd, offset, count)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
        return len(os.pread(fd, min(count, FALLBACK_BYTES), offset))


def read_whole(path: Path, block_bytes: int = DEFAULT_BLOCK_BYTES) -> int:
    """Read ``path`` from start to end, ``block_bytes`` at a time, into the page cache
    (``cache_span``); the bytes read."""
    total = 0
    with open(path, "rb", buffering=0) as handle, open(os.devnull, "wb") as sink:
        while count := cache_span(handle.fileno(), total, block_bytes, sink.fileno()):
            total += count
    return total


class ReadAhead:
    """``files`` read whole by a pool of ``threads`` in the background (``start``); its
    end is logged with the bytes and seconds. ``join`` waits for it (tests, and the
    loader's end: no thread outlives the load)."""

    def __init__(self, files: list[Path], reading: WeightReading) -> None:
        index, count = reading.share
        self.files = files[index::count]
        self.reading = reading
        self.bytes_read = 0
        self.failed: list[Path] = []
        self._thread = threading.Thread(target=self._run, name="kvledger-read-ahead",
                                        daemon=True)

    def start(self) -> ReadAhead:
        log.info("prefetching %d checkpoint files into the page cache in the background "
                 "(%d threads, %d MiB blocks)", len(self.files),
                 min(self.reading.threads, len(self.files)), self.reading.block_bytes >> 20)
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        started = time.perf_counter()
        with ThreadPoolExecutor(self.reading.threads, "kvledger-read-ahead") as pool:
            for path, result in zip(self.files, pool.map(self._read, self.files), strict=True):
                if result is None:
                    self.failed.append(path)
                else:
                    self.bytes_read += result
        seconds = time.perf_counter() - started
        log.info("prefetched %d checkpoint files (%.2f GiB) in %.2fs (%.0f MiB/s)%s",
                 len(self.files) - len(self.failed), self.bytes_read / 2**30, seconds,
                 self.bytes_read / 2**20 / max(seconds, 1e-9),
                 f"; {len(self.failed)} could not be read" if self.failed else "")

    def _read(self, path: Path) -> int | None:
        try:
            return read_whole(path, self.reading.block_bytes)
        except OSError as exc:
            log.warning("prefetching %s failed (%s); the loader reads it itself", path, exc)
            return None
