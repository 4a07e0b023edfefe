"""Reading a hub repo's files over HTTP: Range requests, bounded retries, one-line errors.

Every request goes through huggingface_hub's session (its proxy and TLS settings, and its
offline switch) with its headers (the token: an explicit one, else ``HF_TOKEN`` or its token
file). A request that fails for a reason that may pass (no connection, a timeout, 429, 5xx)
is tried ``ATTEMPTS`` times in all, within a deadline per file and one per command
(``--hub-timeout``); any failure ends as one BadInput line that never holds the token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

from kvledger.engine.checkpoint.hub.uri import HubModel
from kvledger.engine.errors import BadInput

# Bounded retries on connection errors, timeouts, 429 and 5xx: ATTEMPTS tries with a
# doubling pause from FIRST_PAUSE_S, so a dead endpoint fails in under 2 s plus timeouts.
ATTEMPTS = 4
FIRST_PAUSE_S = 0.25
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
TIMEOUT_S = 10.0  # per request: connecting, or waiting for the next bytes
# One file's read, retries included, however slowly its bytes come (a server that sends
# a byte every few seconds never trips TIMEOUT_S); the whole command's reads are bounded
# by --hub-timeout (DEFAULT_HUB_TIMEOUT_S).
FILE_TIMEOUT_S = 60.0
DEFAULT_HUB_TIMEOUT_S = 120.0
# The repo's listing is parsed whole (huggingface_hub's ModelInfo): the largest model repos
# list a few hundred files in well under 1 MiB, and a listing of small entries costs about
# ten times its bytes once parsed.
MAX_LISTING_BYTES = 4 * 2**20
T = TypeVar("T")
# Takes each piece of a body as it arrives; returning False says it wants no more.
Sink = Callable[[bytes], "bool | None"]


@dataclass(frozen=True)
class Deadline:
    """When hub reads must be done by (``time.monotonic()``), and which limit set it."""

    at: float
    limit_s: float
    name: str  # how messages name the limit

    @classmethod
    def after(cls, seconds: float, name: str) -> Deadline:
        return cls(time.monotonic() + seconds, seconds, name)

    def left_s(self) -> float:
        return self.at - time.monotonic()

    def sooner(self, other: Deadline | None) -> Deadline:
        return self if other is None or self.at <= other.at else other


class DeadlineExceeded(Exception):
    def __init__(self, deadline: Deadline) -> None:
        super().__init__(deadline.name)
        self.deadline = deadline


@dataclass(frozen=True)
class RepoListing:
    """A repo's files at one commit, with their sizes, and how to reach them."""

    model: HubModel
    commit: str  # the 40-hex commit the revision resolved to
    sizes: dict[str, int]  # file path -> bytes
    endpoint: str
    token: str | None = None  # None: huggingface_hub's own (HF_TOKEN, or its token file)
    deadline: Deadline | None = None  # the command's hub reads end by then (--hub-timeout)

    def where(self, filename: str = "") -> str:
        """How messages name a file: the uri, the short commit, the file."""
        return f"{self.model.uri} (commit {self.commit[:12]}){' ' + filename if filename else ''}"


def command_deadline(seconds: float | None) -> Deadline:
    """The deadline of one command's hub reads (``--hub-timeout``)."""
    seconds = DEFAULT_HUB_TIMEOUT_S if seconds is None else seconds
    return Deadline.after(seconds, f"--hub-timeout {seconds:g} s")


def file_deadline(command: Deadline | None) -> Deadline:
    return Deadline.after(FILE_TIMEOUT_S, f"the {FILE_TIMEOUT_S:g} s per file").sooner(command)


def read_small_file(listing: RepoListing, filename: str, limit: int) -> bytes:
    """A whole small file (config.json) at the listing's commit, into memory: at most
    ``limit`` bytes, and no longer than the listing says it is."""
    chunks: list[bytes] = []
    fetch_file(listing, filename, chunks.append, limit)
    return b"".join(chunks)


def fetch_file(listing: RepoListing, filename: str, sink: Sink, limit: int) -> int:
    """A whole file at the listing's commit, handed to ``sink`` piece by piece as it
    arrives: BadInput when the listing gives it more than ``limit`` bytes (nothing is asked
    for), or when the hub sends more than the listing gives. Returns its size."""
    size = listing.sizes.get(filename)
    if size is not None and size > limit:
        raise BadInput(f"{listing.where(filename)} is {size} bytes, more than the {limit} "
                       "bytes such a file may have")
    cap = limit if size is None else size
    got = read_range(listing, filename, 0, cap + 1, ranged=False, sink=sink)
    if got > cap:
        raise BadInput(f"{listing.where(filename)}: the hub sent more than the {cap} bytes "
                       "its listing gives")
    return got


