"""vLLM's sleep mode (``--enable-sleep-mode``; POST /sleep, POST /wake_up, GET /is_sleeping
in development mode): memory given back and taken again, the same tokens after, nothing
admitted dropped, every request meanwhile a 503 with a Retry-After."""

from __future__ import annotations

import asyncio
import json

import pytest
from _server_helpers import make_llm, model_name, start_app, stop_app
from prometheus_client.parser import text_string_to_metric_families

from kvledger.engine.core import sleep
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.settings.config import EngineConfig

PROMPT = list(range(300, 340))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, enable_sleep_mode=True)


@pytest.fixture(autouse=True)
def _dev_mode(monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")


async def _complete(client, max_tokens: int = 8):
    body = {"model": model_name(client), "prompt": PROMPT, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    return await client.post("/v1/completions", json=body)


async def _text(client) -> str:
    response = await _complete(client)
    assert response.status == 200, await response.text()
    return (await response.json())["choices"][0]["text"]


def _weights(llm) -> int:
    return sum(t.numel() for t in llm.runner.model.parameters())


@pytest.mark.parametrize("level", [1, 2])
async def test_asleep_nothing_is_served_and_awake_the_tokens_are_the_same(aiohttp_client, llm,
                                                                          level):
    client = await start_app(aiohttp_client, llm)
    before = await _text(client)
    weights = _weights(llm)
    response = await client.post(f"/sleep?level={level}")
    assert await response.json() == {"status": "sleeping", "level": level}
    assert (await (await client.get("/is_sleeping")).json()) == {"is_sleeping": True}
    assert llm.runner.kv_cache is None  # the pool is given back
    assert _weights(llm) == (0 if level == 2 else weights)  # on the CPU, level 1 keeps them
    assert llm.ledger.cached_blocks == 0  # the pool's contents went with it
    refused = await _complete(client)
    assert refused.status == 503
    assert int(refused.headers["Retry-After"]) >= 1
    assert (await refused.json())["error"]["code"] == "engine_sleeping"
    ready = await client.get("/ready")
    assert (ready.status, (await ready.json())["status"]) == (503, "sleeping")
    assert await _sleep_state(client) == {"awake": 0, "weights_offloaded": level == 1,
                                          "discard_all": level == 2}
    woke = await (await client.post("/wake_up")).json()
    assert woke == {"status": "awake", "tags": None}
    assert _weights(llm) == weights
    assert await _text(client) == before
    assert (await client.get("/ready")).status == 200
    assert await _sleep_state(client) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}


async def _sleep_state(client) -> dict[str, float]:
    text = await (await client.get("/metrics")).text()
    [family] = [f for f in text_string_to_metric_families(text)
                if f.name == "vllm:engine_sleep_state"]
    return {s.labels["sleep_state"]: s.value for s in family.samples}


async def test_sleep_waits_for_the_request_running_and_refuses_the_next(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    alone = await (await _complete(client, max_tokens=40)).json()
    body = {"model": model_name(client), "prompt": PROMPT, "max_tokens": 40,
            "temperature": 0, "ignore_eos": True, "stream": True}
    stream = await client.post("/v1/completions", json=body)
    text, sleeping = "", None
    async for line in stream.content:
        if not line.startswith(b"data: {"):
            continue
        text += json.loads(line[6:])["choices"][0]["text"]
        if sleeping is None:  # it runs: ask for sleep now
            sleeping = asyncio.ensure_future(client.post("/sleep?level=1"))
            await asyncio.sleep(0.05)
            assert not sleeping.done()  # it waits for the running request
            assert (await _complete(client)).status == 503  # nobody new gets in
    assert text == alone["choices"][0]["text"]  # nothing admitted was dropped
    assert (await sleeping).status == 200
    assert (await (await client.post("/wake_up")).json())["status"] == "awake"


async def test_partial_wakes_and_refusals(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    assert (await client.post("/sleep?level=1&mode=abort")).status == 400  # never dropped
    assert (await client.post("/sleep?level=3")).status == 400
    assert (await client.post("/sleep?level=x")).status == 400
    assert (await client.post("/sleep?level=2")).status == 200
    again = await client.post("/sleep?level=1")
    assert again.status == 400 and "asleep already" in (await again.text())
    assert (await client.post("/wake_up?tags=nonsense")).status == 400
    half = await (await client.post("/wake_up?tags=weights")).json()
    assert half == {"status": "sleeping", "tags": ["weights"]}
    assert (await _complete(client)).status == 503
    rest = await (await client.post("/wake_up?tags=kv_cache")).json()
    assert rest == {"status": "awake", "tags": ["kv_cache"]}
    assert (await _complete(client)).status == 200


async def test_served_only_in_dev_mode_behind_the_key_and_with_the_flag(
        aiohttp_client, llm, tiny_llama_dir, monkeypatch):
    keyed = await start_app(aiohttp_client, llm, api_keys=("k",))
    assert (await keyed.post("/sleep")).status == 401
    assert (await keyed.get("/is_sleeping")).status == 401
    await stop_app(keyed)
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE")
    plain = await start_app(aiohttp_client, llm)
    assert (await plain.post("/sleep")).status == 404
    await stop_app(plain)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    off = await start_app(aiohttp_client, make_llm(tiny_llama_dir))
    response = await off.post("/sleep")
    assert response.status == 400 and "--enable-sleep-mode" in await response.text()


def test_runs_sleep_mode_cannot_serve_are_refused_before_loading():
    with pytest.raises(BadInput, match="one process"):
        sleep.check(EngineConfig(model="/m", enable_sleep_mode=True, tensor_parallel_size=2))
    with pytest.raises(BadInput, match="--enable-lora"):
        sleep.check(EngineConfig(model="/m", enable_sleep_mode=True, enable_lora=True))
    sleep.check(EngineConfig(model="/m", tensor_parallel_size=2))  # off: nothing to check
    host = DeviceMemory("cpu", "host memory (cgroup limit)", 32 << 30, 10 << 30, False)
    sleep.check_host(8 << 30, host)
    with pytest.raises(BadInput, match=r"keeps the weights \(16.0 GiB\) in host memory.*"
                                       r"give the container 6.0 GiB more"):
        sleep.check_host(16 << 30, host)


async def test_a_sleep_level_file_puts_it_to_sleep_and_wakes_it_on_each_change(
        aiohttp_client, llm, tmp_path, caplog):
    """``--sleep-level-file`` (the operator's spec.sleep, a mounted ConfigMap): each change of
    the file is acted on once, as /sleep or /wake_up would; a text that is no level is
    logged and ignored; a wake over HTTP meanwhile stands until the file changes again."""
    from kvledger.engine.server import sleep_file
    from kvledger.engine.server.state import STATE

    client = await start_app(aiohttp_client, llm)
    before = await _text(client)
    state = client.server.app[STATE]
    path = tmp_path / "level"
    follower = asyncio.create_task(sleep_file.follow(state.door.sleep, path,
                                                     state.metrics.sleep_state, poll_s=0.02))

    async def sleeping() -> bool:
        return (await (await client.get("/is_sleeping")).json())["is_sleeping"]

    async def until(wanted: bool) -> None:
        for _ in range(250):
            if await sleeping() == wanted:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"is_sleeping never became {wanted}")

    try:
        await asyncio.sleep(0.1)
        assert not await sleeping()  # absent: awake
        path.write_text("1\n")
        await until(True)  # the door closes first; the gauge moves once the memory is freed
        assert (await _complete(client)).status == 503
        for _ in range(250):
            if (await _sleep_state(client))["weights_offloaded"] == 1:
                break
            await asyncio.sleep(0.02)
        assert (await _sleep_state(client))["weights_offloaded"] == 1
        path.write_text("2")  # another level: woken, then slept again
        await until(True)
        for _ in range(250):
            if llm.runner.kv_cache is None and _weights(llm) == 0:
                break
            await asyncio.sleep(0.02)
        assert _weights(llm) == 0
        path.write_text("")
        await until(False)
        assert await _text(client) == before
        path.write_text("soon")
        await asyncio.sleep(0.2)
        assert not await sleeping()
        assert "'soon' is no sleep level" in caplog.text
        path.write_text("1")
        await until(True)
        await client.post("/wake_up")  # by hand: it stands, the file has not changed
        await asyncio.sleep(0.2)
        assert not await sleeping()
    finally:
        follower.cancel()
        if await sleeping():
            await client.post("/wake_up")


def test_a_sleep_level_file_says_0_1_2_or_awake():
    from kvledger.engine.server.sleep_file import wanted_level

    assert [wanted_level(t) for t in ("", " \n", "awake", "0", "1\n", " 2 ")] == \
        [None, None, None, 0, 1, 2]
    for text in ("3", "-1", "one", "1 2"):
        with pytest.raises(BadInput, match="is no sleep level"):
            wanted_level(text)


def test_a_sleep_level_file_is_read_no_further_than_a_level_needs(tmp_path):
    """The file is the pod's, but read every second: a huge one costs 64 bytes a read."""
    from kvledger.engine.server.sleep_file import MAX_BYTES, _read

    path = tmp_path / "level"
    path.write_text("1" + " " * (8 << 20))
    assert _read(path) == "1" + " " * (MAX_BYTES - 1)
    assert _read(tmp_path / "absent") == ""
