"""Helpers for the server tests: a small real engine, an app around it, metric reads."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvledger.engine.server.app import build_app
from kvledger.engine.server.state import STATE, ServeOptions
from kvledger.engine.settings.config import EngineConfig


def make_llm(model_dir: Path, **flags):
    """A CPU ``LLMEngine`` on the tiny model; small pools make 429s easy to reach."""
    from kvledger.engine.core.engine import LLMEngine

    values = {"max_model_len": 256, "num_gpu_blocks_override": 32, "max_num_seqs": 8}
    values.update(flags)
    return LLMEngine.from_config(EngineConfig(model=str(model_dir), device="cpu", **values))


def fill_pool(ledger):
    """Hold the whole pool as one request that has written all of it: no request is
    admitted beside it, whether the ledger reserves or over-commits (``--admission safe``
    admits beside a promise not yet written)."""
    tokens = ledger.num_blocks * ledger.block_size
    held = ledger.try_reserve(tokens)
    assert ledger.grow(held, tokens) == tokens
    return held


async def start_sdk(aiohttp_server, llm, clients: list, **options):
    """An app serving ``llm`` on a real port and an ``openai.AsyncOpenAI`` client for it
    (appended to ``clients``, for the caller to close): ``(model name, client)``."""
    import openai

    app = build_app(ServeOptions(**options))
    server = await aiohttp_server(app, host="127.0.0.1")
    await app[STATE].attach(llm)
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="k", max_retries=0)
    clients.append(client)
    return app[STATE].model_name, client


async def start_app(aiohttp_client, llm, **options):
    """An aiohttp test client on a loaded, warmed app serving ``llm``."""
    app = build_app(ServeOptions(**options))
    client = await aiohttp_client(app)
    await app[STATE].attach(llm)
    return client


async def stop_app(client) -> None:
    """Close ``client``'s app and stop its driver: an engine has one driver at a time, so
    a test that serves the same ``llm`` from a second app stops the first one."""
    await client.close()


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in a Prometheus exposition (0 when absent)."""
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" (\S+)"
    match = re.search(r"^" + pattern + r"$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def metric(client, name: str, labels: str = "") -> float:
    response = await client.get("/metrics")
    return metric_value(await response.text(), name, labels)


async def wait_for_metric(client, name: str, value: float, timeout_s: float = 10.0) -> float:
    """Poll ``/metrics`` until ``name`` equals ``value``; return the last value seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        seen = await metric(client, name)
        if seen == value or loop.time() > deadline:
            return seen
        await asyncio.sleep(0.02)


def model_name(client) -> str:
    return client.app[STATE].model_name


# Ports tests hand to servers: below the ephemeral range (32768 on Linux) and the usual
# services' ports.
_PORTS_START, _PORTS_END = 20000, 32000


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now, from a range of ports no other
    pytest-xdist worker is handed (below the kernel's ephemeral range, which ``bind(0)``
    draws from). Two workers' ``bind(0)`` were given the same just-freed port, and a test
    that signals its server once the port answers signalled one still starting."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    width = (_PORTS_END - _PORTS_START) // count
    start = _PORTS_START + (index % count) * width
    for _ in range(1000):
        port = random.randrange(start, start + width)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {start}-{start + width}")


def wait_for_serve(proc: subprocess.Popen, port: int, timeout_s: float = 90.0) -> None:
    """Until a ``kvledger serve`` process answers ``/ready`` 200; fail the test if it exits
    first (with its stderr) or never does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            pytest.fail(f"serve exited with {proc.returncode}: {err}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.2)
    pytest.fail("serve never became ready")


def reap(proc: subprocess.Popen) -> None:
    """Kill a server process a test left running, and close its pipes."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def serve_then_kill_a_rank(model_dir, *flags: str) -> tuple[subprocess.Popen, int, float]:
    """``kvledger serve`` of ``model_dir`` with ``flags`` (two ranks) on the CPU, one
    completion answered, then its other rank's process killed (-9): the serving process
    (the caller reaps it), its port, and when the rank was killed (time.monotonic)."""
    import sys

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvledger.engine.cli", "serve", str(model_dir), "--device", "cpu",
         "--dtype", "float32", "--max-model-len", "256", "--host", "127.0.0.1", "--port",
         str(port), *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        return proc, port, _kill_a_rank(proc, port)
    except BaseException:
        reap(proc)
        raise


def _kill_a_rank(proc: subprocess.Popen, port: int) -> float:
    import json
    import urllib.request

    wait_for_serve(proc, port, timeout_s=150)
    ready = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/ready").read())
    body = json.dumps({"model": ready["model"], "prompt": [1, 2, 3], "max_tokens": 4,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(request).read())
    assert answer["usage"]["completion_tokens"] == 4
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True,
                         text=True, check=False).stdout
    # The rank processes (multiprocessing's resource tracker is a child too).
    [rank] = [int(p) for p in out.split()
              if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]
    killed = time.monotonic()
    subprocess.run(["kill", "-9", str(rank)], check=True)
    return killed


def with_added_tokens(model_dir: Path, out: Path, markers: list[str]) -> Path:
    """A copy of the tiny checkpoint ``model_dir`` at ``out`` whose tokenizer, trained
    again, holds ``markers`` as added tokens that are not special (as Qwen's tokenizer
    holds ``<think>`` and ``<tool_call>``); the vocabulary keeps its size, so the weights
    fit."""
    from tokenizers import processors

    from kvledger.engine.model.bpe import train_byte_level_bpe
    from kvledger.engine.model.builtin import CORPUS, SPECIAL_TOKENS, TOKENIZER_VOCAB

    shutil.copytree(model_dir, out)
    tokenizer = train_byte_level_bpe(CORPUS.read_text().splitlines(),
                                     TOKENIZER_VOCAB - len(markers), SPECIAL_TOKENS)
    tokenizer.add_tokens(markers)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    config = json.loads((out / "config.json").read_text())
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    tokenizer.save(str(out / "tokenizer.json"))
    return out
