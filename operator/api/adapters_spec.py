"""``spec.adapters``: the LoRA adapters a service serves, as the engine's ``--lora-modules``.

A hub adapter is downloaded with a hub model into its cache by the fetch init container;
a directory must sit on the model's volume, the pod's only mount for it, so an adapter
path cannot name a file elsewhere in the pod.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any

from kvledger.engine.checkpoint.hub.uri import is_hub_uri
from kvledger.engine.errors import BadInput, plain, shown
from kvledger.engine.settings.lora_config import LoraModule


def parse_adapters(raw: list[Mapping[str, Any]], hub_model: bool,
                   mount_path: str | None) -> tuple[LoraModule, ...]:
    """``spec.adapters`` as ``--lora-modules``: a hub adapter is fetched with a hub model
    into its cache (the fetch init container), a directory is read where the pod sees it:
    ``hub_model`` whether the model comes from the hub, ``mount_path`` its volume's mount."""
    out = []
    for adapter in raw:
        name, uri = adapter.get("name"), adapter.get("uri", "")
        if is_hub_uri(uri) and not hub_model:
            raise BadInput(f"spec.adapters {name}: a hub adapter ({plain(uri)}) is downloaded "
                           "into a hub model's cache (spec.model.uri); with spec.model.path, put "
                           "the adapter on the model's volume and give its directory")
        if not is_hub_uri(uri) and (not uri.startswith("/") or ".." in uri.split("/")):
            raise BadInput(f"spec.adapters {name}: uri must be hf://ORG/NAME[@REVISION] or an "
                           f"absolute directory without '..', got {shown(uri)}")
        path = posixpath.normpath(uri) if uri.startswith("/") else uri
        if path.startswith("/") and mount_path is not None and not _under(path, mount_path):
            raise BadInput(f"spec.adapters {name}: the directory {plain(path)} is not on the "
                           f"model's volume, the pod's only mount for it: put the adapter under "
                           f"{plain(posixpath.normpath(mount_path))}")
        out.append(LoraModule(name, path))
    return tuple(out)


def _under(path: str, mount: str) -> bool:
    mount = posixpath.normpath(mount)
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def hub_adapters(lora_modules: tuple[LoraModule, ...]) -> list[str]:
    """``--lora-modules`` items of the adapters the fetch init container downloads."""
    return [m.as_flag() for m in lora_modules if is_hub_uri(m.path)]
