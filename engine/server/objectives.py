"""A gateway's objectives (``--objective-header``, ``--objectives-file``): the priority
of a request the Gateway API Inference Extension's router classified.

A client behind an InferencePool names an ``InferenceObjective`` in the header
``x-gateway-inference-objective``; the objective's ``spec.priority`` says how urgent its
requests are (higher is more urgent, unset is 0). The operator writes the objectives of
the service's pool into a mounted ConfigMap; the kubelet rewrites the file in place when
one changes, and it is read again every ``POLL_S`` without a restart:

    objectives:
      - name: critical
        priority: 10       # the InferenceObjective's: higher is more urgent
      - name: batch
        priority: -10

The header is believed only from ``--tenant-header-from``'s peers (the gateway's), once
(given twice: a 400, as the tenant header). Its priority is the request's, in this
server's order (lower is sooner, as vLLM's ``priority``: the objective's negated), when the
request's body asks none, and only under ``--scheduling-policy priority``. It is held to
the floor the tenants file gives the request's tenant (``Tenants.held``), so an objective
any client may name is never a way around a tier. A name the file does not hold is no
objective: the tenant's default, as the router uses priority 0 for one it does not know.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvledger.engine.errors import BadInput
from kvledger.engine.frontend.submission import Tenant
from kvledger.engine.server.tenants import Tenants, one_value

log = logging.getLogger(__name__)
POLL_S = 1.0
MAX_FILE_BYTES = 1 << 20  # a namespace's objectives: far fewer
MAX_NAME_CHARS = 253      # a Kubernetes object's name
INT32 = 2**31


def parse_objectives(text: str, where: str) -> dict[str, int]:
    """Each objective's name -> its priority (the InferenceObjective's sign), from the
    file's YAML (or JSON); BadInput naming ``where`` and the entry on anything else. An
    empty file holds none."""
    import yaml

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise BadInput(f"{where}: not YAML ({str(exc).splitlines()[0]})") from None
    if raw is None:
        return {}
    entries = raw.get("objectives") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or set(raw) != {"objectives"}:
        raise BadInput(f"{where}: expected 'objectives:' and a list of objectives")
    priorities: dict[str, int] = {}
    for i, entry in enumerate(entries):
        name, priority = _entry(f"{where}: objective {i}", entry)
        if name in priorities:
            raise BadInput(f"{where}: objective {name!r} is listed twice")
        priorities[name] = priority
    return priorities


def _entry(where: str, entry: Any) -> tuple[str, int]:
    if not isinstance(entry, dict) or not set(entry) <= {"name", "priority"}:
        raise BadInput(f"{where}: expected a mapping of name and priority")
    name, priority = entry.get("name"), entry.get("priority", 0)
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise BadInput(f"{where}: name must be 1-{MAX_NAME_CHARS} characters, got {name!r}")
    if isinstance(priority, bool) or not isinstance(priority, int) or not (
            -INT32 <= priority < INT32):
        raise BadInput(f"{where} ({name}): priority must be a 32-bit integer, got {priority!r}")
    return name, priority


class Objectives:
    """The header's objectives, as the file says now."""

    def __init__(self, header: str | None, path: str | None, tenants: Tenants) -> None:
        if (header is None) != (path is None):
            raise BadInput("--objective-header and --objectives-file go together")
        if header is not None and tenants.header is None:
            raise BadInput("--objective-header needs --tenant-header and --tenant-header-from "
                           "(the gateway's addresses): a header anyone may send sets no "
                           "priority")
        self.header = header.lower() if header else None
        self.path = None if path is None else Path(path)
        self.tenants = tenants
        self.priorities: dict[str, int] = {}
        self._seen: bytes | None = None

    def priority(self, headers: Mapping[str, str], peer: str | None,
                 tenant: Tenant) -> int | None:
        """The request's priority in this server's order from the objective its trusted
        gateway named (held to ``tenant``'s floor), or None: no header, an untrusted
        peer, an objective the file does not hold. BadInput for a header given twice."""
        if self.header is None or not self.tenants.trusts(peer):
            return None
        name = one_value(headers, self.header, "objective")
        if name not in self.priorities:
            return None
        return self.tenants.held(tenant, -self.priorities[name])

    def reload(self) -> bool:
        """Read the file again if its bytes changed: True when they did. An unreadable or
        invalid file is logged and the objectives held before stay (a half-written
        ConfigMap never drops them); an absent one (not mounted yet) holds none."""
        assert self.path is not None
        try:
            with self.path.open("rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            data = b""
        except OSError as exc:
            log.warning("%s: cannot read it (%s); the objectives stay as they were",
                        self.path, exc)
            return False
        if data == self._seen:
            return False
        self._seen = data
        try:
            if len(data) > MAX_FILE_BYTES:
                raise BadInput(f"{self.path}: larger than {MAX_FILE_BYTES} bytes")
            priorities = parse_objectives(data.decode("utf-8"), str(self.path))
        except (BadInput, UnicodeDecodeError) as exc:
            log.warning("%s; the objectives stay as they were", exc)
            return False
        if priorities != self.priorities:
            log.info("objectives from %s: %s", self.path,
                     ", ".join(f"{name} {p}" for name, p in sorted(priorities.items()))
                     or "none")
        self.priorities = priorities
        return True

    async def follow(self, poll_s: float = POLL_S) -> None:
        """Reload the file every ``poll_s`` until cancelled."""
        while True:
            self.reload()
            await asyncio.sleep(poll_s)
