"""Sleep mode at the front door: nothing admitted is dropped, nothing new gets in.

``sleep(level)`` first closes the door to new requests (each gets ``EngineSleeping``: HTTP
503 with a Retry-After of the predicted wake time), then waits for every request already
inside (being checked, in line, or running) to finish, then frees the memory
(``core/sleep.py``) on a worker thread while the engine's loop is idle. ``wake(tags)``
takes it back and opens the door. vLLM's default (``mode=abort``) aborts what runs;
kvledger never drops an admitted request, so ``abort`` is refused and ``wait`` (or
``keep``) is what happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from kvledger.engine.core.sleep import Sleep
from kvledger.engine.errors import BadInput, EngineSleeping

if TYPE_CHECKING:
    from kvledger.engine.core.engine import LLMEngine

MODES = ("wait", "keep")  # vLLM's PauseModes kvledger honours; "abort" drops requests
_POLL_S = 0.02


class SleepGate:
    """Whether requests may enter, and the engine's sleep behind it."""

    def __init__(self, engine: LLMEngine, busy: Callable[[], bool]) -> None:
        """``busy``: whether any admitted request is still running or in line."""
        plan = engine.plan
        self.sleep_state = Sleep(engine.runner, engine.ledger,
                                 plan.classes["weights"] if plan is not None else 0)
        self._engine = engine
        self._busy = busy
        self._closed: int | None = None  # the level being slept to (None: open)
        self._waking = False
        self._inside = 0  # submissions past the gate, not yet admitted or refused
        self._lock = asyncio.Lock()  # one sleep or wake at a time

    @property
    def level(self) -> int | None:
        """The level asleep at, or being slept to; None when awake."""
        return self._closed

    @property
    def is_sleeping(self) -> bool:
        return self._closed is not None

    @contextlib.contextmanager
    def entry(self) -> Iterator[None]:
        """Around a submission: EngineSleeping when the door is closed, else counted
        inside until it is admitted or refused."""
        if self._closed is not None:
            raise EngineSleeping(self._closed, self.retry_after_s(), waking=self._waking)
        self._inside += 1
        try:
            yield
        finally:
            self._inside -= 1

    def retry_after_s(self) -> float:
        """Seconds until a request could be taken: the predicted wake (at least 1)."""
        return max(1.0, math.ceil(self.sleep_state.predicted_wake_s()))

    async def sleep(self, level: int, mode: str | None = None) -> float:
        """Close the door, let everything inside finish, free ``level``'s memory; the
        seconds the freeing took (not the wait before it)."""
        if mode is not None and mode not in MODES:
            raise BadInput(f"mode={mode}: kvledger never drops an admitted request; sleep "
                           "waits for them (mode=wait)", param="mode")
        if level not in (0, 1, 2):
            raise BadInput(f"level={level}: vLLM's sleep levels are 0, 1 and 2", param="level")
        async with self._lock:
            if self._closed is not None:
                raise BadInput(f"the engine is asleep already (level {self._closed}); "
                               "POST /wake_up first", param="level")
            self._closed = level
            while self._inside or self._busy() or self._engine.has_unfinished_requests():
                await asyncio.sleep(_POLL_S)
            # A failure half-way leaves the door closed: wake() puts back what was freed.
            return await asyncio.to_thread(self.sleep_state.sleep, level)

    async def wake(self, tags: list[str] | None = None) -> bool:
        """Take back what ``tags`` name (None: all); True, and the door open, once awake."""
        async with self._lock:
            if self._closed is None:
                return True
            self._waking = True
            try:
                awake = await asyncio.to_thread(self.sleep_state.wake, tags)
            finally:
                self._waking = False
            if awake:
                self._closed = None
            return awake
