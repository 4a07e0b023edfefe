"""Tenant isolation, replayed as an attacker would, against one live ``kvledger serve``
(built-in tiny-llama, ``--enable-lora --max-loras 2``, runtime adapter loading on) and the
CLI. Each attack prints what it gets now; exit 1 (a ``hostile_isolation: FAILED:`` line
each) when one gets what it should not.

    .venv/bin/python bench/hostile_isolation.py

The attacks (issue 39):

- adapters: one of NaN weights, one of infinite weights, a ``lora_alpha`` of NaN and of
  1e400, ``target_modules`` of lists, an ``adapter_config.json`` nested 100,000 deep:
  each a 400 at load, naming why;
- an adapter of 1e30 weights (finite, so loaded): its requests fail alone while base
  requests in the same batches, and for minutes after it is unloaded, keep the tokens
  they get on a fresh server;
- paths: a client naming a directory that does not exist and one that does (not an
  adapter) gets one message for both; ``/v1/models`` shows no server path;
- ``kvledger_lora_requests_total`` keeps no series for an adapter once unloaded;
- a past tool call's ``arguments`` of 5,000 nested brackets, in a chat and in
  ``/tokenize``: never a 5xx;
- four runtime ``hf://`` adapter loads against a hub that never answers: a completion
  and a ``/tokenize`` meanwhile answer within 2 s;
- ``kvledger plan`` on a checkpoint whose safetensors header is nested 200,000 deep, or
  has a dimension of 10**400: exit 2 and one ``error:`` line;
- tenants behind a gateway (``hostile_tenants.py``): a second tenant header, a case
  variant of a tenant's name, a name no tenant has, a file tenant named as an
  ``--api-key`` key is: none gets a tier it does not hold;
- the operator (``hostile_operator.py``: the real one, against kmock's Kubernetes
  emulator, the chart's default policy): resources asking for what only the admin may
  choose, env that runs code of their own or sends the hub token elsewhere, a group key
  made beforehand: each refused, and no Secret read by the operator at all.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
from local_server import free_port, wait_ready

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from _lora_helpers import write_adapter  # noqa: E402
from hostile_operator import operator_attacks  # noqa: E402
from hostile_tenants import tenant_attacks  # noqa: E402

PROMPT = [5, 17, 42, 9, 33, 7, 120, 64, 3]
KVLEDGER = [sys.executable, "-m", "kvledger.engine.cli"]


def silent_hub() -> tuple[str, socket.socket]:
    """An endpoint that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{server.getsockname()[1]}", server


def hostile_headers(folder: Path) -> list[tuple[str, Path]]:
    """Checkpoints whose only safetensors file has a hostile header."""
    cases = []
    config = json.loads((folder / "tiny" / "config.json").read_text())
    for name, header in (("deep", b"[" * 200_000 + b"]" * 200_000),
                         ("huge-dim", json.dumps({"w": {"dtype": "F32", "shape": [10**400],
                                                        "data_offsets": [0, 4]}}).encode())):
        model = folder / name
        model.mkdir()
        (model / "config.json").write_text(json.dumps(config))
        (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header
                                                  + b"\0" * 4)
        cases.append((name, model))
    return cases


async def post(session, url: str, body: dict) -> tuple[int, dict | str]:
    async with session.post(url, json=body) as response:
        text = await response.text()
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, text


