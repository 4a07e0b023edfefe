"""What the operator reads of hub models: the webhook's headers (config.json and the
safetensors headers, as the pre-flight reads them) and a pod cache's download size, within
a budget the operator process can afford, whatever a repo claims.

A review may cost the operator no more than this, however many are sent and whatever
repos they name:

- one read: ``OPERATOR_LIMITS`` (16 MiB of config, index and headers, 65,536 tensors, the
  engine's 1,024 shards), tighter than the pre-flight's own (``read_limits``): the
  published models the engine runs are inside (Llama-3.1-405B 0.22 MiB, Qwen3-235B-A22B
  7.6 MiB and 36,944 tensors, Qwen3-Coder-480B-A35B in FP8 12.9 MiB and 60,328), but for
  Qwen3-235B-A22B in FP8 (73,416 tensors: tests/planner/test_read_limits.py); one past
  them is allowed with a warning naming the limit, and its pod's pre-flight decides;
- reads at once: ``HUB_THREADS``, with ``HUB_WAITING`` more queued; past those a review is
  answered with a warning at once, its model unread. The reconcile's download sizing has
  threads of its own (``SIZING_THREADS``), so reviews never hold it up. The headers go to disk as they
  arrive; they are parsed one model at a time (``_PARSING``), so the records being built
  are one model's at most;
- what is kept: the models read, by endpoint and uri (a commit for as long as it is asked
  for, a branch or tag for ten minutes), while their tensors come to ``CACHED_TENSORS``
  at most, the least recently asked for dropped first;
- what is alive: the models kept and those read and still being judged (a review waiting
  for the planner holds its model) come to ``LIVE_TENSORS`` at most: a read waits for room
  before it parses (``_LIVE``), and gives up at its deadline.

So the hub models cost the operator the records of one model past those it keeps, and one
parse at a time: 6 repos of 64,893 tensors at once grew it by under 100 MiB
(bench/hostile_cluster.py).

Its threads are ``workers.Workers``: daemons, so SIGTERM does not wait for a hub.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvledger.engine.checkpoint.contents import ModelShape, ModelSource, WeightsInfo
from kvledger.engine.checkpoint.hub.headers import header_mirror
from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.checkpoint.read_limits import MiB, OverLimit, ReadLimits
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.plan import read_checkpoint
from kvledger.operator.cluster.workers import Busy, Workers

OPERATOR_LIMITS = ReadLimits(model_bytes=16 * MiB, tensors=65_536, whose="the operator")
HUB_THREADS = 4
HUB_WAITING = 16
SIZING_THREADS = 2  # the reconcile's download sizes (a listing and an index each)
SIZING_WAITING = 64
CACHED_MODELS = 64
# What the kept models' records may come to (~300 bytes a tensor: ~20 MiB).
CACHED_TENSORS = 65_536
# What the records of every model alive may come to: kept, or read and still being judged
# (a review waiting for the planner holds its model). A read waits for room for the most
# one read may take before it parses: one model past the kept ones, at most.
LIVE_TENSORS = CACHED_TENSORS + OPERATOR_LIMITS.tensors
BRANCH_TTL_S = 600.0
_COMMIT = re.compile(r"@[0-9a-f]{40}$")
# One model's records built at a time: reads download at once, parse in turn.
_PARSING = threading.Lock()

log = logging.getLogger(__name__)


class _LiveRecords:
    """The tensors' records of the models alive, counted: a model's count is given back
    when its ``WeightsInfo`` is freed (the last verdict or plan holding it is done, and the
    cache dropped it)."""

    def __init__(self, budget: int) -> None:
        self.budget, self.live = budget, 0
        self._room = threading.Condition()

    def reserve(self, count: int, within_s: float) -> None:
        """Room for ``count`` more; HubUnavailable when none comes within ``within_s``."""
        with self._room:
            if not self._room.wait_for(lambda: self.live + count <= self.budget, within_s):
                raise HubUnavailable(f"the operator holds as many models as it may now ("
                                     f"{self.live:,} tensors' records, of {self.budget:,})")
            self.live += count

    def give_back(self, count: int) -> None:
        with self._room:
            self.live -= count
            self._room.notify_all()

    def track(self, weights: WeightsInfo, reserved: int) -> None:
        """``weights`` holds its records now (its reservation trimmed to them) until freed."""
        held = weights.num_tensors + len(weights.skipped)
        self.give_back(reserved - held)
        weakref.finalize(weights, self.give_back, held)


_LIVE = _LiveRecords(LIVE_TENSORS)


@dataclass(frozen=True)
class Headers:
    """A hub model as the planner reads it; or why the pre-flight refuses it
    (``refused``); or why the operator does not plan it (``unread``: past its limits)."""

    shape: ModelShape | None = None
    weights: WeightsInfo | None = None
    source: ModelSource | None = None
    refused: str | None = None
    unread: str | None = None

    @property
    def tensors(self) -> int:
        return 0 if self.weights is None else self.weights.num_tensors + len(self.weights.skipped)


class HubUnavailable(Exception):
    """The hub did not answer with the model's files now, or the operator is reading as
    many models as it may (one line, no token)."""


def read_headers(uri: str, endpoint: str, timeout_s: float) -> Headers:
    """What the pre-flight reads of ``uri`` (blocking), within ``OPERATOR_LIMITS``: Headers,
    refused when the model itself is bad, unread past the limits; HubUnavailable when the
    hub is."""
    entered = False
    try:
        with header_mirror(uri, endpoint=endpoint, timeout_s=timeout_s,
                           limits=OPERATOR_LIMITS) as source:
            entered = True
            _LIVE.reserve(OPERATOR_LIMITS.tensors, timeout_s)
            try:
                with _PARSING:
                    shape, weights = read_checkpoint(source.path, OPERATOR_LIMITS)
                    ModelConfig.from_dir(source.path)  # what the engine cannot run, refused alike
            except BaseException:
                _LIVE.give_back(OPERATOR_LIMITS.tensors)
                raise
            _LIVE.track(weights, OPERATOR_LIMITS.tensors)
            return Headers(shape, weights, ModelSource("", uri=source.uri, commit=source.commit))
    except OverLimit as exc:
        return Headers(unread=str(exc))
    except BadInput as exc:
        if entered:
            return Headers(refused=str(exc))
        raise HubUnavailable((str(exc).strip().splitlines() or ["no answer"])[0]) from None
    except OSError as exc:
        raise HubUnavailable(str(exc.strerror or exc)) from None
    except Exception as exc:
        if not entered:
            raise
        # A tenant's files met a kvledger bug: that model goes unplanned here (the pod's
        # pre-flight still judges it); the operator's reads, reviews and reconciles go on.
        log.exception("reading %s's headers failed", uri)
        return Headers(unread=f"the operator could not read this model's headers "
                              f"({type(exc).__name__}: a kvledger bug, in the operator's log)")


class HubModels:
    """The operator's reads of hub models, on threads of their own: a flood of applies
    naming new models queues (or is turned away) here, never on the threads the
    operator's reconcile uses. One read in flight per (endpoint, uri)."""

    def __init__(self, read: Callable[[str, str, float], Headers] = read_headers,
                 threads: int = HUB_THREADS, waiting: int = HUB_WAITING) -> None:
        self._read = read
        self.workers = Workers("kvledger-hub", threads, waiting)
        # The reconcile's sizing reads on threads of their own: a flood of reviews naming
        # new models must not hold up, or turn away, the resources' own.
        self.sizing = Workers("kvledger-hub-size", SIZING_THREADS, SIZING_WAITING)
        self._entries: OrderedDict[tuple[str, str], tuple[float, Headers]] = OrderedDict()
        self._pending: dict[tuple[str, str], asyncio.Future[Headers]] = {}

    async def headers(self, uri: str, endpoint: str, within_s: float) -> Headers:
        """The headers, read now when not kept; TimeoutError past ``within_s`` (the read goes
        on and is kept), HubUnavailable when the hub fails or as many reads wait as may."""
        key = (endpoint, uri)
        kept = self._entries.get(key)
        if kept is not None and kept[0] > time.monotonic():
            self._entries.move_to_end(key)
            return kept[1]
        pending = self._pending.get(key)
        if pending is None:
            try:
                pending = self.workers.submit(
                    lambda: self._read(uri, endpoint, max(within_s, 30.0)))
            except Busy:
                raise HubUnavailable(
                    f"the operator is reading {self.workers.threads + self.workers.waiting} "
                    "other models from the hub now, as many as it may") from None
            self._pending[key] = pending
            pending.add_done_callback(lambda done: self._keep(key, done))
        return await asyncio.wait_for(asyncio.shield(pending), within_s)

    async def download_bytes(self, uri: str, endpoint: str) -> int:
        """What ``kvledger fetch`` would download for ``uri`` (the pod's cache size), on the
        same threads and within the same limits; BadInput, OSError or HubUnavailable."""
        from kvledger.engine.checkpoint.hub import repo

        try:
            future = self.sizing.submit(
                lambda: repo.download_bytes(uri, endpoint=endpoint, limits=OPERATOR_LIMITS))
        except Busy:
            raise HubUnavailable("the operator is sizing as many models from the hub as it "
                                 "may now") from None
        return await future

    def kept(self) -> set[ModelSource]:
        """The sources of the models kept: a plan of another pins its records (a Plan
        holds its model's weights), so the webhook keeps plans of these alone."""
        entries = list(self._entries.values())  # one C call: atomic against the loop's edits
        return {headers.source for _, headers in entries}

    def close(self) -> None:
        """Drop the reads that wait; those under way end on their own (SIGTERM)."""
        self.workers.close()
        self.sizing.close()

    def _keep(self, key: tuple[str, str], done: asyncio.Future[Headers]) -> None:
        self._pending.pop(key, None)
        if done.cancelled() or done.exception() is not None:
            return  # the hub failed: asked again next time
        headers = done.result()
        if headers.tensors > CACHED_TENSORS:
            return
        ttl = float("inf") if _COMMIT.search(key[1]) else BRANCH_TTL_S
        self._entries[key] = (time.monotonic() + ttl, headers)
        self._entries.move_to_end(key)
        while (len(self._entries) > CACHED_MODELS
               or sum(h.tensors for _, h in self._entries.values()) > CACHED_TENSORS):
            self._entries.popitem(last=False)