def read_range(listing: RepoListing, filename: str, start: int, length: int, *,
               ranged: bool = True, sink: Sink | None = None) -> Any:
    """At most ``length`` bytes of a file from byte ``start`` (an HTTP Range request),
    within ``FILE_TIMEOUT_S`` and the listing's command deadline: the bytes, or with
    ``sink`` their count, each piece handed to ``sink`` as it arrives (a retry asks only
    for what is still missing).

    The response is streamed and closed once enough has arrived, so a server that ignores
    Range (200 with the whole file) still costs only what was asked for.
    """
    from huggingface_hub.utils import build_hf_headers

    # hf_hub_url's, built here: it swaps in an endpoint only when HF_ENDPOINT was read at import.
    url = f"{listing.endpoint}/{listing.model.repo_id}/resolve/{listing.commit}/{quote(filename)}"
    deadline = file_deadline(listing.deadline)
    chunks: list[bytes] = []
    got = 0

    def take(chunk: bytes) -> bool | None:
        nonlocal got
        got += len(chunk)
        return (sink or chunks.append)(chunk)

    def attempt() -> None:
        headers = build_hf_headers(token=listing.token)
        if ranged:
            headers["Range"] = f"bytes={start + got}-{start + length - 1}"
        stream_get(url, headers, length - got, deadline, skip=start + got, sink=take,
                   ranged=ranged)

    with_retries(attempt, listing.model, listing.endpoint, filename, deadline)
    return got if sink is not None else b"".join(chunks)


def stream_get(url: str, headers: dict[str, str], length: int, deadline: Deadline, *,
               skip: int = 0, params: dict[str, str] | None = None, sink: Sink | None = None,
               ranged: bool = True) -> bytes:
    """At most ``length`` bytes of a GET's body, through huggingface_hub's session and
    errors; with ``sink`` each piece goes there as it arrives and b"" is returned. ``skip``:
    the bytes to drop when the whole body came back (a 200, not a 206 to a Range).
    DeadlineExceeded when ``deadline`` passes, checked as each piece arrives."""
    from huggingface_hub import get_session, hf_raise_for_status

    chunks, have = [], 0
    timeout = max(0.01, min(TIMEOUT_S, deadline.left_s()))
    with get_session().stream("GET", url, headers=headers, params=params,
                              timeout=timeout) as response:
        if response.status_code >= 400:
            response.read()
        hf_raise_for_status(response)
        if response.status_code == 206 and ranged:
            skip = 0
        for chunk in response.iter_bytes():
            if deadline.left_s() <= 0:
                raise DeadlineExceeded(deadline)
            if skip:
                cut = min(skip, len(chunk))
                chunk, skip = chunk[cut:], skip - cut
            chunk = chunk[:length - have]
            if chunk:
                have += len(chunk)
                if (sink or chunks.append)(chunk) is False:
                    break
            if have >= length:
                break
    return b"".join(chunks)


def with_retries(call: Callable[[], T], model: HubModel, endpoint: str,
                 filename: str | None = None, deadline: Deadline | None = None) -> T:
    """``call()``, retried on connection errors, timeouts, 429 and 5xx (``ATTEMPTS`` tries,
    pauses doubling from ``FIRST_PAUSE_S``) while ``deadline`` allows; any hub error, a
    redirect loop and the deadline passing become one BadInput line."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    pause = FIRST_PAUSE_S
    for attempt in range(1, ATTEMPTS + 1):
        try:
            if deadline is not None and deadline.left_s() <= 0:
                raise DeadlineExceeded(deadline)
            return call()
        except DeadlineExceeded as exc:
            raise deadline_error(exc.deadline, model, endpoint, filename) from None
        except OfflineModeIsEnabled:
            raise BadInput(f"{model.uri}: HF_HUB_OFFLINE is set, so the hub cannot be "
                           "reached; unset it, or run `kvledger fetch` first") from None
        except httpx2.TooManyRedirects:
            what = f" for {filename}" if filename else ""
            raise BadInput(f"{model.uri}: the hub at {endpoint} redirected too many times"
                           f"{what} (a redirect loop?)") from None
        except httpx2.TimeoutException as exc:
            if deadline is not None and deadline.left_s() <= 0:
                raise deadline_error(deadline, model, endpoint, filename) from None
            if attempt == ATTEMPTS:
                raise hub_error(exc, model, endpoint, filename, attempt) from None
        except (httpx2.TransportError, HfHubHTTPError) as exc:
            status = exc.response.status_code if isinstance(exc, HfHubHTTPError) else None
            if (status is not None and status not in RETRY_STATUSES) or attempt == ATTEMPTS:
                raise hub_error(exc, model, endpoint, filename, attempt) from None
        except httpx2.HTTPError as exc:  # a malformed answer: retrying will not mend it
            raise hub_error(exc, model, endpoint, filename, attempt) from None
        if deadline is not None:
            pause = min(pause, max(0.0, deadline.left_s()))
        time.sleep(pause)
        pause *= 2
    raise AssertionError("unreachable")


def deadline_error(deadline: Deadline, model: HubModel, endpoint: str,
                   filename: str | None) -> BadInput:
    what = filename or "the file listing"
    return BadInput(f"{model.uri}: reading {what} from the hub at {endpoint} took longer than "
                    f"{deadline.name}; the hub is too slow or stalled")


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
