"""The tenants' half of ``bench/hostile_isolation.py``: a live ``kvledger serve`` with a
tenants file and a gateway's header believed from 127.0.0.1 (this script is the gateway),
under ``--scheduling-policy priority``, and the requests a client behind that gateway
would send to get a tier it does not hold:

- the gateway's header followed by one of the client's (``gold``, then ``silver``): a 400
  naming the header, never either tenant;
- a case variant of a listed name (``Gold``) and a name the file does not list, each asking
  priority -1000: held to the listed tenant's floor, and to the lowest tier's;
- a tenants file naming a tenant ``key-0``, the name the server gives ``--api-key``'s
  first key: refused at start, one line naming it;
- tenants named by the header alone (no keys), a request that leaves the header out, at
  priority -1000: held to the lowest tier, as an unlisted name is;
- the gateway's InferenceObjective header naming the most urgent objective (priority 100):
  a key the file does not list goes ahead of the line, as the objective says, but tenant
  silver (floor 10) is held to its floor and waits behind gold's request at 0; the header
  twice is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp
from local_server import free_port, wait_ready
from multidict import CIMultiDict

HEADER = "x-kvledger-tenant"
OBJECTIVE = "x-gateway-inference-objective"
OBJECTIVES = "objectives:\n  - name: critical\n    priority: 100\n"
TENANTS = """tenants:
  - name: gold
    keys: [sk-gold]
  - name: silver
    keys: [sk-silver]
    priority: 10
    minPriority: 10
"""
# The same, plus a tenant whose name is the one --api-key's first key is shown as.
COLLIDING = TENANTS + """  - name: key-0
    keys: [sk-file]
    priority: 50
    minPriority: 50
