"""Threads the operator hands blocking work to (hub reads, planning), from asyncio.

Three things a ``ThreadPoolExecutor`` does not do, and the operator needs:

- its queue is bounded: past ``max_waiting`` a job is turned away at once (``Busy``), so a
  flood of reviews is answered with a warning instead of piling up work nobody waits for;
- a job may say when it is no longer worth starting (``start_by``): one that would not start
  by then, as far as the jobs ahead of it tell (their count times the recent jobs' mean
  time), is turned away at once (``Busy``), and one whose time passed while it waited is
  dropped before it runs: a flood of reviews is answered as it comes, not all at once at
  its deadline;
- its threads are daemons, and ``close()`` drops what waits: at SIGTERM the process exits
  while a hub read hangs, where a ThreadPoolExecutor's threads are joined at exit (the
  operator took 82 s to exit with 12 hub reads queued, and Kubernetes kills it at 30).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class Busy(Exception):
    """As many jobs wait as may: this one is not queued."""


@dataclass
class _Job:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    call: Callable[[], Any]
    start_by: float | None


class Workers:
    """``threads`` daemon threads named ``name``, started as jobs come."""

    def __init__(self, name: str, threads: int, max_waiting: int) -> None:
        self.name, self.threads, self.max_waiting = name, threads, max_waiting
        self._jobs: collections.deque[_Job] = collections.deque()
        self._ready = threading.Condition()
        self._started = 0
        self._idle = 0
        self._closed = False
        self._mean_s = 0.0  # the recent jobs' time, a moving mean

    @property
    def waiting(self) -> int:
        return len(self._jobs)

    def submit(self, call: Callable[[], Any], *, start_by: float | None = None) -> asyncio.Future:
        """``call()`` on a thread; its result (or error) in the future. ``start_by``: a
        ``time.monotonic()`` past which it is not started (the future is cancelled).
        Busy when ``max_waiting`` jobs wait already; RuntimeError once closed."""
        loop = asyncio.get_running_loop()
        job = _Job(loop, loop.create_future(), call, start_by)
        with self._ready:
            if self._closed:
                raise RuntimeError(f"{self.name}: closed")
            ahead = len(self._jobs) - self._idle
            if ahead >= self.max_waiting:
                raise Busy()
            if start_by is not None and (time.monotonic() + max(0, ahead + 1) * self._mean_s
                                         / self.threads > start_by):
                raise Busy()
            self._jobs.append(job)
            if self._idle == 0 and self._started < self.threads:
                self._started += 1
                threading.Thread(target=self._work, name=f"{self.name}-{self._started}",
                                 daemon=True).start()
            self._ready.notify()
        return job.future

    def close(self) -> None:
        """Drop the jobs that wait (their futures cancelled); the threads end once their
        current job returns, and nothing waits for them."""
        with self._ready:
            self._closed = True
            jobs, self._jobs = list(self._jobs), collections.deque()
            self._ready.notify_all()
        for job in jobs:
            _settle(job, cancel=True)

    def _work(self) -> None:
        while True:
            with self._ready:
                self._idle += 1
                while not self._jobs and not self._closed:
                    self._ready.wait()
                self._idle -= 1
                if self._closed:
                    return
                job = self._jobs.popleft()
            if job.future.cancelled() or (job.start_by is not None
                                          and time.monotonic() > job.start_by):
                _settle(job, cancel=True)
                continue
            started = time.monotonic()
            try:
                result = job.call()
            except BaseException as exc:  # handed to whoever awaits the future
                _settle(job, error=exc)
            else:
                _settle(job, result=result)
            took = time.monotonic() - started
            with self._ready:
                self._mean_s = took if self._mean_s == 0 else 0.8 * self._mean_s + 0.2 * took
                hopeless = self._hopeless()
            for late in hopeless:
                _settle(late, cancel=True)

    def _hopeless(self) -> list[_Job]:
        """The waiting jobs that would not start by their ``start_by`` at the recent pace,
        taken out of the queue (under the lock): their waiters hear at once."""
        now, kept, dropped = time.monotonic(), collections.deque(), []
        for job in self._jobs:
            if job.start_by is not None and now + len(kept) * self._mean_s / self.threads > (
                    job.start_by):
                dropped.append(job)
            else:
                kept.append(job)
        self._jobs = kept
        return dropped


def _settle(job: _Job, *, result: Any = None, error: BaseException | None = None,
            cancel: bool = False) -> None:
    def settle() -> None:
        if job.future.done():
            return
        if cancel:
            job.future.cancel()
        elif error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits it any more
        job.loop.call_soon_threadsafe(settle)
