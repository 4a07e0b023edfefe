"""Plan a hub model before a byte of its weights is downloaded.

``header_mirror`` stages a sparse local mirror of the repo in a temporary directory:
config.json and the safetensors index are downloaded whole (small), and of each shard only
its header is fetched, with HTTP Range requests, written to a local file that is then
truncated to the shard's real size (from the hub's metadata). The data region is a hole,
so ``checkpoint.read_weights`` validates and sums the mirror exactly as it does a local
directory, and the planner stays unchanged. A 70B checkpoint costs a few hundred KiB.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from kvledger.engine.checkpoint.contents import ModelSource
from kvledger.engine.checkpoint.files import CONFIG_FILE, INDEX_FILE
from kvledger.engine.checkpoint.hub.reads import read_range, read_small_file
from kvledger.engine.checkpoint.hub.repo import (
    RepoListing,
    engine_files,
    is_hub_uri,
    list_repo,
    parse_json,
    parse_uri,
)
from kvledger.engine.checkpoint.safetensors_header import MAX_HEADER_BYTES
from kvledger.engine.errors import BadInput

# The first request of each shard asks for this many bytes: most headers fit (as
# huggingface_hub's own header reader assumes), so one request per shard usually does.
HEADER_PREFIX_BYTES = 100_000
PARALLEL_REQUESTS = 8


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
                  timeout_s: float | None = None) -> Iterator[ModelSource]:
    """A header-only sparse mirror of the hub model ``uri`` (see the module's docstring).

    A BadInput raised inside the block names the model, not the temporary directory."""
    listing = list_repo(parse_uri(uri), token=token, endpoint=endpoint, timeout_s=timeout_s)
    try:
        tmp = tempfile.mkdtemp(prefix="kvledger-hub-")
    except OSError as exc:
        raise BadInput(f"cannot create a temporary folder for the headers of {uri}: "
                       f"{exc.strerror or exc} (set TMPDIR to a writable folder)") from None
    try:
        write_mirror(listing, Path(tmp))
        yield ModelSource(tmp, uri=listing.model.uri, commit=listing.commit)
    except BadInput as exc:
        where = listing.where()
        raise BadInput(str(exc).replace(tmp + os.sep, where + " ").replace(tmp, where)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_mirror(listing: RepoListing, root: Path) -> int:
    """Write config.json, the index and each shard's header (sparse) under ``root``;
    returns the bytes received."""
    config = read_small_file(listing, CONFIG_FILE) if CONFIG_FILE in listing.sizes else None
    index_raw = read_small_file(listing, INDEX_FILE) if INDEX_FILE in listing.sizes else None
    index = parse_json(index_raw, listing.where(INDEX_FILE)) if index_raw is not None else None
    shards = [n for n in engine_files(listing, index) if n.endswith(".safetensors")]
    _write(root / CONFIG_FILE, config or b"")
    if index_raw is not None:
        _write(root / INDEX_FILE, index_raw)
    with ThreadPoolExecutor(min(PARALLEL_REQUESTS, len(shards))) as pool:
        headers = list(pool.map(lambda name: read_header(listing, name), shards))
    for name, header in zip(shards, headers, strict=True):
        _write(root / name, header, size=listing.sizes[name])
    return len(config or b"") + len(index_raw or b"") + sum(map(len, headers))


def read_header(listing: RepoListing, filename: str) -> bytes:
    """The first ``8 + N`` bytes of a safetensors file (length prefix and JSON header), by
    Range requests. An absurd length is returned as is, for the header validation to name."""
    size = listing.sizes[filename]
    if size == 0:
        return b""
    prefix = read_range(listing, filename, 0, min(HEADER_PREFIX_BYTES, size))
    if len(prefix) < 8:
        return prefix
    (header_len,) = struct.unpack("<Q", prefix[:8])
    end = 8 + header_len
    if header_len > MAX_HEADER_BYTES or end > size:
        return prefix[:8]
    if end <= len(prefix):
        return prefix[:end]
    return prefix + read_range(listing, filename, len(prefix), end - len(prefix))


def _write(path: Path, data: bytes, size: int | None = None) -> None:
    """``data``, then (sparse) up to ``size`` bytes: the tensor data is a hole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        if size is not None:
            f.truncate(size)
