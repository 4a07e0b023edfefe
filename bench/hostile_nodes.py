"""The multi-machine control channel and store, attacked as issue 51 found them, against a
real two-machine run (``kvledger serve --nnodes 2`` as two processes over 127.0.0.1,
built-in tiny-llama, ``-pp 2``) and, for what needs a machine in the middle, the channel's
own code with a relay between the two ends. Each attack prints what it gets now; exit 1
(a ``hostile_nodes: FAILED:`` line each) when one gets what it should not.

    .venv/bin/python bench/hostile_nodes.py

The attacks, with what the issue measured before the fix:

- listeners: what machine 0 listens on while the others join and once they have
  (before: the store on 0.0.0.0 and the control channel on every interface, whatever
  ``--master-addr`` said; both open for as long as the run);
- a flood of 3,000 connections at the control port while machine 0 waits for the other
  machine (before: 1,100 threads, +290 MB); the machine still joins;
- a peer that drips its handshake one byte every 2 s (before: its thread held for as long
  as it dripped, past the 10 s limit);
- once joined: a stranger's connection to the store's and the channel's ports, and 120
  values of 8 MiB written to the store (before: accepted, machine 0 379 MB -> 1.38 GB);
- a relay on the path injects one pickled frame after the handshake (before: machine 0
  ran its code) and reads what crosses (before: the prompts' token ids in clear).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from local_server import free_port

from kvledger.engine.core import nodes as node_channel
from kvledger.engine.core.rank_follower import Follower
from kvledger.engine.core.rank_messages import (
    ChunkView,
    Execute,
    ParamsView,
    SeqView,
    Start,
    StepView,
)
from kvledger.engine.core.sealed import MAGIC, NONCE_BYTES
from kvledger.engine.model.builtin import write_model
from kvledger.engine.settings.node_config import NODE_KEY_ENV, Nodes, free_port_pair

KEY = "hostile-nodes-bench-key-0123456789"
KVLEDGER = [sys.executable, "-m", "kvledger.engine.cli"]


def listening(pid: int) -> set[str]:
    """The TCP addresses ``pid`` and its children listen on, as ``host:port``."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout
    pids = {pid} | {int(p) for p in subprocess.run(
        ["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()}
    return {line.split()[3] for line in out.splitlines()
            if any(f"pid={p}," in line for p in pids)}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def run_attacks(model_dir: Path, logs: Path, failed: list[str]) -> None:
    master, port = free_port_pair(), free_port()
    env = {**os.environ, NODE_KEY_ENV: KEY}
    common = [*KVLEDGER, "serve", str(model_dir), "--device", "cpu", "--dtype", "float32",
              "--max-model-len", "128", "-pp", "2", "--nnodes", "2", "--master-addr",
              "127.0.0.1", "--master-port", str(master)]
    machine0 = subprocess.Popen([*common, "--node-rank", "0", "--host", "127.0.0.1", "--port",
                                 str(port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=(logs / "m0.log").open("w"))
    machine1 = None
    try:
        while refused("127.0.0.1", master + 1):
            time.sleep(0.2)  # until machine 0 listens for the others
        during = listening(machine0.pid)
        wide = [a for a in during if a.startswith(("0.0.0.0:", "*:", "[::]:"))
                and a.rsplit(":", 1)[1] in (str(master), str(master + 1))]
        print(f"listeners while joining: {sorted(during)}")
        if wide:
            failed.append(f"machine 0 listens on every interface: {wide}")

        base_threads, base_rss = threads_of(machine0.pid), rss_mb(machine0.pid)
        flood = []
        for _ in range(3000):
            with contextlib.suppress(OSError):
                flood.append(socket.create_connection(("127.0.0.1", master + 1), timeout=2))
        time.sleep(1.0)
        grew = threads_of(machine0.pid) - base_threads
        rss = rss_mb(machine0.pid) - base_rss
        print(f"3000 connections at the control port: +{grew} threads, +{rss:.0f} MB "
              "(before: 1,100 threads, +290 MB)")
        if grew > node_channel.handshakes(1) + 4:
            failed.append(f"a flood of connections took {grew} threads")
        for sock in flood:
            sock.close()

        drip = socket.create_connection(("127.0.0.1", master + 1))
        drip.settimeout(5)
        drip.recv(64)  # machine 0's nonce
        drip.settimeout(None)  # blocking: MSG_DONTWAIT below asks without waiting
        started = time.monotonic()
        dripped = iter(MAGIC + bytes(NONCE_BYTES + 64))  # a right start, one byte at a time
        while time.monotonic() - started < 40:
            try:
                drip.sendall(bytes([next(dripped)]))
                if drip.recv(1, socket.MSG_DONTWAIT) == b"":
                    break
            except BlockingIOError:
                pass
            except OSError:
                break
            time.sleep(2.0)
        held = time.monotonic() - started
        print(f"a handshake dripped a byte every 2 s: closed after {held:.1f} s (limit "
              f"{node_channel.SILENCE_S:g} s; before: held while it dripped)")
        if held > node_channel.SILENCE_S + 3:
            failed.append(f"a dripping handshake held its thread {held:.0f} s")

        machine1 = subprocess.Popen([*common, "--node-rank", "1", "--headless"], env=env,
                                    stdout=subprocess.DEVNULL,
                                    stderr=(logs / "m1.log").open("w"))
        ready_by = time.monotonic() + 180
        while not _ready(port) and time.monotonic() < ready_by:
            if machine0.poll() is not None:
                failed.append(f"machine 0 exited {machine0.returncode}: "
                              f"{(logs / 'm0.log').read_text()[-800:]}")
                return
            time.sleep(0.5)
        after = listening(machine0.pid)
        left = [a for a in after if a.rsplit(":", 1)[1] in (str(master), str(master + 1))]
        print(f"listeners once joined: {sorted(after)}")
        if left:
            failed.append(f"still listening at the store or channel port once joined: {left}")
        strangers = [refused(h, p) for h in ("127.0.0.1", "127.0.0.2")
                     for p in (master, master + 1)]
        print(f"a stranger at the store and channel ports once joined: "
              f"{'refused' if all(strangers) else 'ACCEPTED'} (before: accepted; 120 x 8 MiB "
              "moved machine 0 from 379 MB to 1.38 GB)")
        if not all(strangers):
            failed.append("a stranger reached the store or the channel after the join")
    finally:
        for proc in (machine1, machine0):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _ready(port: int) -> bool:
    import urllib.request

    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2).status == 200
    except OSError:
        return False


def relay_attack(failed: list[str], proof: Path) -> None:
    """Machine 0's accept and a rank's join (the channel's own code), a relay between them
    that copies every byte and then injects a pickled frame towards machine 0."""
    port, relay_port = free_port(), free_port()
    seen, box, upstream = bytearray(), {}, {}

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {proof}",))

    def pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):  # machine 0 closes the channel: the relay ends
            while data := source.recv(65536):
                seen.extend(data)
                sink.sendall(data)

    def relay() -> None:
        server = socket.create_server(("127.0.0.1", relay_port))
        joiner, _ = server.accept()
        upstream["sock"] = socket.create_connection(("127.0.0.1", port))
        threading.Thread(target=pump, args=(upstream["sock"], joiner), daemon=True).start()
        pump(joiner, upstream["sock"])

    threading.Thread(target=relay, daemon=True).start()
    key = KEY.encode()
    leader = threading.Thread(target=lambda: box.update(joined=node_channel.accept_ranks(
        Nodes(2, 0, "127.0.0.1", port - 1, key), [1], "m", deadline_s=20)), daemon=True)
    leader.start()
    time.sleep(0.3)
    rank = threading.Thread(target=lambda: box.update(rank=node_channel.join(
        Nodes(2, 1, "127.0.0.1", relay_port - 1, key), 1, "m", deadline_s=20)), daemon=True)
    rank.start()
    leader.join(20)
    channel = box["joined"][1]
    follower = Follower(1, channel)
    secret = [9_876_543] * 32
    seq = SeqView("secret-request", secret, 32, 32, secret[-1], [0, 1], None, ParamsView(None))
    channel.send(Start(_spec()))
    rank.join(20)
    channel.send(Execute(StepView([ChunkView(seq, 0, 32)], [], [])))
    time.sleep(0.5)
    frame = pickle.dumps(Payload())
    upstream["sock"].sendall(struct.pack("!I", len(frame)) + frame)
    time.sleep(1.5)
    readable = b"secret-request" in seen or struct.pack(">I", 9_876_543) in seen
    print(f"a relay on the path: its injected pickle {'RAN' if proof.exists() else 'ran nothing'} "
          f"on machine 0 (channel {'closed: ' + str(follower.closed) if follower.closed else 'open'}); "
          f"the prompts it carried were {'READABLE' if readable else 'unreadable'} (before: "
          "the code ran, the prompts readable)")
    if proof.exists():
        failed.append("machine 0 ran a frame injected on the path")
    if follower.closed is None:
        failed.append("machine 0 kept a channel that carried a forged frame")
    if readable:
        failed.append("a relay on the path read the prompts")


def _spec():
    from kvledger.engine.core.rank_messages import RankSpec

    return RankSpec(model_dir="/m", world=2, device="cpu", dtype="float32", max_model_len=128,
                    block_size=16, master_port=29500, timeout_s=60.0, stages=2, nodes=2)


def run_all(folder: Path, failed: list[str], *, live: bool = True) -> None:
    """Every attack (``live``: the two-machine run's too, about a minute), into ``failed``."""
    relay_attack(failed, folder / "ran")
    if live:
        write_model("tiny-llama", folder / "tiny")
        run_attacks(folder / "tiny", folder, failed)


def main() -> int:
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        run_all(Path(tmp), failed)
    for line in failed:
        print(f"hostile_nodes: FAILED: {line}")
    print("hostile_nodes:", "FAILED" if failed else "every attack refused")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
