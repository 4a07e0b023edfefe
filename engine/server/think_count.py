"""vLLM's ``reasoning_tokens`` under the think-tag base rule (deepseek_r1): the output
tokens between a ``<think>`` and its ``</think>``, counted as an answer's ids grow
(``ThinkCount``), so a stream's usage on every chunk (``continuous_usage_stats``) costs
each id once, not the whole output again each chunk."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class ThinkCount:
    """How far one answer's ids have been counted: the ids read, the open ``<think>``s,
    and the tokens read inside one."""

    ids_read: int = 0
    depth: int = 0
    count: int = 0

    def read(self, ids: Sequence[int], start_id: int | None, end_id: int) -> int:
        """The count over ``ids`` (the same answer's ids so far: they only grow), reading
        only those not read before."""
        depth, count = self.depth, self.count
        for token_id in ids[self.ids_read:]:
            if token_id == start_id:
                depth += 1
            elif token_id == end_id:
                depth = max(0, depth - 1)
            elif depth > 0:
                count += 1
        self.ids_read, self.depth, self.count = len(ids), depth, count
        return count
