"""A small async Kubernetes REST client for the operator's children and status.

kopf owns the watches and events; this client does the few direct calls the handlers
need (apply a child, create a Secret once, read/patch a status, delete), with the credentials
kopf logged in with (``kopf.ConnectionInfo``). Patches are JSON merge patches.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import aiohttp
import kopf

from kvledger.engine import json_text

_MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}
# The body last applied to a child, as kubectl's last-applied-configuration: a merge patch
# leaves a key it does not name, so a field dropped from the desired state (a nodeSelector
# taken out of the spec) must be named with null, and only a field we set before may be.
LAST_APPLIED = "kvledger.dev/last-applied"


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def object_path(api_version: str, plural: str, namespace: str, name: str | None = None) -> str:
    """REST path of a namespaced collection or object, e.g. ('apps/v1', 'deployments', ...)."""
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{root}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


class KubeApi:
    """One aiohttp session to the API server; close it with ``close()``."""

    def __init__(self, info: kopf.ConnectionInfo | None = None) -> None:
        self._info = info
        self._session: aiohttp.ClientSession | None = None
        self._retired: list[aiohttp.ClientSession] = []

    def connect(self, info: kopf.ConnectionInfo) -> None:
        """Use these credentials from the next call on (kopf may log in again)."""
        if self._session is not None:
            self._retired.append(self._session)
        self._info, self._session = info, None

    def _open(self) -> aiohttp.ClientSession:
        if self._info is None:
            raise KubeError(0, "not logged in to a Kubernetes API server")
        if self._session is None or self._session.closed:
            # kopf's own helpers: bearer/basic auth, CA and client certificates (also
            # the embedded *-data of a kubeconfig), insecure-skip-tls-verify.
            tls = self._info.as_ssl_context() if self._info.server.startswith("https") else False
            self._session = aiohttp.ClientSession(
                base_url=self._info.server.rstrip("/") + "/",
                headers=self._info.as_http_headers(),
                connector=aiohttp.TCPConnector(ssl=tls),
                timeout=aiohttp.ClientTimeout(total=30))
        return self._session

    async def close(self) -> None:
        for session in [*self._retired, self._session]:
            if session is not None:
                await session.close()
        self._retired, self._session = [], None

    async def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any] | None:
        """The response object; None for 404 on GET/DELETE; KubeError for other failures."""
        async with self._open().request(method, path.lstrip("/"), **kwargs) as response:
            if response.status == 404 and method in ("GET", "DELETE"):
                return None
            body = await response.json(content_type=None) if response.content_length != 0 else {}
            if response.status >= 400:
                message = body.get("message") if isinstance(body, dict) else None
                raise KubeError(response.status, message or response.reason or "")
            return body

    async def get(self, path: str) -> dict[str, Any] | None:
        return await self._call("GET", path)

    async def list(self, path: str, label_selector: str) -> list[dict[str, Any]]:
        body = await self._call("GET", path, params={"labelSelector": label_selector})
        return list((body or {}).get("items") or [])

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", path, json=body) or {}

    async def create_once(self, api_version: str, plural: str, body: dict[str, Any]) -> bool:
        """Create the object unless one of its name exists (True if created). Nothing is
        read or rewritten: a Secret keeps the value it was first created with."""
        meta = body["metadata"]
        try:
            await self.create(object_path(api_version, plural, meta["namespace"]), body)
        except KubeError as exc:
            if exc.status == 409:  # AlreadyExists
                return False
            raise
        return True

    async def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("PATCH", path, json=body, headers=_MERGE_PATCH) or {}

    async def delete(self, path: str) -> bool:
        """True if it was there; children go too (background propagation)."""
        found = await self._call("DELETE", path, json={"propagationPolicy": "Background"})
        return found is not None

    async def apply(self, api_version: str, plural: str, body: dict[str, Any]) -> str:
        """Create the object, or merge-patch it to the desired state; 'created'/'updated'/'unchanged'.

        A field this client applied before and ``body`` no longer has is removed; fields
        others set (a ``kubectl rollout restart`` annotation, server defaults) stay."""
        meta = body["metadata"]
        path = object_path(api_version, plural, meta["namespace"], meta["name"])
        desired = copy.deepcopy(body)
        desired["metadata"].setdefault("annotations", {})[LAST_APPLIED] = json.dumps(
            body, sort_keys=True, separators=(",", ":"))
        live = await self.get(path)
        if live is None:
            await self.create(object_path(api_version, plural, meta["namespace"]), desired)
            return "created"
        removed = removals(_last_applied(live), body, live)
        if contains(live, desired) and not removed:
            return "unchanged"
        await self.patch(path, _merged(desired, removed))
        return "updated"


def _last_applied(live: dict[str, Any]) -> dict[str, Any]:
    text = ((live.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED)
    try:
        last = json_text.loads(text) if text else {}
    except ValueError:
        return {}
    return last if isinstance(last, dict) else {}


def removals(last: dict[str, Any], desired: dict[str, Any], live: Any) -> dict[str, Any]:
    """The merge patch (nulls) that removes what ``last`` set, ``desired`` drops and ``live``
    still has; lists need none (a merge patch replaces a list whole)."""
    out: dict[str, Any] = {}
    if not isinstance(live, dict):
        return out
    for key, value in last.items():
        if key not in desired:
            if key not in live:
                continue
            others = (isinstance(value, dict) and isinstance(live[key], dict)
                      and live[key].keys() - value.keys())
            if others:  # a map others write to as well (annotations): only our keys go
                nested = removals(value, {}, live[key])
                if nested:
                    out[key] = nested
            else:
                out[key] = None
        elif isinstance(value, dict) and isinstance(desired[key], dict):
            nested = removals(value, desired[key], live.get(key))
            if nested:
                out[key] = nested
    return out


def _merged(desired: dict[str, Any], removed: dict[str, Any]) -> dict[str, Any]:
    out = dict(desired)
    for key, value in removed.items():
        out[key] = _merged(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def contains(live: Any, desired: Any) -> bool:
    """Whether every field we set is already so (the server adds defaults we ignore)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            key in live and contains(live[key], value) for key, value in desired.items())
    if isinstance(desired, list):
        return (isinstance(live, list) and len(live) == len(desired)
                and all(contains(a, b) for a, b in zip(live, desired, strict=True)))
    return live == desired or str(live) == str(desired)
