"""One rank other than 0, as rank 0 reaches it: its connection (a pipe to a process of this
machine, or a sealed channel to a rank of another), a thread that reads what it sends,
rank 0's calls sent to it and its replies awaited, and why it is lost when it is
(``RankLost``). The group of them, started and watched, is ``ranks``' ``RankGroup``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Protocol

from kvledger.engine.core.rank_messages import Message, RankSpec, Stop
from kvledger.engine.core.wire import BadMessage, Link, encode
from kvledger.engine.errors import EngineFailed

if TYPE_CHECKING:  # the channel, imported where it is used
    from kvledger.engine.core.nodes import Channel

RANK_START_TIMEOUT_S = 600.0  # each rank loads the whole checkpoint before it is ready


class RankLost(EngineFailed):
    """A rank's process is gone: the engine cannot compute another step."""


class Group(Protocol):
    """What a follower's reply reads of its group (``RankGroup``): its ranks, why it is
    lost if it is, and how to mark it lost."""

    spec: RankSpec
    lost: str | None

    def mark_lost(self, reason: str) -> None: ...


class Follower:
    """A rank other than 0, as rank 0 reaches it: a process of this machine over a pipe
    (``PipeLink``), or a rank of another machine over its sealed channel
    (``core/nodes.py``; then no process here). A thread reads what it sends into
    ``inbox``; ``gone`` says why it is lost."""

    def __init__(self, rank: int, conn: Link | Channel,
                 process: BaseProcess | None = None) -> None:
        self.rank, self.conn, self.process = rank, conn, process
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.closed: str | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name=f"kvledger-rank-{rank}-reader",
                         daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError, BadMessage) as exc:  # a frame that does not open too
                self.closed = str(exc) if str(exc) else "its connection closed"
                self.inbox.put(None)
                return
            self.inbox.put(message)

    def send(self, message: Message) -> None:
        self.send_bytes(encode(message))

    def send_bytes(self, data: bytes) -> None:
        """A message ``encode`` wrote (once for every rank)."""
        with self._lock:
            self.conn.send_bytes(data)

    def gone(self, world: int) -> str | None:
        if self.process is not None and not self.process.is_alive():
            return f"rank {self.rank} of {world} exited (exit code {self.process.exitcode})"
        if self.process is None and self.closed is not None:
            return f"rank {self.rank} of {world} at {self.conn.peer} is gone: {self.closed}"
        return None

    def reply(self, group: Group, deadline: float | None = None) -> Message:
        """Its answer to the call just sent; RankLost if it is gone (or, by ``deadline``,
        silent) first."""
        world = group.spec.world
        while True:
            try:
                message = self.inbox.get(timeout=0.2)
            except queue.Empty:
                reason = group.lost or self.gone(world)
                if reason is None and deadline is not None and time.monotonic() > deadline:
                    reason = f"rank {self.rank} did not start within {RANK_START_TIMEOUT_S:g} s"
                if reason is None:
                    continue
            else:
                if message is not None:
                    return message
                reason = (group.lost or self.gone(world)
                          or f"rank {self.rank}'s connection closed ({self.closed})")
            group.mark_lost(reason)
            raise RankLost(group.lost)

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            self.send(Stop())
        if self.process is None:
            self.conn.close()
