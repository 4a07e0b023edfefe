"""The machines' control channel and store, attacked as issue 51 found them: a relay on the
path that injects a frame (a pickle ran on machine 0) or replays one, an eavesdropper
reading prompts, a peer that drips its handshake a byte at a time, a flood of connections
that cost a thread each, a connection accepted after the join, and listeners on every
interface whatever ``--master-addr`` said. Each goes through the socket the attacker used."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
from _server_helpers import free_port

from kvledger.engine.core import nodes as node_channel
from kvledger.engine.core import wire
from kvledger.engine.core.listener import listen_at
from kvledger.engine.core.rank_follower import Follower
from kvledger.engine.core.rank_messages import (
    Alive,
    AllocateKvCache,
    ChunkView,
    Execute,
    Hello,
    Measure,
    ParamsView,
    Profile,
    RankFigures,
    RankSpec,
    Refused,
    SeqView,
    Start,
    StepView,
    Stop,
)
from kvledger.engine.core.sealed import MAGIC
from kvledger.engine.core.store_gate import StoreGate
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.settings.node_config import Nodes

KEY = b"kvledger-test-key-0123456789"
SPEC = RankSpec(model_dir="/m", world=2, device="cpu", dtype="float32", max_model_len=128,
                block_size=16, master_port=29500, timeout_s=60.0, stages=2, nodes=2)
MARK = 7_310_731  # a token id the eavesdropper looks for


def _in_thread(call, *args, **kwargs) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = call(*args, **kwargs)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


class Relay:
    """A machine in the middle: relays rank 1's connection to machine 0, keeps a copy of
    every byte, and may write frames of its own towards machine 0."""

    def __init__(self, to_port: int) -> None:
        # Its own port, never machine 0's: ``to_port`` came from free_port(), and the system
        # may hand the port it just freed to this bind (machine 0 then failed to listen).
        self.server = listen_at("127.0.0.1", 0)
        while self.server.getsockname()[1] in (to_port, to_port - 1):
            taken = self.server
            self.server = listen_at("127.0.0.1", 0)
            taken.close()
        self.port = self.server.getsockname()[1]
        self.seen = bytearray()
        self.upstream: socket.socket | None = None
        self.replay_next = False  # send the rank's next frame to machine 0 twice
        threading.Thread(target=self._run, args=(to_port,), daemon=True).start()

    def _run(self, to_port: int) -> None:
        joiner, _ = self.server.accept()
        # Rank 1 may reach the relay before machine 0 listens (each starts in a thread of its
        # own): try again for as long as a joining rank would, not once.
        deadline = time.monotonic() + 20
        while True:
            try:
                self.upstream = socket.create_connection(("127.0.0.1", to_port))
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        threading.Thread(target=self._pump, args=(self.upstream, joiner), daemon=True).start()
        self._pump(joiner, self.upstream, replaying=True)

    def _pump(self, source: socket.socket, sink: socket.socket, replaying: bool = False) -> None:
        while True:
            try:
                data = source.recv(65536)
                if not data:
                    return
                self.seen.extend(data)
                sink.sendall(data)
                if replaying and self.replay_next:
                    self.replay_next = False
                    sink.sendall(data)
            except OSError:
                return

    def inject(self, frame: bytes) -> None:
        self.upstream.sendall(frame)


def _join_through(relay: Relay | None, port: int, rank: int = 1):
    """Machine 0 accepting at ``port`` (its control port) and rank 1 joining it, through
    ``relay`` when given: (machine 0's channel to rank 1, rank 1's channel)."""
    nodes0 = Nodes(2, 0, "127.0.0.1", port - 1, KEY)
    leader, accepted = _in_thread(node_channel.accept_ranks, nodes0, [rank], "m",
                                  deadline_s=20)
    target = relay.port if relay else port
    follower, joined = _in_thread(node_channel.join, Nodes(2, 1, "127.0.0.1", target - 1, KEY),
                                  rank, "m", deadline_s=20)
    leader.join(20)
    channel = accepted["value"][rank]
    channel.send(Start(SPEC))
    follower.join(20)
    assert joined["value"][1] == SPEC
    return channel, joined["value"][0]


def test_a_frame_injected_on_the_path_runs_nothing_and_ends_the_channel(tmp_path) -> None:
    """Before: machine 0 unpickled the relay's frame and ran its code."""
    proof = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {proof}",))

    port = free_port()
    relay = Relay(port)
    channel, rank_side = _join_through(relay, port)
    follower = Follower(1, channel)
    rank_side.send(Alive())
    frame = pickle.dumps(Payload())
    relay.inject(struct.pack("!I", len(frame)) + frame)
    start = time.monotonic()
    while follower.gone(2) is None and time.monotonic() - start < 5:
        time.sleep(0.05)
    assert "does not open" in (follower.gone(2) or "")
    assert not proof.exists()
    rank_side.close()


