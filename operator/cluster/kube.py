"""The operator's own calls to the API server, through the official client's asyncio
half (``kubernetes.aio``).

kopf owns the watches and events; this module does the few direct calls the handlers
need (apply a child, create a Secret once, read/patch a status, delete), with the credentials
kopf logged in with (``kopf.ConnectionInfo``: its headers and TLS context) on
``kubernetes.aio``'s ``ApiClient`` (its transport, serialization and errors). A built-in
kind is sent as the client's typed model (``V1Deployment``, ``V1Service``, ``V1Secret``, ...):
``typed`` validates the body field by field against it and refuses one the model would
change (a field it does not know, an int where a quantity is a string) before it is
sent, rather than have the API server coerce or drop it. Custom resources
(LeaderWorkerSet, InferencePool, ScaledObject, ours) go as dicts; the tests check them
against their vendored CRDs.

Changes are JSON merge patches with kubectl's last-applied record (``apply``), not
server-side apply: kmock's emulator, the API server of the tests, does not take apply
patches, and a client-side record is what ``kubectl apply`` itself did for years.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import TYPE_CHECKING, Protocol, Self

import kopf

from kvledger.engine import json_text
from kvledger.operator.cluster.merge_patch import (
    LAST_APPLIED,
    Body,
    contains,
    last_applied,
    merged,
    removals,
)
from kvledger.operator.cluster.ownership import require_same_owner

if TYPE_CHECKING:  # the client's models load on the first call
    from kubernetes.aio.client import ApiClient



class ClientModel(Protocol):
    """One of the official client's models (``V1Deployment``, ...: pydantic models)."""

    @classmethod
    def from_dict(cls, obj: Body) -> Self: ...

_MERGE_PATCH = "application/merge-patch+json"
TIMEOUT_S = 30.0


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status

    @property
    def refused(self) -> bool:
        """Whether the API server refused the request as it was written: a 4xx that a retry
        alone does not pass (not a conflict, a rate limit or an object gone meanwhile)."""
        return 400 <= self.status < 500 and self.status not in (404, 409, 429)


def object_path(api_version: str, plural: str, namespace: str, name: str | None = None) -> str:
    """REST path of a namespaced collection or object, e.g. ('apps/v1', 'deployments', ...)."""
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{root}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


def model_class(api_version: str, kind: str) -> type[ClientModel] | None:
    """The official client's model of a built-in kind (``V1Deployment`` for apps/v1
    Deployment), None for a custom resource's (a group of its own, or one the client does
    not know: GAIE's ``inference.networking.k8s.io``)."""
    group, _, version = api_version.rpartition("/")
    if group and "." in group and not group.endswith(".k8s.io"):
        return None
    from kubernetes.aio import client

    try:
        return getattr(client, version[:1].upper() + version[1:] + kind)
    except AttributeError:
        return None


