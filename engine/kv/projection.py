"""The pool's blocks over the engine steps ahead, and the soonest step a waiting request
could start in them: the plan behind backfilling the admission line (``--backfill``).

The projection is admission's own: every request writes a token a step until its cap
and then releases. Over-committing (``--admission safe``) a request from ``tokens``
written holds ``blocks_for(tokens + t + 1)`` blocks at step ``t`` (``safety.peak_blocks``,
less those it holds with another), and a new one may start where the sum stays within the
pool at every step of its life; reserving, a request holds its whole reservation until
it releases. Requests that stop early, or blocks that come back sooner, only leave more
room than projected.

Each step's holdings are a sum of step functions, kept as (step, change) events, so a
projection costs O(events + horizon) whatever the context length. The soonest start of a
request of ``life`` steps is the first ``s`` that no step ``u`` forbids: holding ``L(u)``
blocks at ``u``, a request from ``tokens`` written holds ``p0 + (u - s + r) // bs`` there
(``p0 = tokens // bs + 1``, ``r = tokens % bs``), within the pool iff ``(u - s + r) // bs
<= K(u) = (num_blocks - L(u)) // count - p0``. So ``u`` forbids the starts ``s`` in
``(u - life, u + r - (K(u) + 1) * bs]`` (all of ``(u - life, u]`` when ``K(u) < 0``): one
interval per step, their union marked in one pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class Projection:
    """Blocks held at each step from now (step 0 is the engine's next), as ``add_growing``,
    ``add_flat`` and ``place`` describe them; ``held_beyond``: blocks no projected
    request gives back. ``grows``: a new request is projected as over-committed (drawing
    as it writes), else as reserving."""

    def __init__(self, num_blocks: int, block_size: int, *, grows: bool,
                 held_beyond: int = 0) -> None:
        self.num_blocks = num_blocks
        self.grows = grows  # over-committing: requests draw as they write
        self.block_size = block_size
        self.held_beyond = held_beyond
        self._changes = np.zeros(0, dtype=np.int64)  # at each step: blocks held minus before

    def add_growing(self, timelines: Iterable[Sequence[int]], start: int = 0) -> None:
        """Requests writing a token a step from step ``start``: ``(tokens, total, less)``
        each, as ``Overcommit.live`` keeps them (``less`` blocks held with another)."""
        spans = np.asarray([tuple(t) for t in timelines], dtype=np.int64).reshape(-1, 3)
        if not len(spans):
            return
        bs = self.block_size
        total, less = spans[:, 1], spans[:, 2]
        tokens = np.minimum(spans[:, 0], total - 1)  # one at its cap writes a last token
        crossings = (total - 1) // bs - tokens // bs  # blocks drawn after the first step
        first_draw = start + (tokens // bs + 1) * bs - tokens  # the step of the first one
        within = np.arange(crossings.sum()) - np.repeat(np.cumsum(crossings) - crossings,
                                                        crossings)
        self._change([np.full(len(spans), start), np.repeat(first_draw, crossings) + within * bs,
                      start + total - tokens],
                     [tokens // bs + 1 - less, np.ones(int(crossings.sum()), dtype=np.int64),
                      less - (total - 1) // bs - 1])

    def add_flat(self, blocks: Iterable[int], lives: Iterable[int], start: int = 0) -> None:
        """Requests holding ``blocks`` each from step ``start`` for ``lives`` steps."""
        held = np.asarray(list(blocks), dtype=np.int64)
        self._change([np.full(len(held), start), start + np.asarray(list(lives), dtype=np.int64)],
                     [held, -held])

    def _change(self, steps: list[np.ndarray], changes: list[np.ndarray]) -> None:
        at = np.concatenate(steps)
        if not len(at):
            return
        end = max(int(at.max()) + 1, len(self._changes))
        added = np.bincount(at, np.concatenate(changes), minlength=end).round().astype(np.int64)
        added[:len(self._changes)] += self._changes
        self._changes = added

    def holdings(self) -> np.ndarray:
        """Blocks held at each step until the last projected change (then ``held_beyond``)."""
        return self.held_beyond + np.cumsum(self._changes)[:-1]

    def soonest_start(self, prompt: int, total: int, count: int = 1, blocks: int = 0) -> int | None:
        """The soonest step a request of ``count`` choices from ``prompt`` to ``total``
        tokens could start; None if never. Reserving (``grows`` False) it holds its
        ``blocks`` from the start, else each choice writes a token a step."""
        life = _life(prompt, total)
        held = self.holdings()
        steps = np.arange(len(held))
        if not self.grows:
            if self.held_beyond + blocks > self.num_blocks:
                return None
            over = held + blocks > self.num_blocks
            return _first_allowed(steps - life + 1, np.where(over, steps, -1))
        bs, tokens = self.block_size, min(prompt, total - 1)
        if self.held_beyond + count * ((total - 1) // bs + 1) > self.num_blocks:
            return None
        fits = (self.num_blocks - held) // count - (tokens // bs + 1)  # K(u) in the docstring
        highs = np.minimum(steps, steps + tokens % bs - (fits + 1) * bs)
        return _first_allowed(steps - life + 1, highs)

    def place(self, start: int, prompt: int, total: int, count: int = 1, blocks: int = 0) -> None:
        """Project the request ``soonest_start`` describes as starting at step ``start``."""
        if self.grows:
            self.add_growing([(prompt, total, 0)] * count, start)
        else:
            self.add_flat([blocks], [_life(prompt, total)], start)


def _life(prompt: int, total: int) -> int:
    """Steps a request from ``prompt`` tokens to ``total`` lives (one at its cap: one)."""
    return total - min(prompt, total - 1)


def _first_allowed(lows: np.ndarray, highs: np.ndarray) -> int:
    """The least step >= 0 outside every interval ``[low, high]`` (empty when high < low)."""
    lows = np.maximum(lows, 0)
    keep = highs >= lows
    lows, highs = lows[keep], highs[keep]
    if not len(lows):
        return 0
    end = int(highs.max()) + 2
    marks = np.bincount(lows, minlength=end) - np.bincount(highs + 1, minlength=end)
    return int(np.argmax(np.cumsum(marks) == 0))
