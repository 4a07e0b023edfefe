"""One submission on its way through the engine: its prompts admitted in turn, each
prompt's choices handed to the engine as soon as it is (so a batch never holds blocks idle
while a later prompt waits in line; a refusal of one aborts those started), then every
choice's outputs as they come. ``aclose`` ends it whatever happened: the engine releases
the reservations it was handed (closing a stream aborts an unfinished request), admission
takes back those it never was, and forgets the tickets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kvledger.engine.frontend.submission import PromptRun, Tenant
from kvledger.engine.kv.block_pool import Salt

if TYPE_CHECKING:
    from kvledger.engine.admission.line import Admission
    from kvledger.engine.core.async_engine import AsyncEngine


class Generation:
    """Iterate it for ``(choice index, RequestOutput)``; choice ``k`` answers prompt
    ``k // n``. After ``aclose``: ``finish_reasons`` (``"abort"`` for a choice that did
    not finish) and ``choice_tokens`` (the tokens each choice generated)."""

    def __init__(self, admission: Admission, driver: AsyncEngine, block_size: int,
                 request_id: str, runs: list[PromptRun], n: int, tenant: Tenant) -> None:
        self.request_id = request_id
        self.runs = runs
        self.n = n
        self.tenant = tenant
        self.finish_reasons: list[str] = []
        self.choice_tokens: list[int] = []
        self._admission = admission
        self._driver = driver
        self._block_size = block_size
        self._streams: list[Any] = []
        self._merged: AsyncIterator[tuple[int, Any]] | None = None
        self._closed = False

    @property
    def num_choices(self) -> int:
        return len(self.runs) * self.n

    @property
    def generated_tokens(self) -> int:
        """Every choice's generated tokens (after ``aclose``)."""
        return sum(self.choice_tokens)

    @property
    def prompt_tokens(self) -> int:
        """Every prompt's tokens, once each (not once per choice), as vLLM's usage counts."""
        return sum(len(run.prompt_ids) for run in self.runs)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache when the prompts were admitted."""
        return sum(min(run.num_cached_blocks * self._block_size, len(run.prompt_ids))
                   for run in self.runs)

    async def admit(self, salt: Salt | None, priority: int) -> None:
        """Each prompt's ticket from the door's line, its choices handed to the engine."""
        rid = self.request_id
        for i, run in enumerate(self.runs):  # admission keys each prompt's ticket apart
            first = run.choices[0]
            run.ticket = await self._admission.admit(
                rid if len(self.runs) == 1 else f"{rid}-prompt{i}", len(run.prompt_ids),
                first.cap_tokens, self.n, prompt_token_ids=run.prompt_ids,
                use_cached=first.uses_cached_blocks, salt=salt, adapter=first.lora,
                tenant=self.tenant, priority=priority)
            for j, reservation in enumerate(run.ticket.reservations):
                choice_id = rid if self.num_choices == 1 else f"{rid}-{len(self._streams)}"
                run.handed = j + 1  # from this call on the engine owns it, even if it refuses it
                self._streams.append(self._driver.generate(choice_id, run.choices[j],
                                                           reservation=reservation))

    def progress(self, counts: list[int]) -> None:
        """Each prompt's ticket told how far its choices have got (``counts``: each
        choice's tokens), for the line's estimates of when blocks come back."""
        n, admission = self.n, self._admission
        for i, run in enumerate(self.runs):
            admission.progress(run.ticket, min(counts[i * n:(i + 1) * n]))

    def __aiter__(self) -> AsyncIterator[tuple[int, Any]]:
        if self._merged is None:
            self._merged = _merged(self._streams)
        return self._merged

    async def aclose(self) -> None:
        """End it: unfinished choices aborted, every reservation back, tickets forgotten."""
        if self._closed:
            return
        self._closed = True
        admission = self._admission
        if self._merged is not None:
            await self._merged.aclose()
        for run in self.runs:  # the engine releases what it was handed
            if run.ticket is not None:
                admission.give_back(run.ticket.reservations[run.handed:])
        for stream in self._streams:
            await stream.aclose()
            last = stream.last
            self.finish_reasons.append(last.finish_reason if last is not None and last.finished
                                       else "abort")
            self.choice_tokens.append(len(last.token_ids) if last else 0)
        for run in self.runs:
            if run.ticket is not None:
                admission.done(run.ticket)


async def _merged(streams: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    """``(choice index, output)`` from every choice's stream as they come."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as exc:  # the engine died: the merged stream raises it
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
