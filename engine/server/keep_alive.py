"""vLLM's ``--sse-keep-alive-interval``: an SSE comment line (``: keep-alive``) on a
streamed completion or chat whenever no event has gone out for that many seconds, so a
proxy or tunnel with a read timeout does not cut an answer that is still prefilling or
between tokens (vLLM 0.32's ``with_sse_keep_alive``). Clients' SSE readers skip comments.

The stream's headers go out once the request is admitted: while it waits in line nothing
is sent, because its answer may still be a 429 (``--max-queue-wait``, a full line).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

KEEP_ALIVE = b": keep-alive\n\n"


async def kept_alive(outputs: AsyncIterable[Any], interval_s: float,
                     write: Callable[[bytes], Awaitable[None]]) -> AsyncIterator[Any]:
    """``outputs``' items, as they come; each ``interval_s`` without one, ``write`` sends a
    keep-alive comment. One pending ``__anext__`` at a time, never cancelled while items
    come (a timeout only looks at it); cancelled when the stream ends early, before the
    generation it reads is closed (``aclose``)."""
    items = aiter(outputs)
    pending = asyncio.ensure_future(anext(items))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                await write(KEEP_ALIVE)
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(anext(items))
    finally:
        pending.cancel()
