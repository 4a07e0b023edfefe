"""Reading a hub repo's files over HTTP: Range requests, bounded retries, one-line errors.

Every request goes through huggingface_hub's session (its proxy and TLS settings, and its
offline switch) with its headers (the token: an explicit one, else ``HF_TOKEN`` or its token
file). A request that fails for a reason that may pass (no connection, a timeout, 429, 5xx)
is tried ``ATTEMPTS`` times in all; any failure ends as one BadInput line that never holds
the token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import quote

from kvledger.engine.errors import BadInput

if TYPE_CHECKING:
    from kvledger.engine.budget.hub import HubModel, RepoListing

# Bounded retries on connection errors, timeouts, 429 and 5xx: ATTEMPTS tries with a
# doubling pause from FIRST_PAUSE_S, so a dead endpoint fails in under 2 s plus timeouts.
ATTEMPTS = 4
FIRST_PAUSE_S = 0.25
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
TIMEOUT_S = 10.0  # per request: connecting, or waiting for the next bytes
# config.json and the index are read whole; anything this big is not one.
MAX_SMALL_FILE_BYTES = 64 * 2**20
T = TypeVar("T")


def read_small_file(listing: RepoListing, filename: str) -> bytes:
    """A whole small file (config, index) at the listing's commit."""
    size = listing.sizes.get(filename, 0)
    if size > MAX_SMALL_FILE_BYTES:
        raise BadInput(f"{listing.where(filename)} is {size} bytes: too large to be what it says")
    return read_range(listing, filename, 0, MAX_SMALL_FILE_BYTES, ranged=False)


def read_range(listing: RepoListing, filename: str, start: int, length: int, *,
               ranged: bool = True) -> bytes:
    """At most ``length`` bytes of a file from byte ``start`` (an HTTP Range request).

    The response is streamed and closed once enough has arrived, so a server that ignores
    Range (200 with the whole file) still costs only what was asked for.
    """
    from huggingface_hub import get_session, hf_raise_for_status
    from huggingface_hub.utils import build_hf_headers

    # hf_hub_url's, built here: it swaps in an endpoint only when HF_ENDPOINT was read at import.
    url = f"{listing.endpoint}/{listing.model.repo_id}/resolve/{listing.commit}/{quote(filename)}"
    headers = build_hf_headers(token=listing.token)
    if ranged:
        headers["Range"] = f"bytes={start}-{start + length - 1}"

    def read() -> bytes:
        chunks, have, skip = [], 0, 0
        with get_session().stream("GET", url, headers=headers, timeout=TIMEOUT_S) as response:
            if response.status_code >= 400:
                response.read()
            hf_raise_for_status(response)
            if ranged and response.status_code != 206:
                skip = start  # the whole file came back: drop what precedes the range
            for chunk in response.iter_bytes():
                if skip:
                    cut = min(skip, len(chunk))
                    chunk, skip = chunk[cut:], skip - cut
                chunks.append(chunk)
                have += len(chunk)
                if have >= length:
                    break
        return b"".join(chunks)[:length]

    return with_retries(read, listing.model, listing.endpoint, filename)


def with_retries(call: Callable[[], T], model: HubModel, endpoint: str,
                 filename: str | None = None) -> T:
    """``call()``, retried on connection errors, timeouts, 429 and 5xx (``ATTEMPTS`` tries,
    pauses doubling from ``FIRST_PAUSE_S``); any hub error becomes one BadInput line."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    pause = FIRST_PAUSE_S
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return call()
        except OfflineModeIsEnabled:
            raise BadInput(f"{model.uri}: HF_HUB_OFFLINE is set, so the hub cannot be "
                           "reached; unset it, or run `kvledger fetch` first") from None
        except (httpx2.TransportError, HfHubHTTPError) as exc:
            status = exc.response.status_code if isinstance(exc, HfHubHTTPError) else None
            if (status is not None and status not in RETRY_STATUSES) or attempt == ATTEMPTS:
                raise hub_error(exc, model, endpoint, filename, attempt) from None
        time.sleep(pause)
        pause *= 2
    raise AssertionError("unreachable")


def hub_error(exc: Exception, model: HubModel, endpoint: str, filename: str | None = None,
              attempts: int = 1) -> BadInput:
    """One line a user can act on, for an error of huggingface_hub or its HTTP client."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    status = getattr(getattr(exc, "response", None), "status_code", None)
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    if isinstance(exc, GatedRepoError):
        if status == 403:
            return BadInput(f"{model.uri} is gated and the token in HF_TOKEN has no access to "
                            "it: request access on the model's page (the hub answered 403)")
        return BadInput(f"{model.uri} is gated: set HF_TOKEN to a token that has been granted "
                        f"access (the hub answered {status})")
    if isinstance(exc, RevisionNotFoundError):
        return BadInput(f"{model.uri}: {model.repo_id} has no revision {model.revision!r}")
    if isinstance(exc, RemoteEntryNotFoundError):
        return BadInput(f"{model.uri}: {filename or 'a file'} was not found on the hub")
    if isinstance(exc, RepositoryNotFoundError):
        return BadInput(f"{model.uri}: no such model repository at {endpoint} (a private one "
                        "needs HF_TOKEN)")
    if isinstance(exc, HfHubHTTPError):
        if status == 401:
            return BadInput(f"{model.uri}: the hub at {endpoint} refused the token in HF_TOKEN "
                            "(401: invalid credentials)")
        what = f" for {filename}" if filename else ""
        return BadInput(f"{model.uri}: the hub at {endpoint} answered HTTP {status}{what}{tries}")
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return BadInput(f"{model.uri}: cannot reach the hub at {endpoint}{tries} "
                    f"({type(exc).__name__}: {reason}); check the network, HF_ENDPOINT or a proxy")
