"""Plan a hub model before a byte of its weights is downloaded.

``header_mirror`` stages a sparse local mirror of the repo in a temporary directory:
config.json and the safetensors index are downloaded whole (small), and of each shard only
its header is fetched, with HTTP Range requests, written to a local file that is then
truncated to the shard's real size (from the hub's metadata). The data region is a hole,
so ``checkpoint.read_weights`` validates and sums the mirror exactly as it does a local
directory, and the planner stays unchanged. A 70B checkpoint costs a few hundred KiB.

What a read may take is bounded (``read_limits``): every byte of the index and the headers
goes straight to its file as it arrives, never held whole, and is counted against the
read's ``ReadBudget`` before it is asked for (a header's length is known from its first 8
bytes), so a repo whose headers claim 100 MB each is refused after those 8 bytes, naming
the limit. The mirror's folder lives as long as the ``with`` block, and no longer than the
process: one still open when the process ends (the operator at SIGTERM while a sizing runs on
a daemon thread, ``kvledger serve`` ended while it plans) is removed at exit
(``remove_open_mirrors``, run by ``atexit`` and by the paths that end with ``os._exit``), so an
operator asked to size models does not fill its disk with mirrors over its restarts.
"""

from __future__ import annotations

import atexit
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from kvledger.engine.checkpoint.contents import ModelSource
from kvledger.engine.checkpoint.files import CONFIG_FILE, INDEX_FILE
from kvledger.engine.checkpoint.hub.reads import fetch_file, read_range, read_small_file
from kvledger.engine.checkpoint.hub.repo import (
    RepoListing,
    engine_files,
    is_hub_uri,
    list_repo,
    parse_uri,
)
from kvledger.engine.checkpoint.read_limits import (
    MAX_CONFIG_BYTES,
    ReadBudget,
    ReadLimits,
)
from kvledger.engine.checkpoint.safetensors_header import MAX_HEADER_BYTES
from kvledger.engine.checkpoint.shard_index import read_shard_index
from kvledger.engine.errors import BadInput

# The first request of each shard asks for this many bytes: most headers fit (as
# huggingface_hub's own header reader assumes), so one request per shard usually does.
HEADER_PREFIX_BYTES = 100_000
PARALLEL_REQUESTS = 8

# The mirrors' folders open now (those of a process's threads), for remove_open_mirrors.
_OPEN: set[str] = set()
_OPEN_LOCK = threading.Lock()


def remove_open_mirrors() -> None:
    """Remove every mirror folder still open: the process ends (atexit, or before an
    ``os._exit``) while a thread stages one."""
    with _OPEN_LOCK:
        folders = list(_OPEN)
        _OPEN.clear()
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


atexit.register(remove_open_mirrors)


@contextmanager
def planning_source(model: str, download_dir: str | None = None, *,
                    hub_timeout_s: float | None = None) -> Iterator[ModelSource]:
    """Where the planner reads ``--model``: the directory itself; for an hf:// model the
    cached snapshot when ``HF_HUB_OFFLINE`` is set (``kvledger fetch`` put it there), else a
    header-only mirror that lives as long as the ``with`` block."""
    if not is_hub_uri(model):
        yield ModelSource(model)
        return
    from huggingface_hub import constants

    if constants.is_offline_mode():
        from kvledger.engine.checkpoint.hub.cache import offline_snapshot

        yield offline_snapshot(parse_uri(model), download_dir)
        return
    with header_mirror(model, timeout_s=hub_timeout_s) as source:
        yield source


