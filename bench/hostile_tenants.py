"""The tenants' half of ``bench/hostile_isolation.py``: a live ``kvledger serve`` with a
tenants file and a gateway's header believed from 127.0.0.1 (this script is the gateway),
under ``--scheduling-policy priority``, and the requests a client behind that gateway
would send to get a tier it does not hold:

- the gateway's header followed by one of the client's (``gold``, then ``silver``): a 400
  naming the header, never either tenant;
- a case variant of a listed name (``Gold``) and a name the file does not list, each asking
  priority -1000: held to the listed tenant's floor, and to the lowest tier's;
- a tenants file naming a tenant ``key-0``, the name the server gives ``--api-key``'s
  first key: refused at start, one line naming it.
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


def serve(kvledger: list[str], folder: Path, tenants: str, port: int) -> subprocess.Popen:
    """``kvledger serve`` of tiny-llama with ``tenants``; its stderr in ``serve-PORT.log``."""
    path = folder / f"tenants-{port}.yaml"
    path.write_text(tenants)
    log = (folder / f"serve-{port}.log").open("w")
    return subprocess.Popen([*kvledger, "serve", "--model", str(folder / "tiny"), "--device",
                             "cpu", "--port", str(port), "--max-model-len", "256",
                             "--api-key", "sk-plain", "--tenants-file", str(path),
                             "--tenant-header", HEADER, "--tenant-header-from", "127.0.0.1/32",
                             "--scheduling-policy", "priority"],
                            stdout=subprocess.DEVNULL, stderr=log)


async def _complete(session, base: str, model: str, key: str, headers: list[tuple[str, str]],
                    priority: int) -> tuple[int, str]:
    sent = CIMultiDict([("Authorization", f"Bearer {key}"), *headers])
    async with session.post(base + "/v1/completions", headers=sent, json={
            "model": model, "prompt": "Once upon a time", "max_tokens": 2,
            "priority": priority}) as response:
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


def tenant_attacks(kvledger: list[str], folder: Path, failed: list[str]) -> None:
    port = free_port()
    proc = serve(kvledger, folder, TENANTS, port)
    base = f"http://127.0.0.1:{port}"
    try:
        model = asyncio.run(wait_ready(base, proc))
        asyncio.run(header_attacks(base, model, failed))
    finally:
        proc.terminate()
        proc.wait(30)
    colliding_file(kvledger, folder, failed)


if __name__ == "__main__":
    sys.exit("run bench/hostile_isolation.py")
