"""Counting the bytes a piece of torch code holds at its peak on the CPU, which keeps no
allocator statistics: what the planner's estimates are held to where CI runs."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors made inside it (each storage counted once,
    while any tensor made here still refers to it): what an allocator's peak would show
    above what existed before."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors holding it]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                self._hold(t)
        return out

    def _hold(self, t: torch.Tensor) -> None:
        key = t.untyped_storage().data_ptr()
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [t.untyped_storage().nbytes(), 0]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]
