"""Ranks on other machines (``--nnodes N``, ``engine/settings/node_config.py``): the control channel
that carries rank 0's calls to them (a machine of rank above 0 runs its ranks in
``core/node_machine.py``).

Machine 0 listens at ``--master-addr:--master-port+1`` (that address only). Each rank of
another machine connects, and every frame either end sends from then on is sealed with a
key derived from ``$KVLEDGER_NODE_KEY`` and both ends' nonces (``core/sealed.py``):
authenticated, numbered, encrypted. A peer whose first frame does not open, or that does
not finish its hello within ``SILENCE_S``, is closed without stalling the others; at most
``HANDSHAKES`` are heard at once. What the frames carry is typed data
(``core/rank_messages.py`` through ``core/wire.py``), never a pickle. The rank names
itself and its model (``fingerprint``: a machine with another checkpoint is refused by
name); once every rank has joined, machine 0 stops listening, sends each the ``RankSpec``
and they meet in torch.distributed's store at ``--master-port`` (``core/store_gate.py``).

Liveness: both ends send a pulse every ``PULSE_S`` and read with a timeout of
``SILENCE_S``, so a machine that is gone (its process killed: at once, the connection
closes; its network lost: within ``SILENCE_S``) ends the run at every other machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import socket
import threading
import time
from pathlib import Path

from kvledger.engine.core.listener import Acceptor, listen_at
from kvledger.engine.core.rank_messages import Alive, Hello, Message, RankSpec, Refused, Start
from kvledger.engine.core.sealed import (
    FIRST_FRAME_MAX_BYTES,
    SealedSocket,
    WrongKey,
    accept_sealed,
    connect_sealed,
)
from kvledger.engine.core.wire import decode, encode
from kvledger.engine.errors import BadInput, EngineFailed
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.settings.node_config import NODE_KEY_ENV, Nodes

log = logging.getLogger("kvledger.nodes")

PULSE_S = 1.0
SILENCE_S = 10.0  # a peer that sent nothing for this long is gone; a hello's time too
JOIN_TIMEOUT_S = 600.0  # machines that load (or download) the model first
PROTOCOL = "kvledger-nodes/2"  # in the fingerprint: machines must speak alike
ALIVE = Alive()


def handshakes(remote: int) -> int:
    """Connections machine 0 hears at once while ``remote`` ranks join: theirs, and room
    for as many strangers (each closed within ``SILENCE_S``)."""
    return 2 * remote + 8


class NodeLost(EngineFailed):
    """Another machine of the run is gone, or never came."""


def fingerprint(model_dir: str) -> str:
    """What every machine must agree on: the protocol and the model's config.json."""
    digest = hashlib.sha256(PROTOCOL.encode())
    digest.update((Path(model_dir) / "config.json").read_bytes())
    return digest.hexdigest()[:16]


class Channel:
    """A sealed connection to another machine's rank (or to machine 0) that carries rank
    messages: sends from several threads (the calls, the pulse) one at a time; a read
    fails after ``SILENCE_S`` of silence."""

    def __init__(self, sealed: SealedSocket, peer: str) -> None:
        self.sealed, self.peer = sealed, peer
        self.closed = False
        self.device: DeviceMemory | None = None  # the peer's, as its hello says
        sealed.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # calls wait
        sealed.sock.settimeout(SILENCE_S)

    @property
    def host(self) -> str:
        return self.peer.rsplit(":", 1)[0]

    def send(self, message: Message) -> None:
        self.sealed.send(encode(message))

    def send_bytes(self, data: bytes) -> None:
        """A message ``encode`` wrote."""
        self.sealed.send(data)

    def recv(self, deadline: float | None = None, max_bytes: int | None = None) -> Message:
        """The next message that is not a pulse; OSError after ``SILENCE_S`` of silence,
        Tampered for a frame that does not open, BadMessage for one that is no message."""
        limit = {} if max_bytes is None else {"max_bytes": max_bytes}
        while True:
            try:
                message = decode(self.sealed.recv(deadline, **limit))
            except TimeoutError:
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
            self.sealed.close()


# Machine 0 -----------------------------------------------------------------------------

