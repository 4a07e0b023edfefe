"""Rank 0's side of ``--tensor-parallel-size N``: the process that serves HTTP holds the
one scheduler, ledger and admission, and starts ranks 1..N-1 as processes of their own
(``rank_worker``). Every call rank 0 makes on its model runner is sent to them first
(``RankedRunner``), so all ranks run the same step, collectives in the same order.

Failure: a watchdog thread polls the ranks' processes; one that exits (killed, out of
memory, a crash) marks the group lost at once, and the callbacks given to ``on_lost`` run
(``kvledger serve`` answers /health 503 and exits non-zero). A step already inside a
collective fails when the peer's connection closes (gloo) or after ``RANK_TIMEOUT_S``
(the process group's timeout), never hangs; every later step raises ``RankLost``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvledger.engine.core.rank_worker import RankSpec, batch_view, build_runner, init_ranks
from kvledger.engine.core.rank_worker import main as worker_main
from kvledger.engine.errors import EngineFailed

log = logging.getLogger("kvledger.engine")

RANK_TIMEOUT_S = 60.0  # a collective no peer joins by then fails
RANK_START_TIMEOUT_S = 600.0  # each rank loads the whole checkpoint before it is ready
WATCH_INTERVAL_S = 0.2


class RankLost(EngineFailed):
    """A rank's process is gone: the engine cannot compute another step."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankGroup:
    """Ranks 1..N-1: their processes, the pipes rank 0 sends its calls on, the watchdog."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.threads_before: int | None = None  # rank 0's torch threads before the ranks
        self.lost: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        context = multiprocessing.get_context("spawn")  # no fork of a threaded process
        self._conns, self.processes = [], []
        for rank in range(1, spec.world):
            ours, theirs = context.Pipe()
            process = context.Process(target=worker_main, args=(spec, rank, theirs),
                                      name=f"kvledger-rank-{rank}", daemon=True)
            self._conns.append(ours)
            self.processes.append(process)

    def start(self) -> Any:
        """Start the ranks, join the process group as rank 0, build rank 0's shard, and
        wait until every rank has built its own; rank 0's model runner."""
        for process in self.processes:
            process.start()
        try:
            init_ranks(self.spec, 0)
            runner = build_runner(self.spec, 0)
        except BaseException:
            self.stop()
            raise
        deadline = time.monotonic() + RANK_START_TIMEOUT_S
        for rank, conn in enumerate(self._conns, start=1):
            while not conn.poll(0.2):
                if not self.processes[rank - 1].is_alive() or time.monotonic() > deadline:
                    self.stop()
                    raise RankLost(f"rank {rank} did not start "
                                   f"(exit code {self.processes[rank - 1].exitcode})")
            conn.recv()
        threading.Thread(target=self._watch, name="kvledger-rank-watchdog", daemon=True).start()
        log.info("tensor parallelism: %d ranks ready", self.spec.world)
        return runner

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Run ``callback(reason)`` (on the watchdog's thread) when a rank is lost; at
        once if one already is."""
        with self._lock:
            lost = self.lost
            if lost is None:
                self._callbacks.append(callback)
        if lost is not None:
            callback(lost)

    def call(self, method: str, *args: Any) -> None:
        """Send rank 0's call to every other rank; RankLost once one is gone."""
        if self.lost is not None:
            raise RankLost(self.lost)
        try:
            for conn in self._conns:
                conn.send((method, args))
        except (OSError, EOFError) as exc:
            self._mark_lost(f"a rank's pipe closed: {exc}")
            raise RankLost(self.lost) from None

    def replies(self) -> list[Any]:
        """Each other rank's answer to the call just sent (``measure``), in rank order;
        RankLost when a rank is gone first."""
        out = []
        for rank, conn in enumerate(self._conns, start=1):
            while not conn.poll(0.2):
                if self.lost is not None or not self.processes[rank - 1].is_alive():
                    self._mark_lost(f"rank {rank} of {self.spec.world} exited before it "
                                    "answered")
                    raise RankLost(self.lost)
            try:
                out.append(conn.recv())
            except (OSError, EOFError) as exc:
                self._mark_lost(f"a rank's pipe closed: {exc}")
                raise RankLost(self.lost) from None
        return out

    def stop(self) -> None:
        """Tell every rank to stop, end those that do not within a second, and leave the
        process group (another engine in this process may then start its own)."""
        import torch.distributed as dist

        with self._lock:
            if self.lost is None:
                self.lost = "the engine stopped"
            self._callbacks = []
        for conn in self._conns:
            with contextlib.suppress(OSError, EOFError):
                conn.send(("stop", ()))
        for process in self.processes:
            process.join(timeout=1.0)
            if process.is_alive():
                process.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.threads_before is not None:  # this process's cores are its own again
            import torch

            torch.set_num_threads(self.threads_before)
            self.threads_before = None

    def _watch(self) -> None:
        while self.lost is None:
            for rank, process in enumerate(self.processes, start=1):
                if not process.is_alive():
                    self._mark_lost(f"rank {rank} of {self.spec.world} exited "
                                    f"(exit code {process.exitcode})")
                    break
            time.sleep(WATCH_INTERVAL_S)

    def _mark_lost(self, reason: str) -> None:
        with self._lock:
            if self.lost is not None:
                return
            self.lost = reason
            callbacks, self._callbacks = self._callbacks, []
        log.error("tensor parallelism: %s; the engine cannot go on", reason)
        for callback in callbacks:
            callback(reason)


class RankedRunner:
    """Rank 0's ``ModelRunner``; each call the other ranks must follow goes to them
    first (``RankGroup.call``). Everything else is the runner's own."""

    def __init__(self, runner: Any, group: RankGroup) -> None:
        self.runner = runner
        self.ranks = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def profile(self, *args: Any) -> int | None:
        self.ranks.call("profile", *args)
        return self.runner.profile(*args)

    def allocate_kv_cache(self, *args: Any) -> int:
        self.ranks.call("allocate_kv_cache", *args)
        return self.runner.allocate_kv_cache(*args)

    def measure(self, *profile_args: Any) -> list[dict[str, int | None]]:
        """Every rank's measured weights and activation peak, rank 0's first (all ranks
        profile together: a pipeline's stages pass the step on to each other)."""
        from kvledger.engine.core.rank_worker import measure

        self.ranks.call("measure", *profile_args)
        own = measure(self.runner, *profile_args)
        return [own, *self.ranks.replies()]

    def execute(self, batch: Any) -> Any:
        self.ranks.call("execute", batch_view(batch))
        try:
            return self.runner.execute(batch)
        except RuntimeError as exc:  # a collective whose peer is gone
            if self.ranks.lost is not None or "onnection" in str(exc):
                raise RankLost(self.ranks.lost or str(exc)) from None
            raise
