"""A Hugging Face Hub-compatible HTTP server on 127.0.0.1, for tests and bench/hub_refusal.py
(the real hub cannot be reached from here). Point huggingface_hub at it with HF_ENDPOINT.

It serves repos the caller writes as folders (``add_commit``), at exactly the endpoints
huggingface_hub 2.4.0 calls for kvledger:

- ``GET /api/models/ORG/NAME[/revision/REV]``: model info, ``sha`` the commit REV names,
  ``siblings`` with sizes, blob ids and LFS data when ``?blobs=true`` (``HfApi.model_info``);
- ``GET /api/models/ORG/NAME/tree/REV``: the file listing with sizes (``snapshot_download``);
- ``HEAD|GET /ORG/NAME/resolve/REV/FILE``: a small file answers itself (``ETag`` = its git
  blob id, ``X-Repo-Commit``); an LFS one (``*.safetensors``) redirects, as the hub does, to a
  "CDN" on another host name (``localhost``, so the bearer token is not forwarded) with
  ``X-Linked-Size`` and ``X-Linked-Etag`` (its sha256);
- ``HEAD|GET /cdn/ORG/NAME/COMMIT/FILE``: LFS content. ``Range: bytes=A-B`` -> 206 with
  ``Content-Range`` everywhere.

Errors are the hub's: 404 with ``X-Error-Code: RepoNotFound``, ``RevisionNotFound`` or
``EntryNotFound``; a gated repo's files answer 401 without a bearer token and 403 with a wrong
one (``X-Error-Code: GatedRepo``), while its metadata stays public; a token the server does
not know (``tokens``) is a 401 "Invalid credentials" anywhere. ``fail_next(n)`` answers the
next n requests 503; ``drip_s``, ``redirect_loops`` and ``listed_sizes`` make a file's body
come a byte at a time, its resolve redirect to itself, its listed size lie. Body bytes served are counted per file (``served_bytes``).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

CHUNK_BYTES = 1 << 16
LISTING = "<listing>"  # drip_s's key for the API's JSON answers
LFS_POINTER_BYTES = 134
_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


@dataclass
class _Repo:
    commits: dict[str, Path] = field(default_factory=dict)  # commit -> folder
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    token: str | None = None  # a gated repo's files need this bearer token


class HubServer:
    """``with HubServer() as hub: hub.add_commit("org/name", folder)``; ``hub.url`` is the
    endpoint for ``HF_ENDPOINT``."""

    def __init__(self) -> None:
        self.repos: dict[str, _Repo] = {}
        self.served: Counter[tuple[str, str]] = Counter()  # (repo_id, file) -> body bytes
        self.requests: list[tuple[str, str, str | None, int]] = []  # method, path, range, status
        self.tokens: set[str] = set()  # valid bearer tokens; any other one is a 401
        # Misbehaviour, by file name: a byte every so many seconds; a redirect to itself;
        # a size in the listing that is not the file's.
        self.drip_s: dict[str, float] = {}
        self.redirect_loops: set[str] = set()
        self.listed_sizes: dict[str, int] = {}
        self._failures = 0
        self._lock = threading.Lock()
        self._meta: dict[Path, tuple[int, str, str]] = {}
        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = _Server(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def add_commit(self, repo_id: str, folder: Path, *, branch: str = "main",
                   token: str | None = None) -> str:
        """Serve ``folder`` as a new commit of ``repo_id`` that ``branch`` points to."""
        repo = self.repos.setdefault(repo_id, _Repo())
        commit = hashlib.sha1(f"{repo_id}:{len(repo.commits)}:{folder}".encode()).hexdigest()
        repo.commits[commit] = Path(folder)
        repo.refs[branch] = commit
        repo.token = token if token is not None else repo.token
        if token is not None:
            self.tokens.add(token)
        return commit

    def served_bytes(self, repo_id: str, suffix: str = "") -> int:
        """Body bytes served of ``repo_id``'s files whose name ends with ``suffix``."""
        with self._lock:
            return sum(n for (r, f), n in self.served.items() if r == repo_id and f.endswith(suffix))

    def fail_next(self, count: int) -> None:
        with self._lock:
            self._failures = count

    def take_failure(self) -> bool:
        with self._lock:
            if self._failures <= 0:
                return False
            self._failures -= 1
            return True

    def count(self, repo_id: str, filename: str, nbytes: int) -> None:
        with self._lock:
            self.served[(repo_id, filename)] += nbytes

    def log(self, method: str, path: str, range_header: str | None, status: int) -> None:
        with self._lock:
            self.requests.append((method, path, range_header, status))

    def metadata(self, path: Path) -> tuple[int, str, str]:
        """``(size, git blob id, sha256)``; hashes of big (sparse) files are made up."""
        with self._lock:
            if path not in self._meta:
                size = path.stat().st_size
                if size <= 64 * 2**20:
                    data = path.read_bytes()
                    blob = hashlib.sha1(b"blob %d\0" % size + data).hexdigest()
                    sha256 = hashlib.sha256(data).hexdigest()
                else:
                    blob = hashlib.sha1(f"{path}:{size}".encode()).hexdigest()
                    sha256 = hashlib.sha256(f"{path}:{size}".encode()).hexdigest()
                self._meta[path] = (size, blob, sha256)
            return self._meta[path]

    def files(self, folder: Path) -> list[str]:
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """Quiet when a client hangs up mid-request (a read that stopped at what it
        needed); anything else is printed, as the standard server does."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def is_lfs(filename: str) -> bool:
    return filename.endswith(".safetensors")


def closed_port_url() -> str:
    """An endpoint where nothing listens: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._route(body=False)

    def do_GET(self) -> None:
        self._route(body=True)

    # -- routing ----------------------------------------------------------------------

    def _route(self, body: bool) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        self._body = body
        if self.hub.take_failure():
            return self._error(503, "", "the hub is overloaded")
        auth = self.headers.get("Authorization")
        if auth is not None and auth.removeprefix("Bearer ") not in self.hub.tokens:
            return self._error(401, "", "Invalid credentials in Authorization header")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._api(parts[2] + "/" + parts[3], parts[4:], parse_qs(url.query))
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]))
        if parts[:1] == ["cdn"] and len(parts) >= 5:
            return self._cdn(parts[1] + "/" + parts[2], parts[3], "/".join(parts[4:]))
        return self._error(404, "", "no such route")

    def _commit(self, repo_id: str, revision: str) -> tuple[_Repo, str] | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        commit = revision if revision in repo.commits else repo.refs.get(revision)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo, commit

    def _api(self, repo_id: str, rest: list[str], query: dict) -> None:
        kind, revision = (rest[0], rest[1]) if len(rest) >= 2 else ("info", "main")
        found = self._commit(repo_id, revision)
        if found is None:
            return
        repo, commit = found
        folder = repo.commits[commit]
        if kind == "tree":
            entries = [self._tree_entry(folder, name) for name in self.hub.files(folder)]
            return self._json(200, entries)
        blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")
        siblings = []
        for name in self.hub.files(folder):
            entry = {"rfilename": name}
            if blobs:
                size, blob, sha256 = self.hub.metadata(folder / name)
                size = self.hub.listed_sizes.get(name, size)
                entry |= {"size": size, "blobId": blob}
                if is_lfs(name):
                    entry["lfs"] = {"size": size, "sha256": sha256, "pointerSize": LFS_POINTER_BYTES}
            siblings.append(entry)
        self._json(200, {"_id": repo_id, "id": repo_id, "modelId": repo_id, "sha": commit,
                         "private": False, "disabled": False,
                         "gated": "manual" if repo.token else False, "siblings": siblings})

    def _tree_entry(self, folder: Path, name: str) -> dict:
        size, blob, sha256 = self.hub.metadata(folder / name)
        entry = {"type": "file", "path": name, "size": size, "oid": blob}
        if is_lfs(name):
            entry["lfs"] = {"oid": sha256, "size": size, "pointerSize": LFS_POINTER_BYTES}
        return entry

    def _resolve(self, repo_id: str, revision: str, filename: str) -> None:
        found = self._commit(repo_id, revision)
        if found is None:
            return
        repo, commit = found
        if repo.token is not None:
            auth = self.headers.get("Authorization")
            if auth is None:
                return self._error(401, "GatedRepo", "Access to this model is restricted: "
                                   "you must be authenticated")
            if auth != f"Bearer {repo.token}":
                return self._error(403, "GatedRepo", "Access to this model is restricted and "
                                   "you are not in the authorized list")
        path = repo.commits[commit] / filename
        if not path.is_file():
            return self._error(404, "EntryNotFound", f"{filename} does not exist", commit=commit)
        if filename in self.hub.redirect_loops:
            return self._send(302, {"Location": self.path, "Content-Length": "0"})
        size, blob, sha256 = self.hub.metadata(path)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{blob}"', "Accept-Ranges": "bytes"}
        if is_lfs(filename):
            host = f"http://localhost:{self.hub.port}"
            location = f"{host}/cdn/{quote(repo_id)}/{commit}/{quote(filename)}"
            headers |= {"Location": location, "X-Linked-Size": str(size),
                        "X-Linked-Etag": f'"{sha256}"', "Content-Length": "0"}
            return self._send(302, headers)
        self._file(repo_id, filename, path, headers)

    def _cdn(self, repo_id: str, commit: str, filename: str) -> None:
        repo = self.hub.repos.get(repo_id)
        folder = repo.commits.get(commit) if repo else None
        if folder is None or not (folder / filename).is_file():
            return self._error(404, "", "no such object")
        _, _, sha256 = self.hub.metadata(folder / filename)
        self._file(repo_id, filename, folder / filename,
                   {"ETag": f'"{sha256}"', "Accept-Ranges": "bytes"})

    # -- answers ----------------------------------------------------------------------

    def _file(self, repo_id: str, filename: str, path: Path, headers: dict) -> None:
        size = path.stat().st_size
        start, end, status = 0, size - 1, 200
        range_header = self.headers.get("Range")
        if range_header:
            match = _RANGE.match(range_header.strip())
            if match is None or int(match[1]) >= size:
                return self._send(416, {"Content-Range": f"bytes */{size}", "Content-Length": "0"})
            start = int(match[1])
            end = min(int(match[2]) if match[2] else size - 1, size - 1)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        length = max(0, end - start + 1)
        self._send(status, headers | {"Content-Length": str(length),
                                      "Content-Type": "application/octet-stream"})
        if not self._body:
            return
        drip_s = self.hub.drip_s.get(filename)
        with open(path, "rb") as f:
            f.seek(start)
            left = length
            while left > 0:
                if drip_s is not None:
                    time.sleep(drip_s)
                chunk = f.read(1 if drip_s is not None else min(CHUNK_BYTES, left))
                if not chunk:
                    break
                try:
                    self.wfile.write(chunk)
                    if drip_s is not None:
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    break  # the client read what it wanted and hung up
                self.hub.count(repo_id, filename, len(chunk))
                left -= len(chunk)

    def _json(self, status: int, doc: object) -> None:
        raw = json.dumps(doc).encode()
        self._send(status, {"Content-Type": "application/json", "Content-Length": str(len(raw))})
        if not self._body:
            return
        drip_s = self.hub.drip_s.get(LISTING)
        if drip_s is None:
            return self.wfile.write(raw)
        for i in range(len(raw)):
            time.sleep(drip_s)
            try:
                self.wfile.write(raw[i:i + 1])
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                return

    def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
        raw = json.dumps({"error": message}).encode()
        headers = {"X-Error-Message": message, "Content-Type": "application/json",
                   "Content-Length": str(len(raw))}
        if code:
            headers["X-Error-Code"] = code
        if commit:
            headers["X-Repo-Commit"] = commit
        self._send(status, headers)
        if self._body:
            self.wfile.write(raw)

    def _send(self, status: int, headers: dict) -> None:
        self.hub.log(self.command, self.path, self.headers.get("Range"), status)
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
