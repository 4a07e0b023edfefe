"""``--kv-events-config``: vLLM 0.32's JSON for publishing KV-cache events, read alike.

    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                         "topic": "kv@$(POD_IP)@my-model"}'

The keys and defaults are vLLM's (``vllm/config/kv_events.py``): ``publisher`` defaults to
``zmq`` when events are on, else ``null``; an endpoint with ``*``, ``::``, ``ipc://`` or
``inproc://`` is bound, any other is connected to (a router that collects from many pods
names its own address). A key vLLM does not know, a value of the wrong type or a
publisher other than ``zmq``/``null`` is refused by name (BadInput, exit 2), as vLLM's
config refuses them. What is published and how: ``kv/events.py``, ``core/kv_publisher.py``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from kvledger.engine import json_text
from kvledger.engine.errors import BadInput

_SCHEMES = ("tcp://", "ipc://", "inproc://")
# --prefix-caching-hash-algo: vLLM's with a public seed (kv/event_keys.py); its xxhash ones
# need xxhash and a secret seed.
HASH_ALGOS = ("sha256", "sha256_cbor")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for the replay endpoint
    hwm: int = 100_000  # the PUB socket's high-water mark (messages)
    max_queue_size: int = 100_000  # batches waiting for the publisher's thread
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """The flag's JSON object (BadInput, one line, naming what is wrong)."""
        try:
            given = json_text.loads(text)  # a RecursionError is a ValueError here too
        except ValueError as exc:
            raise BadInput(f"--kv-events-config: not JSON ({exc})") from None
        if not isinstance(given, dict):
            raise BadInput(f"--kv-events-config: expected a JSON object, got {text!r}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise BadInput(f"--kv-events-config: unknown key(s) {', '.join(unknown)} (vLLM's "
                           f"are {', '.join(known)})")
        for key, value in given.items():
            _check(key, value)
        if given.get("publisher") is None:
            given["publisher"] = "zmq" if given.get("enable_kv_cache_events") else "null"
        if given["publisher"] not in ("zmq", "null"):
            raise BadInput(f"--kv-events-config: publisher {given['publisher']!r} is not one "
                           "kvledger has (zmq, null)")
        return cls(**given)

    def to_json(self) -> str:
        """The flag's value that gives this config back (``EngineConfig.to_flags``)."""
        return json.dumps(asdict(self), separators=(",", ":"))

    def __str__(self) -> str:
        return self.to_json()


def _check(key: str, value: object) -> None:
    if key == "enable_kv_cache_events":
        ok = isinstance(value, bool)
    elif key in ("buffer_steps", "hwm", "max_queue_size"):
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    elif key in ("endpoint", "replay_endpoint"):
        ok = (value is None and key == "replay_endpoint") or (
            isinstance(value, str) and value.startswith(_SCHEMES))
    elif key == "publisher":
        ok = value is None or isinstance(value, str)
    else:  # topic
        ok = isinstance(value, str)
    if not ok:
        raise BadInput(f"--kv-events-config: {key}={value!r} is not valid (endpoints are "
                       "tcp://, ipc:// or inproc:// addresses; sizes whole numbers above 0)")
