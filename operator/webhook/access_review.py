"""The confused-deputy check: a resource may name only the Secrets, ConfigMaps and
PersistentVolumeClaims its author may read.

The pods the operator renders read what the spec names (``apiKeySecretRef``,
``tenantsSecretRef``, ``model.tokenSecretRef``, ``imagePullSecrets``, an env var's
``valueFrom.configMapKeyRef``), and Kubernetes lets a pod mount any Secret of its
namespace: whoever may create a Deployment may read them all, and its RBAC says so. An
InferenceService is not a Deployment. A role that may create InferenceServices but not read
Secrets (KServe's ``kserve-edit`` is such a split) would otherwise have the operator hand
another team's hub token to ``fetch``, which sends it to the hub for the model the author
chose (a gated or private repository of that team's, then served to the author), or make
a ConfigMap's value a variable whose failure the status quoted. A claim is alike: the pods
mount ``model.volume``'s (its checkpoint then served to the author) and write
``model.cache``'s (``fetch`` downloads into it), so another team's claim would be read or
filled on the author's behalf; ``get`` on the claim is what is asked.

So the webhook asks the API server, as Kubernetes' own admission plugins ask for what a
request reaches past its object: a ``SubjectAccessReview`` for the request's user (its
name, uid, groups and extra, from the AdmissionReview's ``userInfo``), ``get`` on each
Secret, ConfigMap or claim a CREATE names or an UPDATE adds or changes (another name,
another key, the token sent for another model, hub adapter or hub, a ConfigMap read into
another variable). A reference an UPDATE leaves as it was is not asked again: the operator's own
writes and an admin's edits of other fields pass. Each (kind, name) is asked once per
review, at most ``MAX_REVIEWS`` of them, all by the review's deadline.

It fails closed: an answer that is not "allowed" (denied, no opinion, an error, no answer
in time, the operator not allowed to ask) refuses, as the API server's authorizer does; an
author could otherwise make the check fail (a review naming many Secrets) and pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvledger.engine.checkpoint.hub.uri import is_hub_uri

PATH = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
MAX_REVIEWS = 32  # Secrets, ConfigMaps and claims asked about per review (a service names a few)
CONCURRENT_REVIEWS = 8


class Api(Protocol):
    """What the check needs of ``cluster.kube.KubeApi``."""

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Reference:
    """One Secret, ConfigMap or claim a spec has the pods read. ``use`` is what else makes it
    this reference (its key; for the hub token, the model, hub adapters and hub it is sent
    to): an UPDATE that changes it is asked again. ``field`` is where the spec names it (for
    the refusal)."""

    resource: str  # secrets | configmaps | persistentvolumeclaims
    name: str
    use: tuple[Any, ...]
    field: str = field(compare=False)

    @property
    def kind(self) -> str:
        return {"secrets": "Secret", "configmaps": "ConfigMap",
                "persistentvolumeclaims": "PersistentVolumeClaim"}[self.resource]


def references(spec: Any) -> set[Reference]:
    """Every Secret, ConfigMap and claim the spec has its pods read (a part of the wrong
    shape, in an old object stored before the CRD's rules, names none)."""
    spec = spec if isinstance(spec, Mapping) else {}
    model = _mapping(spec.get("model"))
    found: set[Reference] = set()

    def secret_key(ref: Any, where: str, *use: Any) -> None:
        ref = _mapping(ref)
        if isinstance(ref.get("name"), str):
            found.add(Reference("secrets", ref["name"], (where, ref.get("key"), *use), where))

    secret_key(spec.get("apiKeySecretRef"), "spec.apiKeySecretRef")
    secret_key(spec.get("tenantsSecretRef"), "spec.tenantsSecretRef")
    # fetch sends the token for the model and for every hub adapter (spec.adapters).
    hub_adapters = sorted(uri for adapter in _list(spec.get("adapters"))
                          if isinstance(uri := _mapping(adapter).get("uri"), str)
                          and is_hub_uri(uri))
    secret_key(model.get("tokenSecretRef"), "spec.model.tokenSecretRef",
               model.get("uri"), model.get("endpoint"), tuple(hub_adapters))
    for part in ("volume", "cache"):
        where = f"spec.model.{part}.persistentVolumeClaim"
        claim = _mapping(_mapping(model.get(part)).get("persistentVolumeClaim"))
        if isinstance(claim.get("claimName"), str):
            found.add(Reference("persistentvolumeclaims", claim["claimName"], (where,), where))
    for i, pull in enumerate(_list(spec.get("imagePullSecrets"))):
        name = _mapping(pull).get("name")
        if isinstance(name, str):
            found.add(Reference("secrets", name, ("imagePullSecrets",),
                                f"spec.imagePullSecrets[{i}]"))
    for i, var in enumerate(_list(spec.get("env"))):
        ref = _mapping(_mapping(_mapping(var).get("valueFrom")).get("configMapKeyRef"))
        if isinstance(ref.get("name"), str):
            found.add(Reference("configmaps", ref["name"],
                                ("env", _mapping(var).get("name"), ref.get("key")),
                                f"spec.env[{i}].valueFrom.configMapKeyRef"))
    return found


def to_confirm(spec: Any, old_spec: Any | None) -> list[Reference]:
    """What a CREATE (``old_spec`` None) names, or an UPDATE adds or changes, by field."""
    before = references(old_spec) if old_spec is not None else set()
    return sorted(references(spec) - before, key=lambda ref: ref.field)


def access_review(user: Mapping[str, Any], namespace: str, ref: Reference) -> dict[str, Any]:
    """The SubjectAccessReview asking whether ``user`` may get ``ref`` in ``namespace``."""
    spec: dict[str, Any] = {"resourceAttributes": {
        "namespace": namespace, "verb": "get", "version": "v1", "resource": ref.resource,
        "name": ref.name}}
    for key, out in (("username", "user"), ("uid", "uid"), ("groups", "groups"),
                     ("extra", "extra")):
        if user.get(key):
            spec[out] = user[key]
    return {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": spec}


async def refusals(api: Api, user: Mapping[str, Any] | None, namespace: str,
                   refs: list[Reference], within_s: float) -> list[str]:
    """One line per reference ``user`` may not get (none: all confirmed), each naming the
    field; asked at once, within ``within_s``."""
    if not refs:
        return []
    who = (user or {}).get("username") or "the requester"
    distinct = sorted({(ref.resource, ref.name): ref for ref in refs}.values(),
                      key=lambda ref: ref.field)
    if len(distinct) > MAX_REVIEWS:
        return [f"the spec names {len(distinct)} Secrets, ConfigMaps and claims; the webhook "
                f"confirms at most {MAX_REVIEWS} per request that {who} may read them"]
    if not user or not (user.get("username") or user.get("groups")):
        return [f"{ref.field}: the request names no user to ask about" for ref in distinct]
    gate = asyncio.Semaphore(CONCURRENT_REVIEWS)

    async def ask(ref: Reference) -> str | None:
        async with gate:
            answer = await api.create(PATH, access_review(user, namespace, ref))
        return None if _mapping(answer.get("status")).get("allowed") is True else "denied"

    try:
        async with asyncio.timeout(max(0.0, within_s)):
            verdicts = await asyncio.gather(*(ask(ref) for ref in distinct),
                                            return_exceptions=True)
    except TimeoutError:
        verdicts = ["no answer within the webhook's deadline"] * len(distinct)
    said = {(ref.resource, ref.name): verdict for ref, verdict in zip(distinct, verdicts,
                                                                     strict=True)}
    lines = []
    for ref in refs:
        verdict = said[(ref.resource, ref.name)]
        if verdict == "denied":
            lines.append(f"{ref.field} names the {ref.kind} {ref.name}, which {who} may not "
                         f"get in namespace {namespace}: the pods would read it on "
                         f"{who}'s behalf")
        elif verdict is not None:
            why = verdict if isinstance(verdict, str) else (
                str(verdict).splitlines() or [type(verdict).__name__])[0]
            lines.append(f"{ref.field}: cannot confirm that {who} may get the {ref.kind} "
                         f"{ref.name} (SubjectAccessReview: {why})")
    return lines


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
