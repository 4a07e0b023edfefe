"""A hub model in huggingface_hub's cache: ``kvledger fetch`` downloads it, ``serve`` runs it.

``fetch`` downloads only the files the engine needs (``hub.engine_files``) with
``snapshot_download``, pinned to the commit the revision resolved to, into the cache
(``--download-dir``, else huggingface_hub's); files already there are not downloaded
again. ``find_snapshot`` answers, without the network, whether the cache holds a complete
copy: the engine container reads its cache read-only with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import glob
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from kvledger.engine.checkpoint.contents import ModelSource
from kvledger.engine.checkpoint.files import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, TOKENIZER_FILE
from kvledger.engine.checkpoint.hub.reads import hub_error
from kvledger.engine.checkpoint.hub.repo import (
    HubModel,
    RepoListing,
    engine_files,
    is_commit,
    is_hub_uri,
    list_repo,
    parse_uri,
    read_index,
)
from kvledger.engine.checkpoint.read_limits import ReadBudget, ReadLimits
from kvledger.engine.checkpoint.shard_index import ShardIndex, read_shard_index
from kvledger.engine.errors import BadInput

log = logging.getLogger("kvledger.hub")


@dataclass(frozen=True)
class FetchResult:
    model: HubModel
    commit: str
    path: Path  # the snapshot folder: the model directory the engine loads
    downloaded_files: tuple[str, ...]
    downloaded_bytes: int
    cached_files: int  # needed files that were in the cache already


def cache_root(download_dir: str | None) -> Path:
    """``--download-dir``, else huggingface_hub's cache (``HF_HUB_CACHE``, ``HF_HOME/hub``)."""
    from huggingface_hub import constants

    return Path(download_dir or constants.HF_HUB_CACHE).expanduser().resolve()


def repo_folder(cache: Path, model: HubModel) -> Path:
    """The cache's folder of a model repo (huggingface_hub's layout)."""
    return cache / ("models--" + model.repo_id.replace("/", "--"))


def fetch(model: HubModel, download_dir: str | None = None, *, token: str | None = None,
          endpoint: str | None = None, timeout_s: float | None = None) -> FetchResult:
    """Download what the engine needs of ``model`` into the cache, unless already there.
    The listing and the index are read within ``timeout_s`` (``--hub-timeout``); the
    downloads themselves, whose time grows with the model, only within huggingface_hub's
    per-read timeout."""
    listing = list_repo(model, token=token, endpoint=endpoint, timeout_s=timeout_s)
    cache = cache_root(download_dir)
    snapshot = repo_folder(cache, model) / "snapshots" / listing.commit
    cached_index = snapshot / INDEX_FILE
    index = (_cached_index(cached_index, listing.where(INDEX_FILE))
             if cached_index.is_file() else read_index(listing))
    files = engine_files(listing, index)
    missing = [name for name in files if not (snapshot / name).is_file()]
    if missing:
        log.info("downloading %d files (%d bytes) of %s into %s", len(missing),
                 sum(listing.sizes[n] for n in missing), listing.where(), cache)
        _snapshot_download(listing, cache, missing)
    _write_ref(repo_folder(cache, model), model.revision, listing.commit)
    absent = [name for name in files if not (snapshot / name).is_file()]
    if absent:
        raise BadInput(f"{listing.where()}: the download left {absent[0]} missing from {snapshot}")
    return FetchResult(model, listing.commit, snapshot, tuple(missing),
                       sum(listing.sizes[n] for n in missing), len(files) - len(missing))


def _snapshot_download(listing: RepoListing, cache: Path, files: list[str]) -> None:
    import httpx2
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        FileMetadataError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
    )
    from huggingface_hub.utils import disable_progress_bars

    if not sys.stderr.isatty():
        disable_progress_bars()  # no carriage-return bars in a pod's log
    model = listing.model
    try:
        snapshot_download(model.repo_id, revision=listing.commit, cache_dir=cache,
                          allow_patterns=[glob.escape(name) for name in files],
                          token=listing.token, endpoint=listing.endpoint)
    except (HfHubHTTPError, httpx2.TransportError) as exc:
        raise hub_error(exc, model, listing.endpoint) from None
    except OfflineModeIsEnabled:
        raise BadInput(f"{model.uri}: HF_HUB_OFFLINE is set, so it cannot be downloaded") from None
    except (LocalEntryNotFoundError, FileMetadataError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise BadInput(f"{listing.where()}: the download did not complete: {reason}") from None
    except OSError as exc:
        raise BadInput(f"cannot write the hub cache {cache}: {exc.strerror or exc}") from None


def _write_ref(repo_dir: Path, revision: str, commit: str) -> None:
    """Record ``revision -> commit`` (``refs/REVISION``), as huggingface_hub does, so the
    engine finds the snapshot offline. We download by commit, which records none."""
    if revision == commit:
        return
    ref = repo_dir / "refs" / revision
    try:
        if ref.is_file() and ref.read_text() == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)
    except OSError as exc:
        raise BadInput(f"cannot write the hub cache {repo_dir}: {exc.strerror or exc}") from None


