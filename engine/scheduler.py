"""Continuous batching: each step decodes every running sequence and admits waiting
prompts (whole, no chunking) while ``max_num_seqs`` and ``max_num_batched_tokens`` allow.

Every sequence was admitted with a reservation for its whole life, so scheduling never
preempts: it only draws the physical blocks the step's tokens need from the ledger.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvledger.engine.ledger import KVLedger
from kvledger.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    prefills: list[Sequence]   # whole prompts computed this step
    decodes: list[Sequence]    # one token each

    @property
    def seqs(self) -> list[Sequence]:
        return self.prefills + self.decodes

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, ledger: KVLedger, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.ledger = ledger
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # insertion-ordered; O(1) removal

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        # Shortest context first: the runner pads each group of decodes to its longest.
        decodes = sorted(self.running.values(), key=lambda seq: seq.num_tokens)
        budget_tokens = self.max_num_batched_tokens - len(decodes)
        prefills: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_prompt_tokens > budget_tokens:
                break  # first come, first served: the next step has a fresh budget
            self.waiting.popleft()
            budget_tokens -= seq.num_prompt_tokens
            seq.status = SequenceStatus.RUNNING
            self.running[seq.request_id] = seq
            prefills.append(seq)
        for seq in prefills + decodes:
            self.ledger.grow(seq.reservation, seq.num_tokens)  # slots for this step's tokens
        return ScheduledBatch(prefills, decodes)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and release its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            del self.running[seq.request_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.ledger.release(seq.reservation)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a waiting or running sequence; None when it is not here (already done)."""
        seq = self.running.get(request_id)
        if seq is None:
            seq = next((s for s in self.waiting if s.request_id == request_id), None)
            if seq is None:
                return None
            self.waiting.remove(seq)  # O(n), but aborts are rare and never on the step path
        self.finish(seq, "abort")
        return seq
