"""Models on the Hugging Face Hub: ``--model hf://ORG/NAME[@REVISION]``.

What the planner (``hub_headers``: config.json and the safetensors headers over HTTP range
requests), ``kvledger fetch`` and ``serve`` (``hub_cache``) share: the uri, the repo's
listing at ONE commit (the revision is resolved once, so a branch that moves meanwhile
cannot mix files of two commits) and the files the engine needs. ``hub_http`` reads files
with bounded retries and turns the hub's errors into one line.

huggingface_hub is imported inside the functions, so a local model never loads it. It
reads ``HF_TOKEN``, ``HF_ENDPOINT``, ``HF_HOME`` and ``HF_HUB_OFFLINE`` itself; no token is
ever printed or logged here.
"""

from __future__ import annotations

import tempfile
from urllib.parse import quote

from kvledger.engine import json_text
from kvledger.engine.checkpoint.files import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    read_beside_weights,
    shard_name,
    unindexed_weights,
)
from kvledger.engine.checkpoint.hub.reads import (
    MAX_LISTING_BYTES,
    RepoListing,
    command_deadline,
    fetch_file,
    file_deadline,
    stream_get,
    with_retries,
)
from kvledger.engine.checkpoint.hub.uri import (  # noqa: F401 - the uri's names, re-exported
    DEFAULT_REVISION,
    HUB_URI_RE,
    SCHEME,
    HubModel,
    is_commit,
    is_hub_uri,
    parse_uri,
)
from kvledger.engine.checkpoint.read_limits import ReadBudget, ReadLimits
from kvledger.engine.checkpoint.shard_index import ShardIndex, read_shard_index
from kvledger.engine.errors import BadInput


def hub_endpoint(endpoint: str | None = None) -> str:
    """``endpoint``, else huggingface_hub's (``HF_ENDPOINT``, else huggingface.co)."""
    from huggingface_hub import constants

    return (endpoint or constants.ENDPOINT).rstrip("/")


def list_repo(model: HubModel, *, token: str | None = None, endpoint: str | None = None,
              timeout_s: float | None = None) -> RepoListing:
    """Resolve the revision to a commit and list the files there with their sizes, from the
    hub's metadata (one request; the tree API when the hub gave no sizes). Every read made
    with the listing ends within ``timeout_s`` from now (``--hub-timeout``)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import ModelInfo
    from huggingface_hub.utils import build_hf_headers

    endpoint = hub_endpoint(endpoint)
    deadline = command_deadline(timeout_s)
    url = f"{endpoint}/api/models/{model.repo_id}/revision/{quote(model.revision, safe='')}"
    listing_deadline = file_deadline(deadline)
    raw = with_retries(lambda: stream_get(url, build_hf_headers(token=token),
                                          MAX_LISTING_BYTES + 1, listing_deadline,
                                          params={"blobs": "true"}),
                       model, endpoint, deadline=listing_deadline)
    if len(raw) > MAX_LISTING_BYTES:
        raise BadInput(f"{model.uri}: the hub at {endpoint} sent a listing over "
                       f"{MAX_LISTING_BYTES} bytes")
    data = parse_json(raw, f"{model.uri}: the hub's listing")
    try:
        info = ModelInfo(**data) if isinstance(data, dict) else None
    except (TypeError, ValueError, KeyError, AttributeError):
        info = None
    if info is None or not isinstance(info.sha, str) or not is_commit(info.sha):
        raise BadInput(f"{model.uri}: the hub at {endpoint} answered without a commit for "
                       f"{model.revision!r}: is HF_ENDPOINT a Hugging Face Hub?")
    sizes = {s.rfilename: s.size for s in info.siblings or []}
    if any(size is None for size in sizes.values()):
        from huggingface_hub.hf_api import RepoFile

        api = HfApi(endpoint=endpoint, token=token)
        tree = with_retries(lambda: list(api.list_repo_tree(
            model.repo_id, recursive=True, revision=info.sha)), model, endpoint,
            deadline=deadline)
        sizes = {f.path: f.size for f in tree if isinstance(f, RepoFile)}
    return RepoListing(model, info.sha, sizes, endpoint, token, deadline)


def weight_files(listing: RepoListing, index: ShardIndex | None) -> list[str]:
    """The safetensors the engine loads: the index and the shards it names, else those a
    folder without an index is loaded from (``files.unindexed_weights``). ``index`` is the
    repo's index when it has one (``read_index``)."""
    if INDEX_FILE not in listing.sizes or index is None:
        if unindexed := unindexed_weights(listing.sizes):
            return unindexed
        others = sorted(n for n in listing.sizes if n.endswith((".bin", ".pt", ".safetensors")))
        hint = f" (found {', '.join(others[:3])})" if others else ""
        raise BadInput(f"{listing.where()} has no {SINGLE_FILE} or {INDEX_FILE}: kvledger "
                       f"loads only safetensors{hint}")
    for name in index.shards:
        shard_name(name, listing.where(INDEX_FILE))
        if name not in listing.sizes:
            raise BadInput(f"{listing.where(INDEX_FILE)} names shard {name!r}, which the repo "
                           "does not have")
    return [INDEX_FILE, *index.shards]


def engine_files(listing: RepoListing, index: ShardIndex | None) -> list[str]:
    """Every file ``kvledger fetch`` downloads: what the engine reads of a folder
    (``checkpoint/files.py``: config.json, the tokenizer, its chat templates, the
    generation config), and the weights."""
    if CONFIG_FILE not in listing.sizes:
        raise BadInput(f"{listing.where()} has no {CONFIG_FILE}: not a transformers checkpoint")
    return read_beside_weights(listing.sizes) + weight_files(listing, index)


def read_index(listing: RepoListing, limits: ReadLimits | None = None) -> ShardIndex | None:
    """The repo's safetensors index when it has one (its shards, read over HTTP within
    ``limits``: through a temporary file, never whole in memory)."""
    if INDEX_FILE not in listing.sizes:
        return None
    budget = ReadBudget(limits or ReadLimits(), listing.where())
    budget.take_bytes(listing.sizes[INDEX_FILE])
    with tempfile.TemporaryFile() as f:
        fetch_file(listing, INDEX_FILE, f.write, budget.limits.model_bytes)
        f.seek(0)
        return read_shard_index(f.read, listing.where(INDEX_FILE), budget, owners=False)


def parse_json(raw: bytes, where: str) -> object:
    try:
        return json_text.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadInput(f"{where} is not valid JSON: {exc}") from None


def download_bytes(uri: str, *, token: str | None = None, endpoint: str | None = None,
                   timeout_s: float | None = None, limits: ReadLimits | None = None) -> int:
    """The bytes ``kvledger fetch`` would download for ``uri`` into an empty cache: the sum of
    the sizes of the files it fetches, from the hub's file metadata (and the safetensors
    index of a sharded model, read within ``limits``); no weights are read. BadInput with
    one line on any error."""
    listing = list_repo(parse_uri(uri), token=token, endpoint=endpoint, timeout_s=timeout_s)
    return sum(listing.sizes[name] for name in engine_files(listing, read_index(listing, limits)))