def find_snapshot(model: HubModel, download_dir: str | None) -> tuple[Path, str | None, list[str]]:
    """``(snapshot folder, commit, files missing from it)`` for ``model`` in the cache, read
    without the network. The files needed are the engine's, from the tree listing that
    ``fetch`` cached; without one (a cache filled by another tool), config.json,
    tokenizer.json and the weights."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    cache = cache_root(download_dir)
    repo_dir = repo_folder(cache, model)
    commit = model.revision if is_commit(model.revision) else _read_ref(repo_dir, model.revision)
    if commit is None:
        return repo_dir, None, [CONFIG_FILE]
    snapshot = repo_dir / "snapshots" / commit
    index_path = snapshot / INDEX_FILE
    index = (_cached_index(index_path, f"{model.uri} {INDEX_FILE}")
             if index_path.is_file() else None)
    try:
        tree = get_cached_repo_tree(model.repo_id, revision=commit, cache_dir=cache)
        listing = RepoListing(model, commit, {f.path: f.size for f in tree}, endpoint="")
        needed = engine_files(listing, index)
    except CachedRepoTreeNotFoundError:
        weights = [INDEX_FILE, *index.shards] if index is not None else [SINGLE_FILE]
        needed = [CONFIG_FILE, TOKENIZER_FILE, *weights]
    return snapshot, commit, [n for n in needed if not (snapshot / n).is_file()]


def offline_snapshot(model: HubModel, download_dir: str | None) -> ModelSource:
    """The cached snapshot of ``model``; BadInput (run ``kvledger fetch`` first) when the
    cache does not hold all of it."""
    snapshot, commit, missing = find_snapshot(model, download_dir)
    if missing:
        cache = cache_root(download_dir)
        what = "is not" if commit is None else f"lacks {', '.join(missing[:3])} of"
        raise BadInput(f"{model.uri} {what} in the hub cache {cache} and HF_HUB_OFFLINE=1 "
                       f"forbids downloading it: run `kvledger fetch --model {model.uri} "
                       f"--download-dir {cache}` first")
    return ModelSource(str(snapshot), uri=model.uri, commit=commit)


def serving_source(model: str, download_dir: str | None = None, *,
                   hub_timeout_s: float | None = None) -> ModelSource:
    """The directory the engine loads ``--model`` from: a local one as is; for an hf://
    model the cached snapshot, downloaded first when incomplete (unless HF_HUB_OFFLINE)."""
    if not is_hub_uri(model):
        return ModelSource(model)
    from huggingface_hub import constants

    hub_model = parse_uri(model)
    _, _, missing = find_snapshot(hub_model, download_dir)
    if not missing or constants.is_offline_mode():
        return offline_snapshot(hub_model, download_dir)
    result = fetch(hub_model, download_dir, timeout_s=hub_timeout_s)
    log.info("%s: %d files (%d bytes) downloaded, %d already cached; serving %s",
             hub_model.uri, len(result.downloaded_files), result.downloaded_bytes,
             result.cached_files, result.path)
    return ModelSource(str(result.path), uri=hub_model.uri, commit=result.commit)


def _read_ref(repo_dir: Path, revision: str) -> str | None:
    try:
        commit = (repo_dir / "refs" / revision).read_text().strip()
    except OSError:
        return None
    return commit if is_commit(commit) else None


def _cached_index(path: Path, where: str) -> ShardIndex:
    """The shards of an index in the cache (read as any index is: ``read_shard_index``)."""
    try:
        with open(path, "rb") as f:
            return read_shard_index(f.read, where, ReadBudget(ReadLimits(), where), owners=False)
    except OSError as exc:
        raise BadInput(f"cannot read {path}: {exc.strerror or exc}") from None
