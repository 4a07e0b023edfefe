"""A socket whose every frame is sealed with the group's key: the control channel between
machines (``core/nodes.py``) carries nothing that is not authenticated, in order, and
encrypted.

At connect each end sends 32 random bytes; both derive two keys (one per direction) from
``$KVLEDGER_NODE_KEY`` and both nonces (HKDF-SHA256), so every connection has keys of its
own and no frame of one connection opens on another. A frame is a 4-byte length and an
AES-256-GCM ciphertext whose nonce is the frame's number in its direction: a frame
dropped, replayed, reordered, reflected back or altered fails to open, and the connection
is closed (``Tampered``). Machine 0 sends the first sealed frame (``WELCOME``) at once, so
a rank holding another key learns it before it says anything; machine 0 learns the same of
a rank from its first frame. Nothing before those frames is trusted, and what may arrive
before them is bounded in bytes and time (``deadline``): a peer that drips one byte at a
time cannot hold a thread past it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"KVLN\x02"  # the protocol and its version, before each end's nonce
NONCE_BYTES = 32
LENGTH = struct.Struct("!I")
TAG_BYTES = 16
FIRST_FRAME_MAX_BYTES = 64 * 2**10  # what a peer may send before it has proved the key
FRAME_MAX_BYTES = 64 * 2**20  # an authenticated peer's largest frame (a step's batch)
WELCOME = b"kvledger machine 0"


class Tampered(ConnectionError):
    """A frame that does not open: another key, or bytes changed, replayed or dropped."""


class WrongKey(Tampered):
    """The peer's first frame does not open: it holds another key (or is no kvledger)."""


def _keys(key: bytes, ours: bytes, theirs: bytes, accepting: bool) -> tuple[bytes, bytes]:
    """(send key, receive key) of one end: machine 0's nonce first in the salt."""
    salt = ours + theirs if accepting else theirs + ours
    both = HKDF(hashes.SHA256(), 64, salt, b"kvledger-nodes/2 channel keys").derive(key)
    to_joiner, to_acceptor = both[:32], both[32:]
    return (to_joiner, to_acceptor) if accepting else (to_acceptor, to_joiner)


class SealedSocket:
    """One end of a sealed connection: ``send`` and ``recv`` whole frames of bytes. Sends
    from several threads go one at a time; reads are one thread's. A read waits at most
    ``timeout_s`` for the next bytes (``socket.timeout``, an OSError, after that)."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes) -> None:
        self.sock = sock
        self._send, self._recv = AESGCM(send_key), AESGCM(recv_key)
        self._sent = self._received = 0
        self._lock = threading.Lock()

    def send(self, payload: bytes) -> None:
        with self._lock:
            header = LENGTH.pack(len(payload) + TAG_BYTES)
            sealed = self._send.encrypt(self._sent.to_bytes(12, "big"), payload, header)
            self._sent += 1
            self.sock.sendall(header + sealed)

    def recv(self, deadline: float | None = None, max_bytes: int = FRAME_MAX_BYTES) -> bytes:
        """The next frame's payload. EOFError when the peer closed between frames, Tampered
        when it does not open, OSError on a timeout (or past ``deadline``)."""
        header = _read(self.sock, LENGTH.size, deadline, eof_ok=True)
        (length,) = LENGTH.unpack(header)
        if not TAG_BYTES <= length <= max_bytes:
            raise Tampered(f"a frame of {length} bytes (at most {max_bytes})")
        body = _read(self.sock, length, deadline)
        try:
            payload = self._recv.decrypt(self._received.to_bytes(12, "big"), body, header)
        except InvalidTag:
            raise Tampered("a frame that does not open with the group's key (altered, "
                           "replayed, out of order, or another key)") from None
        self._received += 1
        return payload

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _read(sock: socket.socket, n: int, deadline: float | None, eof_ok: bool = False) -> bytes:
    """Exactly ``n`` bytes; each wait bounded by the socket's timeout and ``deadline``."""
    timeout = sock.gettimeout()
    chunks, have = [], 0
    try:
        while have < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the peer did not finish in time")
                sock.settimeout(left if timeout is None else min(left, timeout))
            chunk = sock.recv(min(n - have, 2**20))
            if not chunk:
                if eof_ok and have == 0:
                    raise EOFError("the peer closed the connection")
                raise ConnectionError(f"the connection closed after {have} of {n} bytes")
            chunks.append(chunk)
            have += len(chunk)
    finally:
        if deadline is not None:
            sock.settimeout(timeout)
    return b"".join(chunks)


def _exchange_nonces(sock: socket.socket, deadline: float, accepting: bool) -> tuple[bytes, bytes]:
    ours = os.urandom(NONCE_BYTES)
    if accepting:
        sock.sendall(MAGIC + ours)
    theirs = _read(sock, len(MAGIC) + NONCE_BYTES, deadline)
    if not theirs.startswith(MAGIC):
        raise WrongKey("the peer does not speak kvledger's channel (version 2)")
    if not accepting:
        sock.sendall(MAGIC + ours)
    return ours, theirs[len(MAGIC):]


def accept_sealed(sock: socket.socket, key: bytes, deadline: float) -> SealedSocket:
    """Machine 0's end: the nonces, then ``WELCOME`` sealed (the rank can check the key at
    once). The rank's first frame, read by the caller, is its proof."""
    ours, theirs = _exchange_nonces(sock, deadline, accepting=True)
    sealed = SealedSocket(sock, *_keys(key, ours, theirs, accepting=True))
    sealed.send(WELCOME)
    return sealed


def connect_sealed(sock: socket.socket, key: bytes, deadline: float) -> SealedSocket:
    """A rank's end: the nonces, then machine 0's ``WELCOME``; WrongKey when it does not
    open (machine 0 holds another key)."""
    ours, theirs = _exchange_nonces(sock, deadline, accepting=False)
    sealed = SealedSocket(sock, *_keys(key, ours, theirs, accepting=False))
    try:
        welcome = sealed.recv(deadline, max_bytes=FIRST_FRAME_MAX_BYTES)
    except Tampered as exc:
        raise WrongKey(str(exc)) from None
    if welcome != WELCOME:
        raise WrongKey("machine 0's first frame is not its welcome")
    return sealed
