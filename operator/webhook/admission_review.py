"""The AdmissionReview contract (``admission.k8s.io/v1``), as the webhook's server holds to
it around kopf, which takes a review's body as it comes and answers in kind:

- A body is checked before kopf sees it. One that is not a review (not a JSON object; a
  ``request`` that is not one, with no string ``uid``; an object, its metadata or its
  spec of the wrong type) is ``NotAReview``: a 400 whose text is its one line here, never
  Python's (kopf answered such bodies with a bare 500, or refused them with Python's
  message).
- kopf gets the requester's ``userInfo`` (name, uid, groups, extra: the webhook asks the
  API server what they may read) and only what the handler reads of each object:
  ``apiVersion``, ``kind``, ``metadata``'s ``name``, ``generateName``, ``namespace`` and
  ``deletionTimestamp``, and ``spec``. Not its ``uid``: kopf keeps a memo per UPDATE's object uid for the operator's
  lifetime (50,000 made-up uids kept 59 MiB), and with none it keeps one. Nor its status,
  managed fields or annotations, which kopf would copy and diff.
- The answer is ``admission.k8s.io/v1``'s ``AdmissionReview`` whatever the request named
  (kopf echoed it), with the request's uid, ``allowed``, a refusal's status, the warnings.
  Only a verdict refuses (403 or 422): a refusal kopf makes of a fault in the handler
  (code 500, Python's words) is answered as a fault is, allowed with a warning, as
  ``failurePolicy: Ignore`` lets the resource in when the webhook cannot be reached.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"
VERDICT_CODES = frozenset({403, 422})  # the handler's refusals: the spec's, the fit's
META_FIELDS = ("name", "generateName", "namespace", "deletionTimestamp")


class NotAReview(Exception):
    """The body is not an AdmissionReview this webhook answers; the message says why."""


def for_kopf(body: Any) -> tuple[str, str, dict[str, Any]]:
    """``(uid, the object's name, the review kopf gets)``; NotAReview when it is not one."""
    if not isinstance(body, dict):
        raise NotAReview("not an AdmissionReview: the body is not a JSON object")
    request = body.get("request")
    if not isinstance(request, dict):
        raise NotAReview("not an AdmissionReview: request is not an object")
    uid = request.get("uid")
    if not isinstance(uid, str):
        raise NotAReview("not an AdmissionReview: request.uid is not a string")
    operation = request.get("operation")
    if not isinstance(operation, str):
        raise NotAReview("not an AdmissionReview: request.operation is not a string")
    resource = request.get("resource")
    if not isinstance(resource, dict) or not all(
            isinstance(resource.get(k), str) for k in ("group", "version", "resource")):
        raise NotAReview("not an AdmissionReview: request.resource is not a group, version "
                         "and resource")
    user = request.get("userInfo")
    if not isinstance(user, dict):
        raise NotAReview("not an AdmissionReview: request.userInfo is not an object")
    objects = {key: _object(request.get(key), key) for key in ("object", "oldObject")}
    if objects["object"] is None and objects["oldObject"] is None:
        raise NotAReview("not an AdmissionReview: request.object is missing")
    sub = request.get("subResource")
    review = {"apiVersion": API_VERSION, "kind": KIND, "request": {
        "uid": uid, "operation": operation, "dryRun": request.get("dryRun") is True,
        "resource": {k: resource[k] for k in ("group", "version", "resource")},
        "subResource": sub if isinstance(sub, str) else None,
        "userInfo": _user(user),
        **objects}}
    meta = (objects["object"] or objects["oldObject"])["metadata"]
    name = meta.get("name") or f"{meta.get('generateName', '')}<generated>"
    return uid, name, review


def _user(user: dict[str, Any]) -> dict[str, Any]:
    """Who asked, as the API server's authorizer knows them (the webhook asks it whether
    they may read what the spec names): the name and uid, the groups and the extra, each
    kept only when of its type."""
    out: dict[str, Any] = {key: user[key] for key in ("username", "uid")
                           if isinstance(user.get(key), str)}
    out.setdefault("username", "")
    groups = user.get("groups")
    if isinstance(groups, list) and all(isinstance(g, str) for g in groups):
        out["groups"] = groups
    extra = user.get("extra")
    if isinstance(extra, dict) and all(
            isinstance(values, list) and all(isinstance(v, str) for v in values)
            for values in extra.values()):
        out["extra"] = extra
    return out


def _object(obj: Any, key: str) -> dict[str, Any] | None:
    """What the handler reads of an object; NotAReview when a part has the wrong type."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise NotAReview(f"not an AdmissionReview: request.{key} is not an object")
    meta = obj.get("metadata") or {}
    if not isinstance(meta, dict) or not all(
            isinstance(meta.get(f), str) for f in META_FIELDS if meta.get(f) is not None):
        raise NotAReview(f"not an AdmissionReview: request.{key}.metadata is not an object "
                         "of strings")
    spec = obj.get("spec")
    if spec is not None and not isinstance(spec, dict):
        raise NotAReview(f"not an AdmissionReview: request.{key}.spec is not an object")
    kept = {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
            "metadata": {f: meta[f] for f in META_FIELDS if meta.get(f) is not None}}
    return kept | ({"spec": spec} if spec is not None else {})


def answer(uid: str, name: str, kopf_response: Any) -> tuple[dict[str, Any], str | None]:
    """The AdmissionReview answering ``uid`` from kopf's response, and the fault to log
    (kopf's refusal of a handler's error) when there was one."""
    payload = kopf_response.get("response") if isinstance(kopf_response, Mapping) else None
    payload = payload if isinstance(payload, Mapping) else {}
    warnings = [w for w in payload.get("warnings") or () if isinstance(w, str)]
    status = payload.get("status") if isinstance(payload.get("status"), Mapping) else {}
    if payload.get("allowed") is True:
        return review(uid, True, warnings=warnings), None
    if status.get("code") in VERDICT_CODES:
        return review(uid, False, warnings=warnings, status={
            "code": status["code"], "message": str(status.get("message") or "")}), None
    return fault(uid, name, "a fault of its own"), str(status.get("message") or payload)


def fault(uid: str, name: str, why: str) -> dict[str, Any]:
    """Allowed, with a warning: what the webhook could not judge, the pre-flight does."""
    return review(uid, True, warnings=[f"the webhook could not judge {name} ({why}): the "
                                       "pod's pre-flight checks the fit"])


def review(uid: str, allowed: bool, *, warnings: list[str] | None = None,
           status: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if status is not None:
        response["status"] = status
    if warnings:
        response["warnings"] = warnings
    return {"apiVersion": API_VERSION, "kind": KIND, "response": response}
