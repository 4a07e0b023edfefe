"""Who a request is for: its tenant, as the admission line shares it out and the metrics
count it (``admission/order.py``'s ``Tenant``).

A tenant is the API key a request came with. ``--tenants-file`` (a mounted Secret: the
keys are in it) groups keys under a name and gives each group a weight, its places in
line and the priorities its requests may ask:

    tenants:
      - name: team-a          # its metrics label: [a-z0-9_-], at most 63 characters
        keys: [sk-a1, sk-a2]  # each opens /v1/*, as --api-key's do
        weight: 2             # its turns while others wait (default 1)
        maxQueued: 64         # its places in line (default: --max-queue-len-per-tenant's)
        priority: 5           # its requests' priority when they send none (default 0)
        minPriority: 5        # the most urgent they may ask (default: its priority)

A key of ``--api-key`` that no tenant lists is a tenant of its own, labelled by its index
(``key-2``: the key itself is never shown), so no file tenant may be named ``key-N``. A
gateway may name the tenant instead, in a header (``--tenant-header x-kvledger-tenant``),
believed only from the peers listed in ``--tenant-header-from`` (CIDRs), once: a request
that carries it twice (a gateway that added its header after the client's) or a list of
names is refused, naming the header. Names are matched without regard to case. A name the
file holds is that tenant; any other is a tenant of its own in the line, counted under the
label ``other`` (bounded metrics), and held to the least urgent tier the file gives (no
more urgent than any listed tenant may ask), so a name nobody configured is never a way
around a floor. Without keys or header everyone is one tenant, ``anonymous``; with a file,
held to that same least urgent tier (leaving the header out is no way around a floor).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvledger.engine.errors import BadInput
from kvledger.engine.frontend.submission import ANONYMOUS, OTHER, Tenant

_NAME = re.compile(r"^[a-z0-9_-]{1,63}$")
_KEY_LABEL = re.compile(r"^key-[0-9]+$")  # what an --api-key key outside the file is shown as
_FIELDS = {"name", "keys", "weight", "maxQueued", "priority", "minPriority"}
MAX_HEADER_TENANT_CHARS = 128


@dataclass(frozen=True)
class TenantSpec:
    """One tenant of ``--tenants-file``."""

    name: str
    keys: tuple[str, ...] = ()
    weight: float = 1.0
    max_queued: int | None = None
    priority: int = 0
    min_priority: int | None = None  # None: its ``priority``


def read_tenants_file(path: str | Path) -> tuple[TenantSpec, ...]:
    """The tenants of a YAML (or JSON) file; BadInput, naming the file and the entry, on
    anything else."""
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise BadInput(f"--tenants-file {path}: cannot read it ({exc})") from None
    entries = raw.get("tenants") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not entries:
        raise BadInput(f"--tenants-file {path}: expected 'tenants:' and a list of tenants")
    return tuple(_spec(f"--tenants-file {path}: tenant {i}", entry)
                 for i, entry in enumerate(entries))


def _spec(where: str, entry: Any) -> TenantSpec:
    if not isinstance(entry, dict):
        raise BadInput(f"{where}: expected a mapping")
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise BadInput(f"{where}: unknown field {unknown[0]!r} (known: "
                       f"{', '.join(sorted(_FIELDS))})")
    name = entry.get("name")
    if (not isinstance(name, str) or not _NAME.match(name) or name in (OTHER, ANONYMOUS.label)
            or _KEY_LABEL.match(name)):
        raise BadInput(f"{where}: name must be 1-63 of [a-z0-9_-], not 'other', 'anonymous' "
                       f"or key-N (the names of the server's own labels: key-N is an "
                       f"--api-key key's), got {name!r}")
    keys = entry.get("keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) and k.strip() for k in keys):
        raise BadInput(f"{where} ({name}): keys must be a list of non-empty strings")
    weight = entry.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= 1000:
        raise BadInput(f"{where} ({name}): weight must be a number in (0, 1000], got {weight!r}")
    integers = {}
    for field in ("maxQueued", "priority", "minPriority"):
        value = entry.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or abs(value) > 2**31 or (field == "maxQueued" and value < 0)):
            raise BadInput(f"{where} ({name}): {field} must be an integer"
                           f"{' >= 0' if field == 'maxQueued' else ''}, got {value!r}")
        integers[field] = value
    priority = integers["priority"] or 0
    min_priority = integers["minPriority"]
    if min_priority is not None and min_priority > priority:
        raise BadInput(f"{where} ({name}): minPriority {min_priority} is above its priority "
                       f"{priority}: its own requests could not be sent")
    return TenantSpec(name, tuple(k.strip() for k in keys), float(weight),
                      integers["maxQueued"], priority, min_priority)


class Tenants:
    """The server's tenants: which one a request is for, and every label the metrics may
    show (the file's names, ``key-N``, ``other``, ``anonymous``)."""

    def __init__(self, api_keys: Sequence[str], specs: Sequence[TenantSpec] = (), *,
                 max_queue_len: int, max_queued: int | None = None,
                 header: str | None = None, header_from: Sequence[str] = ()) -> None:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise BadInput("--tenants-file: two tenants share a name")
        owner: dict[str, TenantSpec] = {}
        for spec in specs:
            for key in spec.keys:
                if key in owner:
                    raise BadInput(f"--tenants-file: a key of {spec.name} is also "
                                   f"{owner[key].name}'s")
                owner[key] = spec
        # Every key, --api-key's first: a request's key index is its place here.
        self.keys: tuple[str, ...] = tuple(dict.fromkeys([*api_keys, *owner]))
        if max_queued is None and (len(self.keys) > 1 or header is not None):
            max_queued = max(1, max_queue_len // 2)  # one key's flood leaves half the line
        self._default_queued = max_queued
        self._by_name = {spec.name: self._tenant(spec) for spec in specs}
        self._by_index = [self._by_name[owner[key].name] if key in owner
                          else Tenant(f"key:{i}", f"key-{i}", max_queued=max_queued)
                          for i, key in enumerate(self.keys)]
        self.header = header.lower() if header else None
        try:
            self._trusted = tuple(ipaddress.ip_network(cidr, strict=False)
                                  for cidr in header_from)
        except ValueError as exc:
            raise BadInput(f"--tenant-header-from: {exc}") from None
        if header is not None and not self._trusted:
            raise BadInput("--tenant-header needs --tenant-header-from (the gateway's "
                           "addresses): a header anyone may send names no tenant")
        self._tiered = bool(specs)  # the file gives floors an objective is held to
        # A header's name the file does not hold: the least urgent tier the file gives.
        self._unlisted = (max([0, *(spec.priority for spec in specs)]),
                          max([0, *(_floor(spec) for spec in specs)]))
        # A request that names no tenant at all (no key, no header): with the file's tiers,
        # held to that same tier, or leaving the header out would be a way around a floor.
        tier = {"priority": self._unlisted[0], "min_priority": self._unlisted[1]} if specs else {}
        self._anonymous = Tenant(ANONYMOUS.key, ANONYMOUS.label, max_queued=max_queued, **tier)

    def _tenant(self, spec: TenantSpec) -> Tenant:
        max_queued = spec.max_queued if spec.max_queued is not None else self._default_queued
        return Tenant(f"name:{spec.name}", spec.name, spec.weight, max_queued, spec.priority,
                      _floor(spec))

    @property
    def labels(self) -> list[str]:
        """Every label a tenant metric may carry (bounded by the configuration)."""
        labels = [ANONYMOUS.label, *dict.fromkeys(t.label for t in self._by_index),
                  *self._by_name]
        if self.header is not None:
            labels.append(OTHER)
        return list(dict.fromkeys(labels))

    def of(self, key_index: int | None, headers: Mapping[str, str],
           peer: str | None) -> Tenant:
        """The tenant of a request: the header's, from a trusted peer, else its key's
        (``key_index``: the index of the key it came with, None without one), else the
        anonymous one. BadInput for a header value that is too long, or a header given
        more than once."""
        if self.header is not None and self.trusts(peer):
            named = one_value(headers, self.header).lower()
            if named:
                if len(named) > MAX_HEADER_TENANT_CHARS:
                    raise BadInput(f"{self.header} is longer than {MAX_HEADER_TENANT_CHARS} "
                                   f"characters")
                return self._by_name.get(named) or Tenant(
                    f"header:{named}", OTHER, max_queued=self._default_queued,
                    priority=self._unlisted[0], min_priority=self._unlisted[1])
        if key_index is not None:
            return self._by_index[key_index]
        return self._anonymous

    def held(self, tenant: Tenant, priority: int) -> int:
        """A gateway objective's ``priority`` (this server's order) for ``tenant``'s
        request: no more urgent than the floor the tenants file gives it. Without a file
        there are no tiers to guard, and the objective's priority stands."""
        if self._tiered and tenant.min_priority is not None:
            return max(priority, tenant.min_priority)
        return priority

    def trusts(self, peer: str | None) -> bool:
        """Whether ``peer`` is one of ``--tenant-header-from``'s (a gateway's address)."""
        if peer is None:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:  # a Unix socket's peer, or none
            return False
        return any(address in network for network in self._trusted)


def _floor(spec: TenantSpec) -> int:
    """The most urgent priority a file tenant's requests may ask (its own, by default)."""
    return spec.priority if spec.min_priority is None else spec.min_priority


def one_value(headers: Mapping[str, str], name: str, what: str = "tenant") -> str:
    """The one value of the header ``name`` ('' when absent). BadInput naming it when the
    request carries it more than once, or one value lists several (a proxy joins repeated
    headers with commas): a gateway that adds its header after the client's own would
    otherwise let the client's win."""
    getall = getattr(headers, "getall", None)
    values = getall(name, []) if getall is not None else ([headers[name]] if name in headers
                                                           else [])
    if len(values) > 1 or (values and "," in values[0]):
        raise BadInput(f"{name} is given more than once: a request names one {what} (the "
                       f"gateway must replace a client's {name}, not add to it)")
    return values[0].strip() if values else ""
