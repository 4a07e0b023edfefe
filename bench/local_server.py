"""What the benchmarks that start their own ``kvledger serve`` share: a free port on
127.0.0.1 and waiting for ``/ready``."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_ready(base: str, proc: subprocess.Popen) -> str:
    """The served model's name once ``/ready`` answers 200; exits if serve dies or never does."""
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            if proc.poll() is not None:
                sys.exit(f"serve exited with {proc.returncode}")
            try:
                async with session.get(base + "/ready") as response:
                    if response.status == 200:
                        return (await response.json())["model"]
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    sys.exit("serve never became ready")
