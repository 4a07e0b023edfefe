"""LoRA adapters on the Hugging Face Hub (``--lora-modules NAME=hf://ORG/NAME[@REVISION]``),
resolved as models are: into the hub cache (``--download-dir``), pinned to the commit the
revision resolved to, served from there; with ``HF_HUB_OFFLINE`` only from the cache."""

from __future__ import annotations

from pathlib import Path

from kvledger.engine.checkpoint.hub.cache import (
    _read_ref,
    _snapshot_download,
    _write_ref,
    cache_root,
    repo_folder,
)
from kvledger.engine.checkpoint.hub.repo import is_commit, is_hub_uri, list_repo, parse_uri
from kvledger.engine.errors import BadInput

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_directory(path: str, download_dir: str | None = None, *,
                      hub_timeout_s: float | None = None,
                      max_weights_bytes: int | None = None) -> str:
    """The directory an adapter is read from: a local one as is; for an hf:// adapter its
    snapshot in the hub cache, downloaded first when incomplete (unless HF_HUB_OFFLINE),
    refused before a byte is downloaded when its weights file is over
    ``max_weights_bytes`` (the most an adapter the engine can serve takes)."""
    if not is_hub_uri(path):
        return path
    from huggingface_hub import constants

    model = parse_uri(path)
    cache = cache_root(download_dir)
    repo_dir = repo_folder(cache, model)
    commit = model.revision if is_commit(model.revision) else _read_ref(repo_dir, model.revision)
    if commit is not None:
        snapshot = repo_dir / "snapshots" / commit
        if all((snapshot / name).is_file() for name in ADAPTER_FILES):
            return str(snapshot)
    if constants.is_offline_mode():
        raise BadInput(f"LoRA adapter {model.uri} is not in the hub cache {cache} and "
                       "HF_HUB_OFFLINE=1 forbids downloading it")
    listing = list_repo(model, timeout_s=hub_timeout_s)
    missing = [name for name in ADAPTER_FILES if name not in listing.sizes]
    if missing:
        raise BadInput(f"{listing.where()} has no {missing[0]}: not a PEFT LoRA adapter "
                       "kvledger can load")
    size = listing.sizes[ADAPTER_FILES[1]]
    if max_weights_bytes is not None and size > max_weights_bytes:
        raise BadInput(f"{listing.where()}: {ADAPTER_FILES[1]} is {size} bytes; an adapter "
                       f"this engine can serve is at most {max_weights_bytes}")
    snapshot = Path(repo_dir) / "snapshots" / listing.commit
    wanted = [name for name in ADAPTER_FILES if not (snapshot / name).is_file()]
    if wanted:
        _snapshot_download(listing, cache, wanted)
    _write_ref(repo_dir, model.revision, listing.commit)
    return str(snapshot)