def test_a_replayed_frame_ends_the_channel() -> None:
    port = free_port()
    relay = Relay(port)
    channel, rank_side = _join_through(relay, port)
    follower = Follower(1, channel)
    relay.replay_next = True
    rank_side.send(RankFigures(1, None))
    assert follower.inbox.get(timeout=5) == RankFigures(1, None)
    assert follower.inbox.get(timeout=5) is None  # the copy did not open: closed
    assert "does not open" in follower.closed
    rank_side.close()


def test_what_crosses_the_channel_cannot_be_read_on_the_path() -> None:
    """Before: the relay read the prompts' token ids (pickle's integers) in clear."""
    port = free_port()
    relay = Relay(port)
    channel, rank_side = _join_through(relay, port)
    call = _execute([MARK] * 64, "secret-request")
    channel.send(call)
    assert rank_side.recv() == call
    assert struct.pack(">I", MARK) not in relay.seen and b"secret" not in relay.seen
    assert b"Execute" not in relay.seen
    channel.close()
    rank_side.close()


def test_a_peer_that_drips_its_handshake_is_closed_within_the_silence(monkeypatch, caplog) -> None:
    """Before: a byte every 8 s kept its thread past the 10 s limit, for as long as it
    dripped."""
    monkeypatch.setattr(node_channel, "SILENCE_S", 2.0)
    port = free_port()
    nodes0 = Nodes(2, 0, "127.0.0.1", port - 1, KEY)
    _in_thread(node_channel.accept_ranks, nodes0, [1], "m", deadline_s=15)
    time.sleep(0.3)
    drip = socket.create_connection(("127.0.0.1", port))
    drip.recv(len(MAGIC) + 32)
    started, closed_after = time.monotonic(), None
    for byte in MAGIC + bytes(40):  # one byte every 0.5 s: never silent for 2 s
        try:
            drip.sendall(bytes([byte]))
            if drip.recv(1, socket.MSG_DONTWAIT) == b"":
                closed_after = time.monotonic() - started
                break
        except BlockingIOError:
            pass
        except OSError:
            closed_after = time.monotonic() - started
            break
        time.sleep(0.5)
    assert closed_after is not None and closed_after < 3.5
    assert "did not prove it holds" in caplog.text


def test_a_flood_of_connections_costs_no_thread_each_and_the_rank_still_joins(monkeypatch) -> None:
    """Before: 3,000 connections held 1,100 threads (+290 MB)."""
    monkeypatch.setattr(node_channel, "SILENCE_S", 2.0)
    port = free_port()
    before = threading.active_count()
    nodes0 = Nodes(2, 0, "127.0.0.1", port - 1, KEY)
    leader, accepted = _in_thread(node_channel.accept_ranks, nodes0, [1], "m", deadline_s=30)
    time.sleep(0.3)
    flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
    time.sleep(1.0)
    assert threading.active_count() - before <= node_channel.handshakes(1) + 3
    _in_thread(node_channel.join, Nodes(2, 1, "127.0.0.1", port - 1, KEY), 1, "m",
               deadline_s=20)
    leader.join(25)  # the flood's slots free within the silence: the rank gets one
    assert list(accepted["value"]) == [1]
    for sock in flood:
        sock.close()


def test_machine_zero_stops_listening_once_every_rank_joined() -> None:
    """Before: one more connection was accepted after the join."""
    port = free_port()
    channel, rank_side = _join_through(None, port)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    channel.close()
    rank_side.close()


