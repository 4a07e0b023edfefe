"""The KV-cache events' publisher: vLLM's ZMQ wire, on a thread of its own.

Frames are vLLM 0.32's (``ZmqEventPublisher``): on a PUB socket, each batch is one
multipart message ``(topic, sequence number as 8 bytes big-endian, msgpack payload)``,
numbered from 0; with a ``replay_endpoint``, a ROUTER socket answers a subscriber that
sends a starting sequence number (8 bytes, big-endian) with every batch still kept from
there on (the last ``buffer_steps``), each as ``(topic, seq, payload)``, then an end marker
``(b"", -1, b"")``. The engine's step only seals its events into a batch
(``kv/events.py``); encoding and sending happen here.

Who can subscribe sees the token ids of every prompt the engine caches, whoever sent it:
bind to an address only the router can reach, or name the router's address so the engine
connects to it (docs/serving.md, KV-cache events).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque

import msgspec
import zmq

from kvledger.engine.errors import BadInput
from kvledger.engine.kv.events import KVEventLog
from kvledger.engine.settings.kv_events_config import KVEventsConfig

log = logging.getLogger("kvledger.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05  # how long the thread waits for a batch before it looks at replay requests
# What a peer may send: a replay request is 8 bytes, a subscription a topic prefix; a
# larger message closes its connection (ZMQ_MAXMSGSIZE) before it is held.
_MAX_INBOUND_BYTES = 1024
# Replay requests answered per turn of the loop: a peer sending them without pause delays
# the batches everyone else reads by at most this many answers.
_REPLAYS_PER_TURN = 4


def binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard, ipc and inproc endpoints are bound; others connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Publishes ``events``' sealed batches per ``config`` until ``close``. The sockets are
    bound (or connected) here, so an endpoint that cannot be is a BadInput at start-up."""

    def __init__(self, config: KVEventsConfig, events: KVEventLog,
                 data_parallel_rank: int = 0) -> None:
        self.config = config
        self._events = events
        self._rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.replays_answered = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.MAXMSGSIZE, _MAX_INBOUND_BYTES)
        self._replay: zmq.Socket | None = None
        try:
            self.endpoint = _attach(self._pub, config.endpoint)
            self.replay_endpoint = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.MAXMSGSIZE, _MAX_INBOUND_BYTES)
                self._replay.set_hwm(config.hwm)
                self.replay_endpoint = _attach(self._replay, config.replay_endpoint, bind=True)
        except BadInput:
            self._ctx.destroy(linger=0)
            raise
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvledger-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s%s", self.endpoint,
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    @property
    def published(self) -> int:
        """Batches sent so far."""
        return self._next_seq

    def close(self) -> None:
        """Send what is sealed, then stop the thread and close the sockets."""
        self._events.seal()
        self._stopping.set()
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None:
                for _ in range(_REPLAYS_PER_TURN):
                    if not self._replay.poll(0):
                        break
                    self._answer_replay()
            stopping = self._stopping.is_set()
            for batch in self._events.take(0 if stopping else _POLL_S):
                batch.data_parallel_rank = self._rank
                payload = encoder.encode(batch)
                seq = self._next_seq
                self._next_seq += 1
                with contextlib.suppress(zmq.Again):  # past the high-water mark: dropped
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload),
                                             flags=zmq.NOBLOCK)
                self._kept.append((seq, payload))
            if stopping:
                return

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._kept):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
        self.replays_answered += 1


def _attach(sock: zmq.Socket, endpoint: str, *, bind: bool | None = None) -> str:
    """Bind or connect ``sock`` (vLLM's rule unless ``bind`` says); the address it took."""
    try:
        if bind if bind is not None else binds(endpoint):
            sock.bind(endpoint)
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sock.connect(endpoint)
        return endpoint
    except zmq.ZMQError as exc:
        raise BadInput(f"--kv-events-config: cannot use {endpoint}: {exc}") from None