def accept_ranks(nodes: Nodes, remote: list[int], print_: str,
                 deadline_s: float | None = None) -> dict[int, Channel]:
    """Machine 0: the channel of each rank in ``remote`` (every rank of another machine),
    once all have joined; NodeLost if some do not within ``deadline_s`` (default
    ``JOIN_TIMEOUT_S``), BadInput if one runs another model. It listens only until then."""
    deadline_s = JOIN_TIMEOUT_S if deadline_s is None else deadline_s
    arrivals: queue.SimpleQueue = queue.SimpleQueue()
    done = threading.Event()  # every rank joined, or the join failed: no more arrivals
    acceptor = Acceptor(listen_at(nodes.master_addr, nodes.control_port),
                        lambda sock, peer: _handshake(sock, peer, nodes.key, arrivals, done),
                        handshakes(len(remote)), "kvledger-accept")
    joined: dict[int, Channel] = {}
    deadline, next_pulse = time.monotonic() + deadline_s, 0.0
    try:
        while len(joined) < len(remote):
            if time.monotonic() > deadline:
                missing = sorted(set(remote) - set(joined))
                raise NodeLost(f"ranks {missing} (--nnodes {nodes.count}) did not join at "
                               f"{nodes.master_addr}:{nodes.control_port} within "
                               f"{deadline_s:g} s")
            if time.monotonic() > next_pulse:  # the joined wait for the rest: keep them
                for channel in joined.values():
                    with contextlib.suppress(OSError):
                        channel.send(ALIVE)
                next_pulse = time.monotonic() + PULSE_S
            try:
                hello, channel = arrivals.get(timeout=0.2)
            except queue.Empty:
                continue
            if hello.rank not in remote or hello.rank in joined:
                log.warning("%s named itself rank %s, which is not a rank to join (or joined "
                            "already); closed", channel.peer, hello.rank)
                refuse(channel, f"rank {hello.rank} is not a rank of another machine to join")
                continue
            if hello.fingerprint != print_:
                refuse(channel, "machine 0 serves another model (config.json) or version")
                raise BadInput(f"rank {hello.rank} ({channel.peer}) runs another model or "
                               "kvledger version than machine 0: give every machine the same "
                               "--model")
            joined[hello.rank] = channel
            log.info("rank %d joined from %s (%d of %d)", hello.rank, channel.peer,
                     len(joined), len(remote))
    except BaseException:
        for channel in joined.values():
            channel.close()
        raise
    finally:
        done.set()
        acceptor.stop()
    return joined


def refuse(channel: Channel, reason: str) -> None:
    """Tell a joined rank why machine 0 will not have it (its ``join`` raises), and close."""
    with contextlib.suppress(OSError):
        channel.send(Refused(reason))
    channel.close()


def _handshake(sock: socket.socket, peer: str, key: bytes, arrivals: queue.SimpleQueue,
               done: threading.Event) -> None:
    """Seal the connection, then read the peer's hello, all within ``SILENCE_S`` however
    slowly its bytes come; a peer that fails or stalls is closed."""
    deadline = time.monotonic() + SILENCE_S
    sock.settimeout(SILENCE_S)
    try:
        channel = Channel(accept_sealed(sock, key, deadline), peer)
        hello = channel.recv(deadline, max_bytes=FIRST_FRAME_MAX_BYTES)
        if not isinstance(hello, Hello):
            raise ValueError(f"a {type(hello).__name__}, not a hello")
    except Exception as exc:  # another key, silence, a closed socket, what is no hello
        log.warning("a connection from %s did not prove it holds $%s, or said no hello "
                    "(%s: %s); closed", peer, NODE_KEY_ENV, type(exc).__name__, exc)
        with contextlib.suppress(OSError):
            sock.close()
        return
    if done.is_set():  # every rank joined meanwhile (or the join failed)
        channel.close()
        return
    channel.device = hello.device
    arrivals.put((hello, channel))


# Another machine -------------------------------------------------------------------------

def join(nodes: Nodes, rank: int, print_: str, device: DeviceMemory | None = None,
         deadline_s: float = JOIN_TIMEOUT_S) -> tuple[Channel, RankSpec]:
    """A rank of machine ``nodes.rank``: connect to machine 0 (again and again while it
    is not up yet, or busy), prove the key, name this rank, its model and its machine's
    device (machine 0 plans on the smallest); the channel and machine 0's ``RankSpec``
    once every rank has joined."""
    address = (nodes.master_addr, nodes.control_port)
    where = f"{address[0]}:{address[1]}"
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            sock = socket.create_connection(address, timeout=SILENCE_S)
            try:
                sealed = connect_sealed(sock, nodes.key, time.monotonic() + SILENCE_S)
            except BaseException:
                sock.close()
                raise
            break
        except WrongKey:
            raise BadInput(f"machine 0 at {where} holds another ${NODE_KEY_ENV}: give every "
                           "machine the same") from None
        except (OSError, EOFError) as exc:  # refused, unreachable, not resolvable yet, busy
            if time.monotonic() > deadline:
                raise NodeLost(f"machine 0 at {where} did not answer within {deadline_s:g} s "
                               f"({exc})") from None
            time.sleep(1.0)
    channel = Channel(sealed, f"machine 0 ({where})")
    channel.send(Hello(rank, print_, device))
    answer = channel.recv()  # machine 0 pulses while the others join
    if isinstance(answer, Refused):
        channel.close()
        raise BadInput(f"machine 0 refused rank {rank}: {answer.reason}")
    if not isinstance(answer, Start):
        channel.close()
        raise NodeLost(f"machine 0 sent a {type(answer).__name__}, not the run's spec")
    return channel, answer.spec
