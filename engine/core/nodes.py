"""Ranks on other machines (``--nnodes N``, ``engine/node_config.py``): the control channel
that carries rank 0's calls to them, and a machine of rank above 0 (``run_node``).

Machine 0 listens at ``--master-addr:--master-port+1``. Each rank of another machine
connects, and both ends prove they hold ``$KVLEDGER_NODE_KEY`` (multiprocessing's HMAC
challenge, both ways) before either unpickles a byte; a peer that fails it, or says nothing
for ``SILENCE_S``, is closed without stalling the others. The rank then names itself and
its model (``fingerprint``: a machine with another checkpoint is refused by name); once
every rank has joined, machine 0 sends each the ``RankSpec`` and they meet in
torch.distributed's store at ``--master-port``.

Liveness: both ends send a pulse every ``PULSE_S`` and read with a timeout of
``SILENCE_S``, so a machine that is gone (its process killed: at once, the connection
closes; its network lost: within ``SILENCE_S``) ends the run at every other machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

from kvledger.engine.errors import BadInput, EngineFailed
from kvledger.engine.node_config import NODE_KEY_ENV, Nodes
from kvledger.engine.planner.device import DeviceMemory, probe_device

log = logging.getLogger("kvledger.nodes")

PULSE_S = 1.0
SILENCE_S = 10.0  # a peer that sent nothing for this long is gone
JOIN_TIMEOUT_S = 600.0  # machines that load (or download) the model first
PROTOCOL = "kvledger-nodes/1"  # in the fingerprint: machines must speak alike
ALIVE = ("alive", ())


class NodeLost(EngineFailed):
    """Another machine of the run is gone, or never came."""


def fingerprint(model_dir: str) -> str:
    """What every machine must agree on: the protocol and the model's config.json."""
    digest = hashlib.sha256(PROTOCOL.encode())
    digest.update((Path(model_dir) / "config.json").read_bytes())
    return digest.hexdigest()[:16]


