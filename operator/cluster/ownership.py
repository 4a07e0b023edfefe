"""Which objects of a namespace are a resource's own: the only ones the operator changes or
deletes for it.

A resource's children are named after it (the Deployment, the Service, the NetworkPolicy,
the PodDisruptionBudget, ... are ``NAME``), so whoever may create an InferenceService
chooses those names. Were an existing object of that name applied over or deleted, the
operator's rights would become the author's: an InferenceService named as another team's
Service took that Service over (its selector then matched the author's pods only, its
ports replaced, its owner the author's resource), and one named as a NetworkPolicy or a
PodDisruptionBudget deleted it (each reconcile deletes the optional children the spec does
not want; the resource's deletion deletes every kind of child). So an object is the
resource's only where its ``ownerReferences`` name the resource's ``uid`` (``children.py``
writes that on every child): another is left as it is, and the resource says why
(``ChildTaken``). A deletion names the object's own ``uid`` as a precondition, so an
object made again under that name between the read and the delete is not the one deleted.
"""

from __future__ import annotations

from typing import Any, Protocol

Body = dict[str, Any]


class ChildTaken(Exception):
    """An object with a child's name exists and is not the resource's (one line): nothing
    is applied to it; the resource is ``Ready=False`` with ``reason``, asked again (the
    other object may be removed or renamed meanwhile)."""

    reason = "ChildNotOwned"
    refused = True  # as ``KubeError.refused``: a retry alone does not pass


class _Deleter(Protocol):
    """What ``delete_owned`` needs of ``kube.KubeApi``."""

    async def get(self, path: str) -> Body | None: ...

    async def delete(self, path: str, *, uid: str | None = None) -> bool: ...


def owner_uid(body: Body) -> str | None:
    """The uid of the controller that ``body``'s ``ownerReferences`` name, if any."""
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, dict) and ref.get("controller") and isinstance(ref.get("uid"), str):
            return ref["uid"]
    return None


def owned_by(live: Any, uid: str) -> bool:
    """Whether the object ``live`` names ``uid`` among its owners."""
    refs = (live.get("metadata") or {}).get("ownerReferences") if isinstance(live, dict) else None
    return any(isinstance(ref, dict) and ref.get("uid") == uid for ref in refs or [])


def require_same_owner(live: Body, desired: Body) -> None:
    """ChildTaken when ``desired`` (a child, its owner named) would be applied over an
    object of its name that its owner does not own."""
    uid = owner_uid(desired)
    if uid is None or owned_by(live, uid):
        return
    meta = desired.get("metadata") or {}
    owner = next(ref for ref in meta.get("ownerReferences") or [] if ref.get("uid") == uid)
    kind = desired.get("kind", "object")
    raise ChildTaken(
        f"{kind} {meta.get('name')} exists and is not this {owner.get('kind', 'owner')}'s "
        f"(its ownerReferences do not name it): the operator neither takes it over nor "
        f"deletes it; rename the {owner.get('kind', 'owner')}, or have the {kind} removed")


async def delete_owned(kube: _Deleter, path: str, uid: str) -> bool:
    """Delete the object at ``path`` if it is owned by ``uid`` (True if it was deleted);
    one that is not, or is gone, is left (False)."""
    live = await kube.get(path)
    if live is None or not owned_by(live, uid):
        return False
    return await kube.delete(path, uid=(live.get("metadata") or {}).get("uid"))
