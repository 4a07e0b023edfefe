"""What one hostile example may cost whoever reads it: a block's time and traced peak
memory, stopped by an alarm when it runs away (the fuzz tests' shared guard)."""

from __future__ import annotations

import signal
import sys
import threading
import time
import tracemalloc
from typing import Any


class TooSlow(Exception):
    """The alarm stopped an example at its hard stop."""


class Budget:
    """The block's time (``seconds``) and traced peak memory (``peak_bytes``). In the main
    thread an alarm raises TooSlow from ``hard_stop_s`` on, every ``repeat_s`` until the
    block ends (a hostile number can loop for minutes, its memory growing all along, and an
    exception raised in a weakref callback is swallowed); an alarm already set
    (pytest-timeout's) is put back after, less the time spent. With ``recursion_limit`` the
    block runs at that limit (the process's own, where a test library raised it)."""

    def __init__(self, hard_stop_s: float, repeat_s: float,
                 recursion_limit: int | None = None) -> None:
        self.hard_stop_s, self.repeat_s = hard_stop_s, repeat_s
        self.recursion_limit = recursion_limit
        self.seconds = 0.0
        self.peak_bytes = 0
        self._active = False

    def __enter__(self) -> Budget:
        self._alarm = threading.current_thread() is threading.main_thread()
        if self._alarm:
            self._handler = signal.signal(signal.SIGALRM, self._stop)
            self._previous = signal.setitimer(signal.ITIMER_REAL, self.hard_stop_s,
                                              self.repeat_s)
        self._tracing = tracemalloc.is_tracing()
        if not self._tracing:
            tracemalloc.start()
        tracemalloc.reset_peak()
        self._base = tracemalloc.get_traced_memory()[0]
        self._limit = sys.getrecursionlimit()
        if self.recursion_limit is not None:
            sys.setrecursionlimit(self.recursion_limit)
        self._active = True
        self._start = time.perf_counter()
        return self

    def _stop(self, signum: int, frame: Any) -> None:
        if self._active and (frame is None or frame.f_code is not Budget.__exit__.__code__):
            raise TooSlow(f"stopped after {time.perf_counter() - self._start:.1f} s")

    def __exit__(self, *exc: object) -> None:
        self._active = False
        self.seconds = time.perf_counter() - self._start
        sys.setrecursionlimit(self._limit)
        if self._alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._handler)
            if self._previous[0] > 0:
                signal.setitimer(signal.ITIMER_REAL,
                                 max(self._previous[0] - self.seconds, 1e-3), self._previous[1])
        self.peak_bytes = tracemalloc.get_traced_memory()[1] - self._base
        if not self._tracing:
            tracemalloc.stop()