def _time_out(conn: Connection, seconds: float) -> None:
    """A read or a send on ``conn`` that waits longer than ``seconds`` fails; a message
    goes at once (no Nagle delay: a step's call is a small message waited on)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        whole = int(seconds)
        value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


class Channel:
    """A connection to another machine's rank (or to machine 0): sends from several
    threads (the calls, the pulse) one at a time; reads fail after ``SILENCE_S``."""

    def __init__(self, conn: Connection, peer: str) -> None:
        self.conn, self.peer = conn, peer
        self._lock = threading.Lock()
        self.closed = False
        self.device: DeviceMemory | None = None  # the peer's, as its hello says
        _time_out(conn, SILENCE_S)

    def send(self, message: Any) -> None:
        with self._lock:
            self.conn.send(message)

    def recv(self) -> Any:
        """The next message that is not a pulse; OSError after ``SILENCE_S`` of silence."""
        while True:
            try:
                message = self.conn.recv()
            except BlockingIOError:
                raise TimeoutError(f"{self.peer} sent nothing for {SILENCE_S:g} s") from None
            if message != ALIVE:
                return message

    def pulse(self) -> None:
        """Send ``ALIVE`` every ``PULSE_S`` from a thread of its own until closed."""
        def beat() -> None:
            while not self.closed:
                try:
                    self.send(ALIVE)
                except OSError:
                    return
                time.sleep(PULSE_S)

        threading.Thread(target=beat, name="kvledger-pulse", daemon=True).start()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.conn.close()


# Machine 0 -----------------------------------------------------------------------------

def accept_ranks(nodes: Nodes, remote: list[int], print_: str,
                 deadline_s: float | None = None) -> dict[int, Channel]:
    """Machine 0: the channel of each rank in ``remote`` (every rank of another machine),
    once all have joined; NodeLost if some do not within ``deadline_s`` (default
    ``JOIN_TIMEOUT_S``), BadInput if one runs another model."""
    deadline_s = JOIN_TIMEOUT_S if deadline_s is None else deadline_s
    server = socket.create_server(("", nodes.control_port))
    arrivals: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_accept, args=(server, nodes.key, arrivals),
                     name="kvledger-accept", daemon=True).start()
    joined: dict[int, Channel] = {}
    deadline, next_pulse = time.monotonic() + deadline_s, 0.0
    try:
        while len(joined) < len(remote):
            if time.monotonic() > deadline:
                missing = sorted(set(remote) - set(joined))
                raise NodeLost(f"ranks {missing} (--nnodes {nodes.count}) did not join at port "
                               f"{nodes.control_port} within {deadline_s:g} s")
            if time.monotonic() > next_pulse:  # the joined wait for the rest: keep them
                for channel in joined.values():
                    with contextlib.suppress(OSError):
                        channel.send(ALIVE)
                next_pulse = time.monotonic() + PULSE_S
            try:
                rank, channel, theirs = arrivals.get(timeout=0.2)
            except queue.Empty:
                continue
            if rank not in remote or rank in joined:
                log.warning("%s named itself rank %s, which is not a rank to join (or joined "
                            "already); closed", channel.peer, rank)
                refuse(channel, f"rank {rank} is not a rank of another machine to join")
                continue
            if theirs != print_:
                refuse(channel, "machine 0 serves another model (config.json) or version")
                raise BadInput(f"rank {rank} ({channel.peer}) runs another model or kvledger "
                               "version than machine 0: give every machine the same --model")
            joined[rank] = channel
            log.info("rank %d joined from %s (%d of %d)", rank, channel.peer, len(joined),
                     len(remote))
    except BaseException:
        for channel in joined.values():
            channel.close()
        raise
    finally:
        server.close()
    return joined


def refuse(channel: Channel, reason: str) -> None:
    """Tell a joined rank why machine 0 will not have it (its ``join`` raises), and close."""
    with contextlib.suppress(OSError):
        channel.send(("refused", reason))
    channel.close()


def _accept(server: socket.socket, key: bytes, arrivals: queue.SimpleQueue) -> None:
    while True:
        try:
            sock, peer = server.accept()
        except OSError:  # closed: every rank joined, or the start failed
            return
        threading.Thread(target=_handshake, args=(sock, f"{peer[0]}:{peer[1]}", key, arrivals),
                         daemon=True).start()


def _handshake(sock: socket.socket, peer: str, key: bytes, arrivals: queue.SimpleQueue) -> None:
    """Prove the key both ways, then read the peer's hello; a peer that fails or stalls
    is closed (each on a thread of its own: one cannot hold up the rest)."""
    sock.setblocking(True)
    channel = Channel(Connection(sock.detach()), peer)
    try:
        deliver_challenge(channel.conn, key)
        answer_challenge(channel.conn, key)
        kind, rank, theirs, device = channel.recv()
        if (kind != "hello" or not isinstance(rank, int) or not isinstance(theirs, str)
                or not isinstance(device, DeviceMemory | None)):
            raise ValueError("not a hello")
    except Exception as exc:  # a wrong key, silence, a closed socket, what is no hello
        log.warning("a connection from %s did not prove it holds $%s, or said no hello "
                    "(%s: %s); closed", peer, NODE_KEY_ENV, type(exc).__name__, exc)
        channel.close()
        return
    channel.device = device
    arrivals.put((rank, channel, theirs))


# Another machine -------------------------------------------------------------------------

def join(nodes: Nodes, rank: int, print_: str, device: DeviceMemory | None = None,
         deadline_s: float = JOIN_TIMEOUT_S) -> tuple[Channel, Any]:
    """A rank of machine ``nodes.rank``: connect to machine 0 (again and again while it
    is not up yet), prove the key, name this rank, its model and its machine's device
    (machine 0 plans on the smallest); the channel and machine 0's ``RankSpec`` once
    every rank has joined."""
    address = (nodes.master_addr, nodes.control_port)
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            conn = Client(address, authkey=nodes.key)
            break
        except AuthenticationError:
            raise BadInput(f"machine 0 at {address[0]}:{address[1]} holds another "
                           f"${NODE_KEY_ENV}: give every machine the same") from None
        except OSError as exc:  # refused, unreachable, not resolvable yet
            if time.monotonic() > deadline:
                raise NodeLost(f"machine 0 at {address[0]}:{address[1]} did not answer within "
                               f"{deadline_s:g} s ({exc})") from None
            time.sleep(1.0)
    channel = Channel(conn, f"machine 0 ({address[0]}:{address[1]})")
    channel.send(("hello", rank, print_, device))
    kind, payload = channel.recv()  # machine 0 pulses while the others join
    if kind == "refused":
        channel.close()
        raise BadInput(f"machine 0 refused rank {rank}: {payload}")
    return channel, payload


def run_rank(nodes: Nodes, rank: int, model_dir: str, threads: int | None,
             device: DeviceMemory) -> None:
    """A process of another machine (multiprocessing's spawn target): join machine 0,
    then follow its calls as a rank of machine 0 does (``rank_worker.follow``)."""
    from kvledger.engine.core.rank_worker import follow

    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(message)s")
    threading.Thread(target=_end_with, args=(os.getppid(),), daemon=True).start()
    code = 1
    try:
        channel, spec = join(nodes, rank, fingerprint(model_dir), device)
        channel.pulse()
        spec = replace(spec, model_dir=model_dir, threads=threads, master_addr=nodes.master_addr)
        code = follow(spec, rank, channel)
    except BaseException as exc:  # machine 0 gone, refused, or a broken shard
        log.error("rank %d failed: %s: %s", rank, type(exc).__name__, exc)
    sys.stdout.flush()
    os._exit(code)  # no process-group teardown: a peer may be gone


def _end_with(parent: int) -> None:
    """End this rank when its machine's ``kvledger serve`` is gone (killed -9, it could
    not end its ranks): a rank of no machine would hold machine 0's run open."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def run_node(config: Any, nodes: Nodes) -> int:
    """Machine ``nodes.rank`` (above 0): no API, no scheduler; its ranks as processes,
    each joining machine 0. The exit status: 0 when machine 0 stopped them (or SIGTERM),
    1 when one failed (the others are ended: the machines restart as a group)."""
    import multiprocessing

    import torch

    from kvledger.engine.checkpoint.hub.cache import serving_source
    from kvledger.engine.core.cpu_threads import cap_torch_threads

    world = config.tensor_parallel_size * config.pipeline_parallel_size
    ranks = nodes.ranks(world)
    source = serving_source(config.model, config.download_dir, hub_timeout_s=config.hub_timeout_s)
    device = probe_device(config)  # this machine's, before anything here touches it
    gpus = torch.cuda.device_count() if config.device != "cpu" else 0
    if gpus < len(ranks) and (config.device == "cuda" or gpus > 0):
        raise BadInput(f"machine {nodes.rank}: {len(ranks)} ranks here (--tensor-parallel-size "
                       f"x --pipeline-parallel-size / --nnodes), torch sees {gpus} CUDA devices")
    cap_torch_threads(torch)
    threads = max(1, torch.get_num_threads() // len(ranks)) if not gpus else None
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=run_rank, args=(nodes, rank, source.path, threads,
                                                        device),
                                 name=f"kvledger-rank-{rank}", daemon=True) for rank in ranks]
    for process in processes:
        process.start()
    log.info("machine %d of %d: ranks %d..%d joining %s:%d", nodes.rank, nodes.count,
             ranks[0], ranks[-1], nodes.master_addr, nodes.control_port)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        return _supervise(processes, stopping)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join(timeout=2.0)


def _supervise(processes: list, stopping: threading.Event) -> int:
    while not stopping.is_set():
        ended = [p for p in processes if not p.is_alive()]
        failed = [p for p in ended if p.exitcode != 0]
        if failed:
            log.error("%s exited (exit code %s): this machine's ranks stop", failed[0].name,
                      failed[0].exitcode)
            return 1
        if len(ended) == len(processes):
            log.info("machine 0 stopped the run")
            return 0
        stopping.wait(0.2)
    return 0
