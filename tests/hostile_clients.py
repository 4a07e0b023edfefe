"""What a hostile client of the webhook does and sees, for tests/operator/ and
bench/hostile_cluster.py: TLS or bare TCP connections opened and held, whether the server
closed them or what status it sent; and the operator's memory and exit, from /proc."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading

from webhook_harness import SERVER_NAME


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Peak:
    """The highest resident memory of ``pid`` while the block runs (sampled every 20 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.mib, self._stop = pid, rss_mib(pid), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            with contextlib.suppress(OSError):
                self.mib = max(self.mib, rss_mib(self.pid))

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def open_tls(port: int, trust: ssl.SSLContext) -> tuple | None:
    try:
        return await asyncio.wait_for(asyncio.open_connection(
            "127.0.0.1", port, ssl=trust, server_hostname=SERVER_NAME), 20)
    except (TimeoutError, OSError, ssl.SSLError):
        return None


async def open_tcp(port: int) -> tuple | None:
    try:
        return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
    except (TimeoutError, OSError):
        return None


async def still_open(streams: list[tuple]) -> int:
    """How many of ``streams`` the server has not closed (nothing to read, no EOF)."""
    async def open_one(reader: asyncio.StreamReader) -> bool:
        try:
            return bool(await asyncio.wait_for(reader.read(1), 0.05)) or False
        except TimeoutError:
            return True
        except OSError:
            return False

    return sum(await asyncio.gather(*(open_one(r) for r, _ in streams)))


async def status_of(streams: list[tuple]) -> dict[str, int]:
    """What each connection got: its status line's code, "closed", or "open"."""
    async def one(reader: asyncio.StreamReader) -> str:
        try:
            line = await asyncio.wait_for(reader.readline(), 0.05)
        except TimeoutError:
            return "open"
        except OSError:
            return "closed"
        return line.split()[1].decode() if line.startswith(b"HTTP/1.1") else "closed"

    seen: dict[str, int] = {}
    for got in await asyncio.gather(*(one(r) for r, _ in streams)):
        seen[got] = seen.get(got, 0) + 1
    return seen


def close_all(streams: list[tuple]) -> None:
    for _, writer in streams:
        writer.transport.abort()


def exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def exchange(port: int, trust: ssl.SSLContext, data: bytes,
                   wait_s: float = 15.0) -> tuple[int | None, str]:
    """Send ``data`` (a request as written, whole or not) on a new TLS connection and read
    what comes back within ``wait_s``: ``(status, body)``, status None when nothing did."""
    streams = await open_tls(port, trust)
    assert streams is not None, "the webhook did not take the connection"
    reader, writer = streams
    try:
        writer.write(data)
        await writer.drain()
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), wait_s)
        except (TimeoutError, asyncio.IncompleteReadError, OSError):
            return None, ""
        status = int(head.split()[1])
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await asyncio.wait_for(reader.readexactly(length), wait_s) if length else b""
        return status, body.decode(errors="replace")
    finally:
        writer.transport.abort()


def post_head(length: int | None, path: str = "/validate") -> bytes:
    """An HTTP/1.1 POST's head, with this Content-Length (or chunked, when None)."""
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST {path} HTTP/1.1\r\nHost: {SERVER_NAME}\r\nContent-Type: application/json"
            f"\r\n{size}\r\n\r\n").encode()
