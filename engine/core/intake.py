"""The engine's intake: the requests it holds, between the threads that add and abort them
and the one thread that steps. ``add`` and ``abort`` may be called from any thread while a
step runs; both are queued under a lock and handed to the scheduler at the start of the
next step (``take``), aborts first, so freed blocks are back before anything new is
scheduled. Every request added and not yet finished is tracked: ``abort_all`` releases
them all, whatever state a failed step left the queues in.
"""

from __future__ import annotations

import threading

from kvledger.engine.core.scheduler import Scheduler
from kvledger.engine.core.sequence import Sequence
from kvledger.engine.errors import BadInput


class Intake:
    """The requests ``scheduler`` is about to take, and every request it holds."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._lock = threading.Lock()
        self.pending_adds: dict[str, Sequence] = {}
        self.pending_aborts: list[str] = []
        self._aborted: list[Sequence] = []  # finished by abort, reported by the next step
        # Every request added and not yet reported finished: what abort_all releases.
        self._live: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` for the next step; BadInput when its request id is in use (checked
        and claimed in one step)."""
        with self._lock:
            if seq.request_id in self._live:
                raise BadInput(f"request id {seq.request_id!r} is already in use")
            self._live[seq.request_id] = self.pending_adds[seq.request_id] = seq

    def abort(self, request_id: str) -> None:
        """Stop a request; idempotent. A request not yet taken is released at once; a
        running one at the start of the next step. Either way the next step reports it
        with ``finish_reason == "abort"``."""
        with self._lock:
            seq = self.pending_adds.pop(request_id, None)
            if seq is not None:
                self.scheduler.finish(seq, "abort")  # only releases: it never reached the queues
                self._aborted.append(seq)
            elif request_id in self._live:
                self.pending_aborts.append(request_id)

    def abort_all(self) -> None:
        """Finish every request held as aborted and release its blocks now, without
        stepping. Call it only while no step runs."""
        with self._lock:
            live = list(self._live.values())
            for held in (self._live, self.pending_adds, self.pending_aborts, self._aborted):
                held.clear()
        scheduler = self.scheduler
        live += [*scheduler.waiting, *scheduler.running.values()]  # all live already
        scheduler.waiting.clear()
        for seq in live:
            if not seq.is_finished:
                scheduler.finish(seq, "abort")

    def has_pending(self) -> bool:
        """Whether adds or aborts wait for the next step."""
        with self._lock:
            return bool(self.pending_adds or self.pending_aborts or self._aborted)

    def take(self) -> list[Sequence]:
        """Hand the aborts, then the adds, queued since the last step to the scheduler; the
        aborted sequences."""
        with self._lock:
            aborts, self.pending_aborts = self.pending_aborts, []
            adds, self.pending_adds = list(self.pending_adds.values()), {}
            aborted, self._aborted = self._aborted, []
        for request_id in aborts:
            seq = self.scheduler.abort(request_id)
            if seq is not None:
                aborted.append(seq)
        for seq in adds:
            self.scheduler.add(seq)
        with self._lock:
            for seq in aborted:
                self._live.pop(seq.request_id, None)
        return aborted

    def forget(self, request_id: str) -> None:
        """A request the step finished: no longer held."""
        with self._lock:
            self._live.pop(request_id, None)