"""


def serve(kvledger: list[str], folder: Path, tenants: str, port: int,
          api_key: bool = True) -> subprocess.Popen:
    """``kvledger serve`` of tiny-llama with ``tenants`` (and ``--api-key sk-plain``, unless
    ``api_key`` is False: tenants named by the header alone); its stderr in
    ``serve-PORT.log``."""
    path = folder / f"tenants-{port}.yaml"
    path.write_text(tenants)
    objectives = folder / f"objectives-{port}.yaml"
    objectives.write_text(OBJECTIVES)
    log = (folder / f"serve-{port}.log").open("w")
    return subprocess.Popen([*kvledger, "serve", "--model", str(folder / "tiny"), "--device",
                             "cpu", "--port", str(port), "--max-model-len", "256",
                             # 16 blocks of 16: a 150-token answer runs alone, the rest wait
                             # in line, whose order the finishing order shows
                             "--num-gpu-blocks-override", "16",
                             *(["--api-key", "sk-plain"] if api_key else []),
                             "--tenants-file", str(path),
                             "--tenant-header", HEADER, "--tenant-header-from", "127.0.0.1/32",
                             "--objective-header", OBJECTIVE, "--objectives-file",
                             str(objectives), "--scheduling-policy", "priority"],
                            stdout=subprocess.DEVNULL, stderr=log)


async def _complete(session, base: str, model: str, key: str, headers: list[tuple[str, str]],
                    priority: int | None, max_tokens: int = 2) -> tuple[int, str]:
    sent = CIMultiDict([("Authorization", f"Bearer {key}"), *headers])
    asked = {} if priority is None else {"priority": priority}
    async with session.post(base + "/v1/completions", headers=sent, json={
            "model": model, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, **asked}) as response:
        body = await response.json(content_type=None)
        message = body["error"]["message"] if response.status != 200 else "admitted"
        return response.status, message


async def header_attacks(base: str, model: str, failed: list[str]) -> None:
    def check(ok: bool, what: str, got: object) -> None:
        print(f"tenants, {what}: {got}")
        if not ok:
            failed.append(f"tenants, {what}: {got}")

    async with aiohttp.ClientSession() as session:
        status, message = await _complete(session, base, model, "sk-silver",
                                          [(HEADER, "gold"), (HEADER, "silver")], 0)
        check(status == 400 and HEADER in message,
              "two tenant headers (gold, then silver) at priority 0", f"{status} {message[:110]}")
        for name, floor in (("Gold", "gold"), ("stranger", "the lowest tier")):
            status, message = await _complete(session, base, model, "sk-silver",
                                              [(HEADER, name)], -1000)
            check(status == 400, f"header {name!r} at priority -1000 (floor: {floor})",
                  f"{status} {message[:110]}")


async def _waiting(session, base: str, count: int) -> None:
    """Until the line holds ``count`` requests (``kvledger_requests_waiting``)."""
    for _ in range(300):
        async with session.get(base + "/metrics") as response:
            text = await response.text()
        for line in text.splitlines():
            if line.startswith("kvledger_requests_waiting ") and float(line.split()[1]) >= count:
                return
        await asyncio.sleep(0.02)
    sys.exit(f"the line never held {count} requests")


async def objective_attacks(base: str, model: str, failed: list[str]) -> None:
    """Room for one answer of 200 tokens: four of gold's plain requests (priority 0), one
    runs and three wait; then silver's and --api-key's, each naming the objective of
    priority 100 (this server's -100)."""
    def check(ok: bool, what: str, got: object) -> None:
        print(f"objectives, {what}: {got}")
        if not ok:
            failed.append(f"objectives, {what}: {got}")

    finished: list[str] = []

    async def send(session, name: str, key: str, headers):
        status, message = await _complete(session, base, model, key, headers, None, 200)
        finished.append(name)
        return status, message

    async with aiohttp.ClientSession() as session:
        status, message = await _complete(session, base, model, "sk-plain",
                                          [(OBJECTIVE, "critical"), (OBJECTIVE, "critical")],
                                          None)
        check(status == 400 and OBJECTIVE in message, "the objective header twice",
              f"{status} {message[:90]}")
        golds = [asyncio.create_task(send(session, f"gold {i}", "sk-gold", []))
                 for i in range(4)]
        await _waiting(session, base, 3)
        silver = asyncio.create_task(send(session, "silver+critical", "sk-silver",
                                          [(OBJECTIVE, "critical")]))
        await _waiting(session, base, 4)
        plain = asyncio.create_task(send(session, "key-0+critical", "sk-plain",
                                         [(OBJECTIVE, "critical")]))
        await _waiting(session, base, 5)
        answers = await asyncio.gather(*golds, silver, plain)
    check(all(status == 200 for status, _ in answers), "every request answered",
          [status for status, _ in answers])
    check(finished.index("key-0+critical") <= 1,
          "--api-key's key (no floor) naming critical: next once the running one ends",
          finished)
    check(finished[-1] == "silver+critical",
          "silver (floor 10) naming critical: held to its floor, after gold's three at 0",
          finished)


async def _started(base: str, proc: subprocess.Popen) -> str | None:
    """The served model's name once ``/ready`` answers, None when serve exits first."""
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            if proc.poll() is not None:
                return None
            try:
                async with session.get(base + "/ready") as response:
                    if response.status == 200:
                        return (await response.json())["model"]
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    sys.exit("serve neither exited nor became ready")


def colliding_file(kvledger: list[str], folder: Path, failed: list[str]) -> None:
    """A file tenant named key-0 beside --api-key: the server must refuse the file (before,
    the first --api-key key ran under that tenant's priority floor and metrics)."""
    port = free_port()
    proc = serve(kvledger, folder, COLLIDING, port)
    base = f"http://127.0.0.1:{port}"
    try:
        model = asyncio.run(_started(base, proc))
        if model is not None:  # it started: what does --api-key's first key get?

            async def plain() -> tuple[int, str]:
                async with aiohttp.ClientSession() as session:
                    return await _complete(session, base, model, "sk-plain", [], 0)

            status, message = asyncio.run(plain())
            print(f"tenants, a file tenant named key-0: served; --api-key's first key at "
                  f"priority 0: {status} {message[:100]}")
            failed.append("tenants, a file tenant named key-0: the server started")
            return
        lines = (folder / f"serve-{port}.log").read_text().strip().splitlines()
        print(f"tenants, a file tenant named key-0: exit {proc.returncode}, "
              f"{lines[-1][:120] if lines else ''}")
        if proc.returncode != 2 or len(lines) != 1 or "key-0" not in lines[0]:
            failed.append(f"tenants, a file tenant named key-0: exit {proc.returncode}, "
                          f"{len(lines)} lines")
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


HEADER_ONLY = "tenants:\n  - name: gold\n  - name: silver\n    priority: 10\n    minPriority: 10\n"


def no_header(kvledger: list[str], folder: Path, failed: list[str]) -> None:
    """Tenants the header alone names: a request without it is anonymous, which must not
    be a way around the file's floors."""
    port = free_port()
    proc = serve(kvledger, folder, HEADER_ONLY, port, api_key=False)
    base = f"http://127.0.0.1:{port}"
    try:
        model = asyncio.run(wait_ready(base, proc))

        async def bare() -> tuple[int, str]:
            async with aiohttp.ClientSession() as session, session.post(
                    base + "/v1/completions", json={"model": model, "prompt": "Once upon",
                                                    "max_tokens": 2, "priority": -1000}) as r:
                body = await r.json(content_type=None)
                return r.status, body["error"]["message"] if r.status != 200 else "admitted"

        status, message = asyncio.run(bare())
        print(f"tenants, no header and no key at priority -1000 (floor: the lowest tier): "
              f"{status} {message[:100]}")
        if status != 400:
            failed.append(f"tenants, no header at priority -1000: {status} {message[:100]}")
    finally:
        proc.terminate()
        proc.wait(30)


def tenant_attacks(kvledger: list[str], folder: Path, failed: list[str]) -> None:
    port = free_port()
    proc = serve(kvledger, folder, TENANTS, port)
    base = f"http://127.0.0.1:{port}"
    try:
        model = asyncio.run(wait_ready(base, proc))
        asyncio.run(header_attacks(base, model, failed))
        asyncio.run(objective_attacks(base, model, failed))
    finally:
        proc.terminate()
        proc.wait(30)
    colliding_file(kvledger, folder, failed)
    no_header(kvledger, folder, failed)


if __name__ == "__main__":
    sys.exit("run bench/hostile_isolation.py")
