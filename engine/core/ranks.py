"""Rank 0's side of ``--tensor-parallel-size N``: the process that serves HTTP holds the
one scheduler, ledger and admission, and starts ranks 1..N-1 as processes of their own
(``rank_worker``). Every call rank 0 makes on its model runner is sent to them first
(``RankedRunner``), so all ranks run the same step, collectives in the same order.

Failure: a watchdog thread polls the ranks' processes; one that exits (killed, out of
memory, a crash) marks the group lost at once, and the callbacks given to ``on_lost`` run
(``kvledger serve`` answers /health 503 and exits non-zero). A step already inside a
collective fails when the peer's connection closes (gloo) or after ``RANK_TIMEOUT_S``
(the process group's timeout), never hangs; every later step raises ``RankLost``. Each
other rank is a ``Follower`` (``rank_follower``): its connection and its replies.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from kvledger.engine.core.rank_follower import RANK_START_TIMEOUT_S, Follower, RankLost
from kvledger.engine.core.rank_messages import (
    AllocateKvCache,
    Execute,
    Measure,
    Message,
    Profile,
    RankFigures,
    RankSpec,
    Start,
    step_view,
)
from kvledger.engine.core.rank_worker import (
    build_runner,
    init_ranks,
    measure,
    terminal_interrupt_held,
)
from kvledger.engine.core.rank_worker import main as worker_main
from kvledger.engine.core.wire import PipeLink, encode
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.settings.node_config import Nodes

if TYPE_CHECKING:  # torch's side, imported where it is used
    from kvledger.engine.core.runner import ModelRunner, StepOutput
    from kvledger.engine.core.scheduler import ScheduledBatch

log = logging.getLogger("kvledger.engine")

RANK_TIMEOUT_S = 60.0  # a collective no peer joins by then fails
WATCH_INTERVAL_S = 0.2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankGroup:
    """Ranks 1..N-1 as rank 0 reaches them (``Follower``s): this machine's as processes it
    starts, with ``nodes`` (``--nnodes``) those of the other machines too; the watchdog."""

    def __init__(self, spec: RankSpec, nodes: Nodes | None = None,
                 on_machines: Callable[[dict[int, DeviceMemory | None]], None] | None = None
                 ) -> None:
        self.spec, self.nodes = spec, nodes
        self.on_machines = on_machines  # the other machines' devices, by rank, once joined
        self.threads_before: int | None = None  # rank 0's torch threads before the ranks
        self.gate = None  # the store's gate with other machines, open while ranks join
        self.lost: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self.followers: list[Follower] = []
        self.processes: list[BaseProcess] = []  # this machine's ranks but 0
        self._child_ends: list[Connection] = []  # closed once started: a rank's exit is EOF
        local = nodes.ranks(spec.world) if nodes else range(spec.world)
        context = multiprocessing.get_context("spawn")  # no fork of a threaded process
        for rank in local[1:]:
            ours, theirs = context.Pipe()
            process = context.Process(target=worker_main, args=(spec, rank, theirs),
                                      name=f"kvledger-rank-{rank}", daemon=True)
            self.followers.append(Follower(rank, PipeLink(ours), process))
            self.processes.append(process)
            self._child_ends.append(theirs)

    def start(self) -> ModelRunner:
        """Wait for the other machines' ranks (with ``nodes``), start this machine's, join
        the process group as rank 0, build rank 0's shard, and wait until every rank has
        built its own; rank 0's model runner."""
        try:
            if self.nodes is not None:
                self._join_machines()
            with terminal_interrupt_held():  # Ctrl-C is rank 0's to handle
                for process in self.processes:
                    process.start()
            for end in self._child_ends:  # theirs now: a rank's exit is EOF here
                end.close()
            threading.Thread(target=self._watch, name="kvledger-rank-watchdog",
                             daemon=True).start()
            peers = [f.conn.host for f in self.followers if f.process is None]
            self.gate = init_ranks(self.spec, 0, peers)
            runner = build_runner(self.spec, 0)
            deadline = time.monotonic() + RANK_START_TIMEOUT_S
            for follower in self.followers:
                follower.reply(self, deadline)  # Ready(rank)
            if self.gate is not None:  # every rank is in the group: the store's gate shuts
                self.gate.close()
        except BaseException:
            self.stop()
            raise
        log.info("%d ranks ready%s", self.spec.world,
                 f" on {self.nodes.count} machines" if self.nodes else "")
        return runner

    def _join_machines(self) -> None:
        """The other machines' ranks, once all have joined (and ``on_machines`` has not
        refused their devices), as followers; each is sent this machine's ``RankSpec``."""
        from kvledger.engine.core.nodes import accept_ranks, fingerprint, refuse

        here = self.nodes.ranks(self.spec.world)
        remote = [r for r in range(1, self.spec.world) if r not in here]
        channels = accept_ranks(self.nodes, remote, fingerprint(self.spec.model_dir))
        try:
            if self.on_machines is not None:  # a refusal: no rank has loaded anything
                self.on_machines({rank: channel.device for rank, channel in channels.items()})
        except BaseException as exc:
            for channel in channels.values():
                refuse(channel, (str(exc).splitlines() or [type(exc).__name__])[0])
            raise
        for rank, channel in channels.items():
            channel.send(Start(self.spec))
            self.followers.append(Follower(rank, channel))
        self.followers.sort(key=lambda follower: follower.rank)

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Run ``callback(reason)`` (on the watchdog's thread) when a rank is lost; at
        once if one already is."""
        with self._lock:
            lost = self.lost
            if lost is None:
                self._callbacks.append(callback)
        if lost is not None:
            callback(lost)

    def call(self, call: Message) -> None:
        """Send rank 0's call to every other rank; RankLost once one is gone."""
        if self.lost is not None:
            raise RankLost(self.lost)
        data = encode(call)
        try:
            for follower in self.followers:
                follower.send_bytes(data)
        except (OSError, EOFError) as exc:
            self.mark_lost(f"a rank's connection closed: {exc}")
            raise RankLost(self.lost) from None

    def replies(self) -> list[Message]:
        """Each other rank's answer to the call just sent (``measure``), in rank order;
        RankLost when a rank is gone first."""
        return [follower.reply(self) for follower in self.followers]

    def stop(self) -> None:
        """Tell every rank to stop, end those of this machine that do not within a second,
        and leave the process group (another engine in this process may then start its
        own)."""
        import torch.distributed as dist

        with self._lock:
            if self.lost is None:
                self.lost = "the engine stopped"
            self._callbacks = []
        for follower in self.followers:
            follower.close()
        for end in self._child_ends:  # a start that failed first: the pipes' readers end
            end.close()
        for process in self.processes:
            if process.pid is None:  # never started
                continue
            process.join(timeout=1.0)
            if process.is_alive():
                process.terminate()
        if self.gate is not None:
            self.gate.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.threads_before is not None:  # this process's cores are its own again
            import torch

            torch.set_num_threads(self.threads_before)
            self.threads_before = None

    def _watch(self) -> None:
        from kvledger.engine.core.nodes import ALIVE, PULSE_S

        next_pulse = 0.0
        while self.lost is None:
            for follower in self.followers:
                reason = follower.gone(self.spec.world)
                if reason is not None:
                    self.mark_lost(reason)
                    return
            if self.nodes is not None and time.monotonic() > next_pulse:
                for follower in self.followers:  # the other machines' ranks hear rank 0
                    if follower.process is None:
                        with contextlib.suppress(OSError):
                            follower.send(ALIVE)
                next_pulse = time.monotonic() + PULSE_S
            time.sleep(WATCH_INTERVAL_S)

    def mark_lost(self, reason: str) -> None:
        with self._lock:
            if self.lost is not None:
                return
            self.lost = reason
            callbacks, self._callbacks = self._callbacks, []
        log.error("ranks: %s; the engine cannot go on", reason)
        for callback in callbacks:
            callback(reason)


class RankedRunner:
    """Rank 0's ``ModelRunner``; each call the other ranks must follow goes to them
    first (``RankGroup.call``). Everything else is the runner's own."""

    def __init__(self, runner: ModelRunner, group: RankGroup) -> None:
        self.runner = runner
        self.ranks = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def profile(self, *args: Any) -> int | None:
        call = Profile(*args)
        self.ranks.call(call)
        return call.run(self.runner)

    def allocate_kv_cache(self, *args: Any) -> int:
        call = AllocateKvCache(*args)
        self.ranks.call(call)
        return call.run(self.runner)

    def measure(self, *profile_args: Any) -> list[RankFigures]:
        """Every rank's measured weights and activation peak, rank 0's first (all ranks
        profile together: a pipeline's stages pass the step on to each other)."""
        profile = Profile(*profile_args)
        self.ranks.call(Measure(profile))
        own = measure(self.runner, profile)
        return [own, *self.ranks.replies()]

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        self.ranks.call(Execute(step_view(batch)))
        try:
            return self.runner.execute(batch)
        except RuntimeError as exc:  # a collective whose peer is gone
            if self.ranks.lost is not None or "onnection" in str(exc):
                raise RankLost(self.ranks.lost or str(exc)) from None
            raise
