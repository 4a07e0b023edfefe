"""Where a request's heavy preparation runs, off the event loop: parsing, rendering and
tokenizing on a few worker threads (inline when the body is small), LoRA adapters read on
daemon threads of their own, at most ``ADAPTER_THREADS`` at once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

R = TypeVar("R")

# Parsing, rendering and tokenizing a body this small takes well under a millisecond:
# less than handing it to a worker thread and back.
INLINE_BODY_BYTES = 8 * 1024
# Threads that parse bodies, render chat templates and tokenize, off the event loop.
PREPARE_THREADS = 4
# Threads that read LoRA adapters (from disk, or a hub that may be slow or never answer):
# their own, at most this many, so a stuck adapter load never holds up parsing and
# tokenizing; daemon threads, so one stuck until --hub-timeout never holds up shutdown.
ADAPTER_THREADS = 2


class Offload:
    """The threads a server prepares requests on (``run``) and reads adapters on
    (``load_adapter``); ``close`` drops queued work."""

    def __init__(self) -> None:
        self._workers = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="kvledger-prepare")
        self._adapter_threads: asyncio.Semaphore | None = None  # made on the loop

    async def run(self, body_bytes: int | None, fn: Callable[..., R], *args: object) -> R:
        """``fn(*args)`` for a request of ``body_bytes``: on a worker thread when the body
        is large (or ``None``: work whose cost the body's size does not bound). Parsing a
        4 MiB body, rendering a chat and tokenizing take up to seconds of CPU, during which
        ``/health`` and every stream must still answer; the GIL is shared, so what runs
        there should release it (tokenizers' batch encode, numpy) or be bounded. A body up
        to ``INLINE_BODY_BYTES`` costs less than the trip to a thread and back, so it is
        done on the loop."""
        if body_bytes is not None and body_bytes <= INLINE_BODY_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn, *args)

    async def load_adapter(self, fn: Callable[..., R], *args: object) -> R:
        """``fn(*args)`` that reads a LoRA adapter, on a daemon thread of its own, at most
        ``ADAPTER_THREADS`` at once. A thread keeps its place until ``fn`` returns, even
        when the request that started it is gone."""
        loop = asyncio.get_running_loop()
        if self._adapter_threads is None:
            self._adapter_threads = asyncio.Semaphore(ADAPTER_THREADS)
        threads = self._adapter_threads
        await threads.acquire()
        future = loop.create_future()

        def settle(ok: bool, value) -> None:
            threads.release()
            if not future.done():
                (future.set_result if ok else future.set_exception)(value)

        def run() -> None:
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the awaiting request, as an executor would
                loop.call_soon_threadsafe(settle, False, exc)
            else:
                loop.call_soon_threadsafe(settle, True, result)

        threading.Thread(target=run, name="kvledger-adapter", daemon=True).start()
        return await future

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)
