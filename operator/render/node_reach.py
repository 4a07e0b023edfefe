"""What a spec asks of the nodes its pods run on, as the cluster admin's policy
(``policy.py``) judges it: the image it runs (a repository with any tag or digest, or
every image under a listed prefix), the host folders it mounts (under a listed folder,
after normalising ``..``), and whether it lands on control-plane nodes (a node selector,
toleration or node-affinity term of theirs, or a toleration of every taint).
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from typing import Any

from kvledger.operator.api.spec import ServiceSpec

CONTROL_PLANE_KEYS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")


def repository(image: str) -> str:
    """``image`` without its tag or digest."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name


def image_allowed(image: str, allowed: Sequence[str]) -> bool:
    """An entry allows its repository with any tag or digest, or, ending in '/', every
    image under it."""
    return any(image.startswith(entry) if entry.endswith("/") else repository(image) == entry
               for entry in allowed)


def listed_images(images: Sequence[str], default_image: str) -> str:
    return ", ".join(dict.fromkeys((repository(default_image), *images)))


def under(path: str, folder: str) -> bool:
    path = posixpath.normpath(path)
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def control_plane_field(spec: ServiceSpec) -> str | None:
    """The field that puts the pods on control-plane nodes, if one does."""
    selector = spec.pod_fields.get("nodeSelector") or {}
    if any(key in CONTROL_PLANE_KEYS for key in selector):
        return "spec.nodeSelector"
    for toleration in spec.tolerations or []:
        key = toleration.get("key") or ""
        if key in CONTROL_PLANE_KEYS or (not key and toleration.get("operator") == "Exists"):
            return "spec.tolerations"
    node = (spec.pod_fields.get("affinity") or {}).get("nodeAffinity") or {}
    if any(e.get("key") in CONTROL_PLANE_KEYS and e.get("operator") in ("In", "Exists")
           for e in _match_expressions(node)):
        return "spec.affinity.nodeAffinity"
    return None


def _match_expressions(node: Any) -> list[dict[str, Any]]:
    """Every ``matchExpressions`` item under a nodeAffinity, required and preferred (a
    walk with a stack of its own: however deep the object, no recursion limit)."""
    found: list[dict[str, Any]] = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key == "matchExpressions" and isinstance(value, list):
                    found += [e for e in value if isinstance(e, dict)]
                else:
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)
    return found