def typed(body: Body) -> Body | ClientModel:
    """``body`` as the client's typed model when its kind is built in (else ``body``).
    KubeError 422 (as the API server's Invalid) when the model refuses a field or would
    send it otherwise than written: nothing is coerced or dropped on the way."""
    model = model_class(str(body.get("apiVersion", "")), str(body.get("kind", "")))
    if model is None:
        return body
    from pydantic import ValidationError

    where = f"{body['kind']} {(body.get('metadata') or {}).get('name', '')}".rstrip()
    try:
        out = model.from_dict(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise KubeError(422, f"{where} is not a valid {model.__name__}: {field}: "
                             f"{first['msg']}") from None
    if _serializer().sanitize_for_serialization(out) != body:
        raise KubeError(422, f"{where}: the client's {model.__name__} would not send it as "
                             f"written (a field it does not know, or of another type)")
    return out


@functools.cache
def _serializer() -> ApiClient:
    """An ApiClient for its serialization alone (it opens no connection)."""
    from kubernetes.aio.client import ApiClient

    return ApiClient()


class KubeApi:
    """One ``kubernetes.aio`` ApiClient to the API server; close it with ``close()``."""

    def __init__(self, info: kopf.ConnectionInfo | None = None) -> None:
        self._info = info
        self._client: ApiClient | None = None
        self._retired: list[ApiClient] = []

    def connect(self, info: kopf.ConnectionInfo) -> None:
        """Use these credentials from the next call on (kopf may log in again)."""
        if self._client is not None:
            self._retired.append(self._client)
        self._info, self._client = info, None

    def _open(self) -> ApiClient:
        if self._info is None:
            raise KubeError(0, "not logged in to a Kubernetes API server")
        if self._client is None:
            from kubernetes.aio.client import ApiClient, Configuration

            # No proxy from the environment, as kopf's own watches: and aiohttp's lookup of
            # it (and of ~/.netrc) on a thread at every call cost 5x the call's CPU.
            client = ApiClient(Configuration(host=self._info.server.rstrip("/"),
                                             client_session_kwargs={"trust_env": False}))
            # kopf's own: bearer/basic auth, CA and client certificates (also the embedded
            # *-data of a kubeconfig), insecure-skip-tls-verify. The context is read when
            # the client opens its session, at the first call.
            for header, value in self._info.as_http_headers().items():
                client.set_default_header(header, value)
            if self._info.server.startswith("https"):
                client.rest_client.ssl_context = self._info.as_ssl_context()
            self._client = client
        return self._client

    async def close(self) -> None:
        for client in [*self._retired, self._client]:
            if client is not None:
                await client.close()
        self._retired, self._client = [], None

    async def request(self, method: str, path: str, body: Body | ClientModel | None = None, *,
                    query: dict[str, str] | None = None,
                    content_type: str | None = None) -> Body | None:
        """One call as written (``body`` a dict, or a typed model): the response object;
        None for 404 on GET/DELETE; KubeError for other failures (the API server's, or
        none reached: status 0)."""
        from kubernetes.aio.client.exceptions import OpenApiException

        client = self._open()
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            request = await client.param_serialize(
                method, path, query_params=list((query or {}).items()) or None,
                header_params=headers, body=body)
            response = await client.call_api(*request, _request_timeout=TIMEOUT_S)
            data = await response.read()
        except OpenApiException as exc:
            raise KubeError(getattr(exc, "status", 0) or 0, str(exc).splitlines()[0]) from None
        except (OSError, TimeoutError) as exc:  # aiohttp's connection errors are OSErrors
            raise KubeError(0, f"{type(exc).__name__}: {exc}") from None
        if response.status == 404 and method in ("GET", "DELETE"):
            return None
        try:
            answer = json_text.loads(data) if data else {}
        except ValueError:
            answer = {}
        if response.status >= 400:
            message = answer.get("message") if isinstance(answer, dict) else None
            raise KubeError(response.status, message or response.reason or "")
        return answer if isinstance(answer, dict) else {}

    async def get(self, path: str) -> Body | None:
        return await self.request("GET", path)

    async def list(self, path: str, label_selector: str | None = None) -> list[Body]:
        """The collection's items (none where its kind is not served: a 404)."""
        query = {"labelSelector": label_selector} if label_selector is not None else None
        body = await self.request("GET", path, query=query)
        return list((body or {}).get("items") or [])

    async def create(self, path: str, body: Body) -> Body:
        return await self.request("POST", path, typed(body)) or {}

    async def create_once(self, api_version: str, plural: str, body: Body) -> bool:
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

    async def patch(self, path: str, body: Body) -> Body:
        return await self.request("PATCH", path, body, content_type=_MERGE_PATCH) or {}

    async def delete(self, path: str, *, uid: str | None = None) -> bool:
        """True if it was there; children go too (background propagation). With ``uid``,
        only the object of that uid (a precondition: another is a 409)."""
        options: Body = {"apiVersion": "v1", "kind": "DeleteOptions",
                         "propagationPolicy": "Background"}
        if uid is not None:
            options["preconditions"] = {"uid": uid}
        found = await self.request("DELETE", path, options)
        return found is not None

    async def apply(self, api_version: str, plural: str, body: Body) -> str:
        """Create the object, or merge-patch it to the desired state; 'created'/'updated'/'unchanged'.

        A field this client applied before and ``body`` no longer has is removed; fields
        others set (a ``kubectl rollout restart`` annotation, server defaults) stay. What
        is sent is checked against its typed model (``typed``) first."""
        meta = body["metadata"]
        path = object_path(api_version, plural, meta["namespace"], meta["name"])
        desired = copy.deepcopy(body)
        desired["metadata"].setdefault("annotations", {})[LAST_APPLIED] = json.dumps(
            body, sort_keys=True, separators=(",", ":"))
        live = await self.get(path)
        if live is None:
            await self.create(object_path(api_version, plural, meta["namespace"]), desired)
            return "created"
        require_same_owner(live, body)  # another's object of this name is left as it is
        removed = removals(last_applied(live), body, live)
        if contains(live, desired) and not removed:
            return "unchanged"
        typed(desired)  # what the patch makes of the object: refused here if not valid
        await self.patch(path, merged(desired, removed))
        return "updated"
