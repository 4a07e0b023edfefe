"""The order of a line: who is granted next among those waiting. Every place a request
waits keeps one: the admission line (for KV blocks) and the engine's line for a seat
(``max_num_seqs``, and the adapter slots, ``core/scheduler.py``); the step's prompt
tokens are shared by the same weights (``core/prompt_budget.py``).

Three keys, in turn:

1. **Priority** (``--scheduling-policy priority``): a lower ``priority`` goes first, as in
   vLLM. Under ``fcfs`` every request counts as priority 0.
2. **Fair share between tenants** (on unless ``--no-tenant-fairness``): start-time fair
   queuing, counted in tokens. Each waiter gets a start tag when it joins: its tenant's
   last finish tag, or the line's virtual clock if that is later (an idle tenant saves up
   no credit), and its tenant's finish tag moves on by its tokens (prompt + output cap, for
   each choice) over its tenant's ``weight``. The clock is the tag of the last waiter
   granted (or of a request granted without waiting: it is counted all the same). So a
   tenant that floods the line holds tags 0, c, 2c, ... and another tenant's request,
   arriving when the clock reads ``v``, is tagged ``v``: it is next but for the one
   already at ``v``, whatever the flood's length. While both wait, tenants are granted
   tokens in proportion to their weights: one whose requests are ten times larger is
   granted a tenth as many.
3. **Arrival**: first come, first served.

With one tenant and one priority the line is FIFO. The line only orders; its owner
decides whether the first in order fits (nobody overtakes it, but with ``--backfill``).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config_values import POLICIES

# The label of a tenant a trusted gateway's header names but --tenants-file does not list.
OTHER = "other"


@dataclass(frozen=True)
class Tenant:
    """Who a request is for, as the line shares it out: ``key`` keys the line (never shown),
    ``label`` names it in metrics (bounded: a configured name or a key's index),
    ``weight`` its share while others wait, ``max_queued`` the places in line it may hold
    (None: any the line has), ``priority`` its requests' when they ask none and
    ``min_priority`` the most urgent they may ask (None: any), under
    ``--scheduling-policy priority``."""

    key: str
    label: str
    weight: float = 1.0
    max_queued: int | None = None
    priority: int = 0
    min_priority: int | None = None

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"tenant {self.label!r}: weight must be > 0, got {self.weight!r}")
        if self.max_queued is not None and self.max_queued < 0:
            raise ValueError(f"tenant {self.label!r}: max_queued must be >= 0")

    def priority_for(self, asked: int | None) -> int:
        """The priority its request runs at: the one it ``asked`` (None: the tenant's
        default); BadInput when more urgent than the tenant may ask."""
        if asked is None:
            return self.priority
        if self.min_priority is not None and asked < self.min_priority:
            who = ("a tenant --tenants-file does not list" if self.label == OTHER
                   else f"tenant {self.label}")
            raise BadInput(f"priority {asked} is more urgent than {who} may ask (at least "
                           f"{self.min_priority})", "priority")
        return asked


def run_priority(policy: str, tenant: Tenant, asked: int | None,
                 objective: int | None = None) -> int:
    """The one rule of a request's priority: it orders the line and the seats under
    ``--scheduling-policy priority`` only: the one ``asked`` (``Tenant.priority_for``),
    else the gateway's ``objective`` (an InferenceObjective's, in this order and already
    held to the tenant's floor: ``server/objectives.py``), else the tenant's default.
    Under fcfs it is 0, the objective is not used, and a non-zero one asked is BadInput,
    as vLLM documents, never silently dropped."""
    if policy == "priority":
        if asked is None and objective is not None:
            return objective
        return tenant.priority_for(asked)
    if asked:
        raise BadInput(f"priority {asked} needs --scheduling-policy priority (this "
                       f"server's is {policy})", "priority")
    return 0


ANONYMOUS = Tenant("", "anonymous")


@dataclass
class Place:
    """A waiter's place: the sort key the line keeps it by."""

    priority: int
    tag: float
    arrival: int

    def key(self) -> tuple[int, float, int]:
        return self.priority, self.tag, self.arrival


class LineOrder:
    """The waiters of a line, in grant order (priority, fair tag, arrival)."""

    def __init__(self, *, policy: str = "fcfs", fair: bool = True) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, "
                             f"got {policy!r}")
        self.policy = policy
        self.fair = fair
        self._entries: list[tuple[tuple[int, float, int], object]] = []
        self._arrivals = itertools.count()
        self._clock = 0.0                     # the start tag of the last waiter granted
        self._finish: dict[str, float] = {}   # each tenant's last finish tag
        self._queued: dict[str, int] = {}     # each tenant's places in line
        self._labels: dict[str, str] = {}     # the label of each tenant in line

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator:
        """The waiters in grant order."""
        return (waiter for _, waiter in self._entries)

    def queued(self, tenant: Tenant) -> int:
        return self._queued.get(tenant.key, 0)

    def queued_by_label(self) -> dict[str, int]:
        """Places in line by tenant label (tenants sharing a label summed)."""
        counts: dict[str, int] = {}
        for key, count in list(self._queued.items()):  # read from another thread too
            label = self._labels.get(key)
            if label is not None:  # None: it left meanwhile
                counts[label] = counts.get(label, 0) + count
        return counts

    def clear(self) -> None:
        """Forget every waiter and every tenant's share (the engine aborting all)."""
        self._entries.clear()
        self._queued.clear()
        self._labels.clear()
        self._finish.clear()

    def place_for(self, tenant: Tenant, priority: int) -> Place:
        """Where a request of ``tenant`` at ``priority`` would go, were it to join now
        (nothing changes): for a refusal's wait, which counts those ahead of it."""
        tag = max(self._clock, self._finish.get(tenant.key, 0.0)) if self.fair else 0.0
        return Place(priority if self.policy == "priority" else 0, tag, -1)

    def ahead_of(self, place: Place) -> Iterator:
        """The waiters granted before a request at ``place`` (``place_for``)."""
        key = place.key()
        for entry_key, waiter in self._entries:
            if entry_key[:2] > key[:2]:
                return
            yield waiter

    def join(self, waiter, tenant: Tenant, priority: int, tokens: int = 1) -> Place:
        """Add ``waiter``, of ``tokens`` (what it is granted: prompt + cap, each choice's), at
        its place (which it keeps until it leaves)."""
        place = self.place_for(tenant, priority)
        place.arrival = next(self._arrivals)
        if self.fair:
            self._finish[tenant.key] = place.tag + tokens / tenant.weight
        self._queued[tenant.key] = self._queued.get(tenant.key, 0) + 1
        self._labels[tenant.key] = tenant.label
        bisect.insort(self._entries, (place.key(), waiter), key=lambda entry: entry[0])
        return place

    def leave(self, waiter, tenant: Tenant, place: Place, *, granted: bool) -> None:
        """Take ``waiter`` out (granted, or gone); a grant moves the virtual clock to its
        tag, and tenants whose tags it passed are forgotten (an idle tenant's tag is the
        clock's)."""
        key = place.key()
        index = bisect.bisect_left(self._entries, key, key=lambda entry: entry[0])
        if index == len(self._entries) or self._entries[index][1] is not waiter:
            raise ValueError("not in line")
        del self._entries[index]
        left = self._queued[tenant.key] - 1
        if left:
            self._queued[tenant.key] = left
        else:
            del self._queued[tenant.key]
            del self._labels[tenant.key]
        if granted:
            self._advance(place.tag)

    def served(self, tenant: Tenant, priority: int, tokens: int) -> None:
        """A request of ``tenant`` granted without waiting (nobody was in line): its tokens
        count against its tenant's share as if it had waited."""
        if self.fair:
            tag = self.place_for(tenant, priority).tag
            self._finish[tenant.key] = tag + tokens / tenant.weight
            self._advance(tag)

    def _advance(self, tag: float) -> None:
        """The clock moves to ``tag`` if later; tenants whose tags it passed are forgotten
        (an idle tenant's tag is the clock's)."""
        if tag > self._clock:
            self._clock = tag
            self._finish = {k: t for k, t in self._finish.items()
                            if t > self._clock or k in self._queued}
