"""torch.distributed's store, where the ranks meet before their first collective, kept to
the ranks of the run.

torch's TCPStore server listens on every interface and answers set, get, add and delete
from anyone, with no limit on what is stored. So rank 0 opens it on a socket of its own:

- one machine: bound where ``--master-addr`` says (127.0.0.1 unless told otherwise);
- several machines: bound to 127.0.0.1 on a port the kernel picks, behind a gate at
  ``--master-addr:--master-port`` that relays only connections from the machines whose
  ranks proved the group's key on the control channel (their addresses) and from this
  machine, and that stops accepting once every rank has joined the process group
  (``close``). What gloo (or NCCL) itself opens between the ranks afterwards is theirs;
  with a loopback ``--master-addr`` gloo is kept on the loopback interface too.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from kvledger.engine.core.listener import Acceptor, addresses_of, listen_at, plain_address
from kvledger.engine.core.rank_messages import RankSpec

log = logging.getLogger("kvledger.nodes")


def open_store(spec: RankSpec, peers: Iterable[str]) -> tuple[Any, StoreGate | None]:
    """Rank 0's store (the server), and the gate in front of it with other machines (the
    addresses in ``peers`` admitted)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=spec.timeout_s)
    if spec.nodes == 1:
        server = listen_at(spec.master_addr, spec.master_port)
        port = spec.master_port
    else:
        server = listen_at("127.0.0.1", 0)
        port = server.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, spec.world, True, timeout, wait_for_workers=False,
                          master_listen_fd=server.detach())  # the store owns it now
    if spec.nodes == 1:
        return store, None
    limit = 4 * spec.world + 8  # a store connection or two for each rank, and slack
    return store, StoreGate(spec.master_addr, spec.master_port, port, peers, limit)


def keep_gloo_local(spec: RankSpec) -> None:
    """A loopback ``--master-addr`` keeps gloo's own listening sockets on the loopback
    interface too (by default gloo binds the address this machine's name resolves to)."""
    with contextlib.suppress(ValueError, OSError):
        resolved = socket.getaddrinfo(spec.master_addr, None)[0][4][0]
        if ipaddress.ip_address(resolved).is_loopback:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


class StoreGate:
    """Relays connections at ``host:port`` from ``peers`` and this machine to the store at
    127.0.0.1:``store_port``; any other is closed unheard, and logged."""

    def __init__(self, host: str, port: int, store_port: int, peers: Iterable[str],
                 limit: int) -> None:
        self.store_port = store_port
        self.admitted = addresses_of(host) | {plain_address(p) for p in peers}
        self._links: list[socket.socket] = []
        self._lock = threading.Lock()
        self._acceptor = Acceptor(listen_at(host, port), self._relay, limit,
                                  "kvledger-store-gate")

    def _relay(self, sock: socket.socket, peer: str) -> None:
        if plain_address(peer.rsplit(":", 1)[0]) not in self.admitted:
            log.warning("a connection to the store from %s, which is no machine of this run; "
                        "closed", peer)
            sock.close()
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.store_port), timeout=10)
        except OSError:
            sock.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._links += [sock, upstream]
        other = threading.Thread(target=_pump, args=(upstream, sock), daemon=True)
        other.start()
        _pump(sock, upstream)
        other.join()

    def close(self) -> None:
        """Accept no more connections; those relayed go on (the ranks keep theirs)."""
        self._acceptor.stop()

    def shutdown(self) -> None:
        self.close()
        with self._lock:
            for sock in self._links:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """``source``'s bytes to ``sink`` until either closes; then both are closed."""
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        source.close()