@contextmanager
def header_mirror(uri: str, *, token: str | None = None, endpoint: str | None = None,
                  timeout_s: float | None = None,
                  limits: ReadLimits | None = None) -> Iterator[ModelSource]:
    """A header-only sparse mirror of the hub model ``uri`` (see the module's docstring),
    read within ``limits`` (kvledger's own when None; OverLimit past them).

    A BadInput raised inside the block names the model, not the temporary directory."""
    listing = list_repo(parse_uri(uri), token=token, endpoint=endpoint, timeout_s=timeout_s)
    try:
        tmp = tempfile.mkdtemp(prefix="kvledger-hub-")
    except OSError as exc:
        raise BadInput(f"cannot create a temporary folder for the headers of {uri}: "
                       f"{exc.strerror or exc} (set TMPDIR to a writable folder)") from None
    with _OPEN_LOCK:
        _OPEN.add(tmp)
    try:
        write_mirror(listing, Path(tmp), ReadBudget(limits or ReadLimits(), listing.where()))
        yield ModelSource(tmp, uri=listing.model.uri, commit=listing.commit, headers_only=True)
    except BadInput as exc:
        where = listing.where()
        # Its own class (OverLimit stays one), with the model's name for the folder's.
        raise type(exc)(str(exc).replace(tmp + os.sep, where + " ").replace(tmp, where)) from None
    finally:
        with _OPEN_LOCK:
            _OPEN.discard(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def write_mirror(listing: RepoListing, root: Path, budget: ReadBudget) -> int:
    """Write config.json, the index and each shard's header (sparse) under ``root``, each
    byte counted on ``budget`` before it is asked for; returns the bytes received."""
    if CONFIG_FILE in listing.sizes:
        budget.take_bytes(min(listing.sizes[CONFIG_FILE] or 0, MAX_CONFIG_BYTES))
        _write(root, CONFIG_FILE, read_small_file(listing, CONFIG_FILE, MAX_CONFIG_BYTES))
    else:
        _write(root, CONFIG_FILE, b"")
    index = None
    if INDEX_FILE in listing.sizes:
        budget.take_bytes(listing.sizes[INDEX_FILE])
        with open(root / INDEX_FILE, "wb") as f:
            fetch_file(listing, INDEX_FILE, f.write, budget.limits.model_bytes)
        with open(root / INDEX_FILE, "rb") as f:
            index = read_shard_index(f.read, listing.where(INDEX_FILE), budget, owners=False)
    shards = [n for n in engine_files(listing, index) if n.endswith(".safetensors")]
    budget.check_shards(len(shards))
    parallel(lambda name: read_header(listing, name, root, budget), shards,
             PARALLEL_REQUESTS, budget.stop)
    return budget.taken_bytes


def read_header(listing: RepoListing, filename: str, root: Path, budget: ReadBudget) -> None:
    """Write the first ``8 + N`` bytes of a safetensors file (length prefix and JSON
    header) to its place under ``root``, then make it the file's size (sparse), by Range requests that
    stream into the file. The ``N`` bytes are counted on ``budget`` before they are asked
    for; an absurd length is written as is, for the header validation to name."""
    size = listing.sizes[filename]
    with open(_place(root, filename), "wb") as f:
        if size:
            budget.take_bytes(min(8, size))
            head = _Header(f, size, budget)
            read_range(listing, filename, 0, min(HEADER_PREFIX_BYTES, size), sink=head.write)
            if head.missing > 0:  # a header longer than the first request
                read_range(listing, filename, head.written, head.missing, sink=head.write)
        f.truncate(size)


class _Header:
    """What the Range responses bring of one shard, written as it arrives: the length
    prefix, then the header it announces (counted on the budget first), then no more."""

    def __init__(self, f: BinaryIO, size: int, budget: ReadBudget) -> None:
        self.f, self.size, self.budget = f, size, budget
        self.written = 0
        self.wanted: int | None = None  # 8 + N, once the prefix is in
        self._prefix = b""

    @property
    def missing(self) -> int:
        return 0 if self.wanted is None else self.wanted - self.written

    def write(self, chunk: bytes) -> bool:
        """Takes a piece; False once the header is all in (the rest is tensor data), or
        once another part of the read has failed."""
        if self.budget.stopped:
            return False
        if self.wanted is None:
            self._prefix += chunk[:8 - len(self._prefix)]
            if len(self._prefix) == 8:
                (header_len,) = struct.unpack("<Q", self._prefix)
                if header_len > MAX_HEADER_BYTES or 8 + header_len > self.size:
                    self.wanted = 8  # the validation names the absurd length
                else:
                    self.budget.take_bytes(header_len)
                    self.wanted = 8 + header_len
        room = (self.wanted if self.wanted is not None else 8) - self.written
        if room > 0:
            self.f.write(chunk[:room])
            self.written += min(room, len(chunk))
        return self.wanted is None or self.written < self.wanted


def parallel(work: Callable[[str], None], items: list[str], threads: int,
             stop: Callable[[], None]) -> None:
    """``work(item)`` for each item on up to ``threads`` threads; at the first error
    ``stop()`` (the others end where they are) and the error raised again here once they
    have. The threads are daemons: a process that exits while a hub read hangs (the
    operator at SIGTERM) does not wait for it, as it would for a ThreadPoolExecutor's."""
    pending = list(reversed(items))
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        while True:
            with lock:
                if errors or not pending:
                    return
                item = pending.pop()
            try:
                work(item)
            except BaseException as exc:  # handed to the caller below
                with lock:
                    errors.append(exc)
                stop()

    workers = [threading.Thread(target=run, daemon=True, name="kvledger-hub-header")
               for _ in range(min(threads, len(items)))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]


def _write(root: Path, filename: str, data: bytes) -> None:
    _place(root, filename).write_bytes(data)


def _place(root: Path, filename: str) -> Path:
    """``root / filename``, its folders made below ``root`` but never ``root`` itself: a
    thread still writing when the mirror was removed (the process ending) fails
    (FileNotFoundError) instead of making the folder again for nobody to remove."""
    path = root / filename
    for folder in reversed(path.relative_to(root).parents[:-1]):
        (root / folder).mkdir(exist_ok=True)
    return path
