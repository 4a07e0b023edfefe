"""Continuous batching with chunked prefill: each step decodes every running sequence,
then spends the rest of ``max_num_batched_tokens`` on prompts, a chunk at a time:
first the prompts already started, then waiting ones (first come, first served) while
``max_num_seqs`` allows. The choices of one request (``n > 1``) share their prompt's
blocks: the others start once the first has computed them (``KVLedger.share_prompt``).

Every sequence was admitted with a reservation for its whole life, so scheduling never
preempts: it only draws the physical blocks the step's tokens need from the ledger. With
``--admission safe`` the ledger may refuse a draw that would leave some request unable to
finish: that sequence pauses for the step, keeping its blocks, and is never recomputed. A
prompt starts its first chunk after the blocks the prefix cache holds for it: those its
reservation pinned at admission, and those cached since, pinned as it starts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvledger.engine.core.sequence import Sequence, SequenceStatus
from kvledger.engine.kv.ledger import KVLedger


@dataclass
class PrefillChunk:
    """Prompt tokens ``[start, start + length)`` of ``seq`` computed this step."""

    seq: Sequence
    start: int
    length: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length == self.seq.num_prompt_tokens


@dataclass
class ScheduledBatch:
    prefills: list[PrefillChunk]
    decodes: list[Sequence]    # one token each, shortest context first

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences that get a next token this step, in logits order."""
        return [c.seq for c in self.prefills if c.completes_prompt] + self.decodes

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, ledger: KVLedger, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int | None = None) -> None:
        self.ledger = ledger
        self.max_loras = max_loras  # adapters running at once (--max-loras); None: no LoRA
        # The adapters of the running and the waiting sequences, by name, as of the last
        # step: what /metrics reads from another thread (replaced whole, never mutated).
        self.lora_names: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # insertion-ordered; O(1) removal

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        running = self.running.values()
        # Shortest context first: the runner pads each group of decodes to its longest.
        decodes = sorted((s for s in running if s.prompt_computed), key=lambda s: s.num_tokens)
        budget_tokens = self.max_num_batched_tokens - len(decodes)
        prefills: list[PrefillChunk] = []
        for seq in running:  # prompts started in an earlier step go on first
            if not seq.prompt_computed and budget_tokens > 0:
                prefills.append(self._chunk(seq, budget_tokens))
                budget_tokens -= prefills[-1].length
        # The adapters running, by object: a reloaded adapter takes a slot of its own.
        adapters = {id(s.lora) for s in running if s.lora is not None}
        no_slot: list[Sequence] = []  # their adapter finds no free slot: they wait, in order
        while self.waiting and len(self.running) < self.max_num_seqs and budget_tokens > 0:
            if self.waiting[0].reservation.awaits_share:
                break  # another choice of its request is computing their prompt (FIFO)
            seq = self.waiting.popleft()
            if seq.lora is not None and id(seq.lora) not in adapters:
                if len(adapters) >= self.max_loras:
                    no_slot.append(seq)
                    continue
                adapters.add(id(seq.lora))
            if seq.prompt_logprobs is None:  # it may start after blocks cached since admission
                seq.num_computed_tokens = self.ledger.pin_cached(seq.reservation,
                                                                 seq.prompt_token_ids)
            seq.status = SequenceStatus.RUNNING
            self.running[seq.request_id] = seq
            prefills.append(self._chunk(seq, budget_tokens))
            budget_tokens -= prefills[-1].length
        self.waiting.extendleft(reversed(no_slot))
        self._note_adapters()
        return self._draw(prefills, decodes)

    def _note_adapters(self) -> None:
        if self.max_loras is not None:
            self.lora_names = (_adapter_names(self.running.values()), _adapter_names(self.waiting))

    def _draw(self, prefills: list[PrefillChunk], decodes: list[Sequence]) -> ScheduledBatch:
        """Draw the blocks this step's tokens need, oldest request first. Reserving, every
        draw succeeds; over-committing (``--admission safe``) one may be refused: the
        chunk shrinks to the blocks drawn and a decode pauses, keeping its blocks."""
        wanted = {c.seq.request_id: c.start + c.length for c in prefills}
        wanted.update((s.request_id, s.num_tokens) for s in decodes)  # a slot for its token
        held = {request_id: self.ledger.grow(seq.reservation, wanted[request_id])
                for request_id, seq in self.running.items() if request_id in wanted}
        for chunk in prefills:
            chunk.length = min(chunk.length, held[chunk.seq.request_id] - chunk.start)
        prefills = [c for c in prefills if c.length > 0]
        decodes = [s for s in decodes if held[s.request_id] >= s.num_tokens]
        return ScheduledBatch(prefills, decodes)

    @staticmethod
    def _chunk(seq: Sequence, budget_tokens: int) -> PrefillChunk:
        start = seq.num_computed_tokens
        return PrefillChunk(seq, start, min(seq.num_prompt_tokens - start, budget_tokens))

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and release its blocks at once: the one place the engine releases
        the reservation of a request it took."""
        if self.running.get(seq.request_id) is seq:
            del self.running[seq.request_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.ledger.release(seq.reservation)
        if seq.lora is not None:
            self._note_adapters()

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


def _adapter_names(seqs) -> tuple[str, ...]:
    return tuple(sorted({s.lora.name for s in seqs if s.lora is not None}))