async def attacks(base: str, model: str, folder: Path, hub: str, failed: list[str]) -> None:
    tiny = folder / "tiny"

    def check(ok: bool, what: str, got: object) -> None:
        print(f"{what}: {got}")
        if not ok:
            failed.append(f"{what}: {got}")

    async with aiohttp.ClientSession() as session:
        def body(name: str) -> dict:
            return {"model": name, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True}

        clean = (await post(session, base + "/v1/completions", body(model)))[1]
        expected = clean["choices"][0]["text"]
        load = base + "/v1/load_lora_adapter"
        for name, config in (("nan", dict(scale=float("nan"))), ("inf", dict(scale=float("inf"))),
                             ("alpha-nan", dict(alpha=float("nan"))), ("alpha-1e400", dict(alpha=1e400)),
                             ("nested-targets", dict(target_modules=[["q_proj"]])),
                             ("deep-config", {})):
            path = write_adapter(folder / name, tiny, **config)
            if name == "deep-config":
                (path / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
            status, answer = await post(session, load, {"lora_name": name, "lora_path": str(path)})
            message = answer["error"]["message"] if isinstance(answer, dict) else answer
            check(status == 400, f"load adapter {name}", f"{status} {message[:120]}")
        huge = write_adapter(folder / "huge", tiny, scale=1e30)
        status, _ = await post(session, load, {"lora_name": "huge", "lora_path": str(huge)})
        check(status == 200, "load adapter of 1e30 weights (finite)", status)
        names = ["huge", model] * 6
        answers = await asyncio.gather(*(post(session, base + "/v1/completions", body(name))
                                         for name in names))
        base_ok = sum(1 for name, (status, data) in zip(names, answers, strict=True)
                      if name == model and status == 200 and data["choices"][0]["text"] == expected)
        huge_failed = sum(1 for name, (status, _) in zip(names, answers, strict=True)
                          if name == "huge" and status == 500)
        check(base_ok == 6 and huge_failed == 6, "1e30 adapter batched with base requests",
              f"base exact {base_ok}/6, its own failed alone {huge_failed}/6")
        await post(session, base + "/v1/unload_lora_adapter", {"lora_name": "huge"})
        after = [await post(session, base + "/v1/completions", body(model)) for _ in range(12)]
        exact = sum(1 for status, data in after
                    if status == 200 and data["choices"][0]["text"] == expected)
        check(exact == 12, "base requests after it is unloaded", f"{exact}/12 exact")
        missing = (await post(session, load, {"lora_name": "p1", "lora_path": "/nonexistent"}))[1]
        home = (await post(session, load, {"lora_name": "p2", "lora_path": str(folder)}))[1]
        one = [m["error"]["message"].split(": ", 1)[1] for m in (missing, home)]
        check(one[0] == one[1], "a missing path and an existing non-adapter path", one[0])
        good = write_adapter(folder / "good", tiny, seed=4)
        await post(session, load, {"lora_name": "good", "lora_path": str(good)})
        async with session.get(base + "/v1/models") as response:
            roots = [m["root"] for m in (await response.json())["data"] if m["parent"]]
        check(not any(str(folder) in root for root in roots), "/v1/models roots", roots)
        await post(session, base + "/v1/completions", body("good"))
        await post(session, base + "/v1/unload_lora_adapter", {"lora_name": "good"})
        async with session.get(base + "/metrics") as response:
            series = [line for line in (await response.text()).splitlines()
                      if line.startswith("kvledger_lora_requests_total{")]
        check(not series, "per-adapter series after unloading", series or "none left")
        deep = "[" * 5000 + "]" * 5000
        messages = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None, "tool_calls": [{
                        "id": "c1", "type": "function",
                        "function": {"name": "f", "arguments": deep}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
        chat = (await post(session, base + "/v1/chat/completions",
                           {"model": model, "messages": messages, "max_tokens": 2}))[0]
        tokenize = (await post(session, base + "/tokenize",
                               {"model": model, "messages": messages}))[0]
        check(chat < 500 and tokenize < 500, "past tool call arguments nested 5,000 deep",
              f"chat {chat}, /tokenize {tokenize}")
        loads = [asyncio.create_task(post(session, load, {
            "lora_name": f"hub{i}", "lora_path": f"hf://kvledger/stuck-{i}"})) for i in range(4)]
        await asyncio.sleep(0.5)
        started = time.perf_counter()
        await post(session, base + "/v1/completions", {**body(model), "user": "u" * 12_000})
        await post(session, base + "/tokenize", {"model": model, "prompt": "x " * 20_000})
        waited = time.perf_counter() - started
        check(waited < 2.0, "a completion and /tokenize while 4 hub adapter loads hang",
              f"{waited:.2f} s")
        for task in loads:
            task.cancel()


def plan_attacks(folder: Path, failed: list[str]) -> None:
    for name, model in hostile_headers(folder):
        run = subprocess.run([*KVLEDGER, "plan", "--model", str(model), "--device-memory",
                              "8GiB"], capture_output=True, text=True, timeout=120)
        lines = run.stderr.strip().splitlines()
        ok = run.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:")
        print(f"plan on a header {name}: exit {run.returncode}, {lines[-1][:120] if lines else ''}")
        if not ok:
            failed.append(f"plan on a header {name}: exit {run.returncode}, {len(lines)} lines")


def main() -> int:
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        subprocess.run([*KVLEDGER, "make-model", "tiny-llama", str(folder / "tiny")],
                       check=True, capture_output=True)
        hub, hub_socket = silent_hub()
        port = free_port()
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true", "HF_ENDPOINT": hub,
               "HF_HUB_OFFLINE": "0"}
        proc = subprocess.Popen([*KVLEDGER, "serve", "--model", str(folder / "tiny"),
                                 "--device", "cpu", "--port", str(port), "--enable-lora",
                                 "--max-loras", "2", "--max-model-len", "256",
                                 "--download-dir", str(folder / "hub-cache")],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            model = asyncio.run(wait_ready(base, proc))
            asyncio.run(attacks(base, model, folder, hub, failed))
        finally:
            proc.terminate()
            proc.wait(30)
            hub_socket.close()
        plan_attacks(folder, failed)
        tenant_attacks(KVLEDGER, folder, failed)
    asyncio.run(operator_attacks(failed))
    for failure in failed:
        print(f"hostile_isolation: FAILED: {failure}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
