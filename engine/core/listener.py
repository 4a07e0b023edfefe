"""Where machine 0 listens for the other machines (the control channel, the store's gate):
at the address ``--master-addr`` names, never on every interface, and for no longer and
no more connections at once than the join needs.

``listen_at`` binds the address a flag gives. On Kubernetes it is often a name (LWS's
``$(LWS_LEADER_ADDRESS)``) whose DNS record may come a little after the pod: a name that
does not resolve yet is tried again for ``RESOLVE_WITHIN_S``. An address that is not this
machine's is refused (exit 2), not widened to every interface.

``Acceptor`` runs each connection's handler on a thread of its own, at most ``limit`` at
once: one more is closed at once (a flood of connections costs no threads), and ``stop``
ends the accepting at once (a connection after it is refused by the kernel).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable

from kvledger.engine.errors import BadInput

log = logging.getLogger("kvledger.nodes")

RESOLVE_WITHIN_S = 120.0


def listen_at(host: str, port: int, within_s: float = RESOLVE_WITHIN_S,
              flag: str = "--master-addr") -> socket.socket:
    """A socket listening at ``host``:``port`` (``port`` 0: one the kernel picks)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            family, _, _, _, address = socket.getaddrinfo(
                host, port, socket.AF_UNSPEC, socket.SOCK_STREAM)[0]
            return socket.create_server(address[:2], family=family, backlog=128)
        except socket.gaierror:
            if time.monotonic() > deadline:
                raise BadInput(f"{flag} {host} does not resolve (tried for {within_s:g} s)") \
                    from None
            time.sleep(1.0)
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                raise BadInput(f"{flag} {host} is not an address of this machine: machine 0 "
                               "listens there for the others; give its own address") from None
            if exc.errno == errno.EADDRINUSE:
                raise BadInput(f"port {port} at {host} is in use (--master-port P takes P and "
                               "P+1)") from None
            raise


def addresses_of(host: str) -> set[str]:
    """The addresses ``host`` resolves to, and the loopback ones: a process of this machine
    that connects to ``host`` comes from one of them."""
    found = {"127.0.0.1", "::1"}
    with contextlib.suppress(OSError):
        found |= {info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_UNSPEC,
                                                             socket.SOCK_STREAM)}
    return {plain_address(a) for a in found}


def plain_address(address: str) -> str:
    """An IPv4 address seen through an IPv6 socket (``::ffff:10.0.0.2``) as itself."""
    return address.removeprefix("::ffff:")


class Acceptor:
    """Accepts on ``server`` and runs ``handle(sock, "host:port")`` for each connection on
    its own thread, at most ``limit`` at a time; ``stop`` ends it."""

    def __init__(self, server: socket.socket, handle: Callable[[socket.socket, str], None],
                 limit: int, name: str) -> None:
        self.server, self._handle, self.limit = server, handle, limit
        self._slots = threading.BoundedSemaphore(limit)
        self.stopped = threading.Event()
        self.turned_away = 0
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                sock, peer = self.server.accept()
            except OSError:  # stopped
                return
            if self.stopped.is_set() or not self._slots.acquire(blocking=False):
                self.turned_away += 1
                if self.turned_away == 1 and not self.stopped.is_set():
                    log.warning("%d connections at %s at once: more are closed unheard",
                                self.limit, self.where)
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, f"{peer[0]}:{peer[1]}"),
                             daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            self._handle(sock, peer)
        finally:
            self._slots.release()

    @property
    def where(self) -> str:
        host, port = self.server.getsockname()[:2]
        return f"{host}:{port}"

    def stop(self) -> None:
        """No connection is accepted after this returns (an accept waiting wakes now)."""
        self.stopped.set()
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