def test_machine_zero_listens_only_at_master_addr() -> None:
    """Before: the control port was bound on every interface (another address of the
    machine, here 127.0.0.2, reached it)."""
    port = free_port()
    nodes0 = Nodes(2, 0, "127.0.0.1", port - 1, KEY)
    leader, _ = _in_thread(node_channel.accept_ranks, nodes0, [1], "m", deadline_s=2)
    time.sleep(0.3)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=2)
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    leader.join(5)


def test_a_master_addr_of_another_machine_is_refused_not_widened() -> None:
    with pytest.raises(BadInput, match="is not an address of this machine"):
        listen_at("192.0.2.1", free_port())


def test_the_store_gate_relays_the_group_and_closes_on_everyone_else() -> None:
    """Before: the store answered anyone on every interface (120 values of 8 MiB moved
    machine 0 from 379 MB to 1.38 GB)."""
    store = listen_at("127.0.0.1", 0)
    gate_port = free_port()
    gate = StoreGate("127.0.0.1", gate_port, store.getsockname()[1], peers=["10.0.0.9"],
                     limit=8)
    try:
        stranger = socket.socket()
        stranger.bind(("127.0.0.2", 0))  # another address: no machine of the run
        stranger.connect(("127.0.0.1", gate_port))
        stranger.settimeout(3)
        assert stranger.recv(1) == b""  # closed unheard
        member = socket.create_connection(("127.0.0.1", gate_port))  # this machine
        inner, _ = store.accept()
        member.sendall(b"set")
        assert inner.recv(3) == b"set"
        gate.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", gate_port), timeout=2)
        member.sendall(b"get")  # what the ranks hold goes on
        assert inner.recv(3) == b"get"
    finally:
        gate.shutdown()
        store.close()


def _execute(prompt: list[int], request_id: str = "r") -> Execute:
    seq = SeqView(request_id, prompt, len(prompt), len(prompt), prompt[-1], [0, 1, 2], None,
                  ParamsView(None))
    return Execute(StepView([ChunkView(seq, 0, len(prompt))], [seq], [1, 2]))


@pytest.mark.parametrize("value", [
    ("Stop",),  # no tag: a plain array
    {"type": "Popen", "args": ["sh"]},  # a type that is no message
    {"type": "Ready", "rank": "1"},  # a field of the wrong type
    {"type": "Ready"},  # a field missing
    {"type": "Hello", "rank": 1, "fingerprint": "m", "device": {"__reduce__": "os.system"}},
    {"type": "Profile", "num_tokens": 1, "max_model_len": 2, "max_num_seqs": 2.5},
])
def test_only_rank_messages_are_built(value) -> None:
    import msgspec

    with pytest.raises(wire.BadMessage):
        wire.decode(msgspec.msgpack.encode(value))


@pytest.mark.parametrize("data", [pickle.dumps(Stop()), b"\xc1", b"\x91" * 100_000])
def test_bytes_that_are_no_message_are_refused(data: bytes) -> None:
    with pytest.raises(wire.BadMessage):
        wire.decode(data)


def test_every_message_crosses_unchanged() -> None:
    device = DeviceMemory("cpu", "host", 2**34, 2**33, False)
    profile = Profile(256, 128, 4, "fp8")
    for message in (Hello(1, "abc", device), Hello(2, "abc", None), Refused("why"),
                    Start(SPEC), Alive(), Stop(), AllocateKvCache(12, "auto"), profile,
                    Measure(profile), RankFigures(2**40, None), _execute([3, 4, 5])):
        assert wire.decode(wire.encode(message)) == message


def test_a_two_machine_run_leaves_no_store_or_channel_listening(tiny_llama_dir, tmp_path) -> None:
    """Once served, nothing of machine 0 but HTTP answers at --master-addr (the store's
    gate and the control channel have closed), and nothing ever listened on 127.0.0.2."""
    from test_nodes import Machines

    group = Machines(Path(tiny_llama_dir), tmp_path, "-pp", "2", "--served-model-name", "m")
    try:
        args = group.procs[0].args
        master = int(args[args.index("--master-port") + 1])
        group.ready()
        for port in (master, master + 1):
            for host in ("127.0.0.1", "127.0.0.2"):
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection((host, port), timeout=2)
        assert group.complete([1, 2, 3])
    finally:
        group.reap()
