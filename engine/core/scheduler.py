"""Continuous batching with chunked prefill: each step decodes every running sequence,
then spends the rest of ``max_num_batched_tokens`` on prompts, a chunk at a time:
first the prompts already started, then waiting ones (first come, first served; by
priority first under ``--scheduling-policy priority``) while ``max_num_seqs`` and the
adapter slots (``--max-loras``) allow, a best-effort one only while the seats kept for
urgent requests (``--priority-headroom``) stay free. The choices of one request
(``n > 1``) share their prompt's blocks: the others start once the first has computed
them (``KVLedger.share_prompt``); until then they keep their place in line, and those
behind them go on.

Every sequence was admitted with a reservation for its whole life, so scheduling never
preempts: it only draws the physical blocks the step's tokens need from the ledger. With
``--admission safe`` the ledger may refuse a draw (or a seat) that would leave some
request unable to finish: that sequence pauses for the step, keeping its blocks, and is
never recomputed; its chunk shrinks to what it drew, so it holds none of the budget.
Progress rests on the ledger's ``head``, a request that can finish now, which each step
runs first: seated past the line if it waits, drawing and taking its tokens before any
other (``kv/safety.py``). A prompt starts its first chunk after the blocks the prefix
cache holds for it: those its reservation pinned at admission, and those cached since,
pinned as it starts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvledger.engine.admission.headroom import NO_HEADROOM, Headroom
from kvledger.engine.core.sequence import Sequence, SequenceStatus
from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.kv.reservation import Reservation


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
    # Blocks drawn this step: the runner zeroes them before writing, so what a block held
    # for its last owner never enters its new owner's attention (stale positions included).
    fresh_blocks: list[int] = field(default_factory=list)

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences that get a next token this step, in logits order."""
        return [c.seq for c in self.prefills if c.completes_prompt] + self.decodes

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, ledger: KVLedger, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int | None = None, headroom: Headroom = NO_HEADROOM) -> None:
        self.ledger = ledger
        self.headroom = headroom
        self.max_loras = max_loras  # adapters running at once (--max-loras); None: no LoRA
        # The adapters of the running and the waiting sequences, by name, as of the last
        # step: what /metrics reads from another thread (replaced whole, never mutated).
        self.lora_names: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # insertion-ordered; O(1) removal
        self._seq_of: dict[Reservation, Sequence] = {}  # every sequence here, by reservation
        self._fresh: list[int] = []  # blocks drawn by the step being scheduled

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def describe(self) -> str:
        """One line of what is here and of the pool, for a log."""
        ledger = self.ledger
        return (f"{len(self.running)} requests run and {len(self.waiting)} wait; pool "
                f"{ledger.num_blocks} blocks x {ledger.block_size} tokens: "
                f"{ledger.used_blocks} in use, {ledger.cached_blocks} cached, "
                f"{ledger.reserved_blocks} reserved, {ledger.paused_reservations} paused")

    def add(self, seq: Sequence) -> None:
        """In line for a seat: after those of its priority or a lower one (stable, so
        first come, first served within a priority; one priority: appended)."""
        if self.waiting and self.waiting[-1].priority > seq.priority:
            place = next(i for i, other in enumerate(self.waiting)
                         if other.priority > seq.priority)
            self.waiting.insert(place, seq)
        else:
            self.waiting.append(seq)
        self._seq_of[seq.reservation] = seq

    def schedule(self) -> ScheduledBatch:
        """This step's prompt chunks and decodes, their blocks drawn (see the module
        docstring). Over-committing, the ledger's ``head`` goes first: seated if it waits,
        then drawing before anyone else, so the request the safety check proved able to
        finish always progresses (``kv/safety.py``)."""
        self._fresh = []
        head = self._seat_head()
        running = self.running.values()
        decoding = [s for s in running if s.prompt_computed]
        # One token a step for each decode; prompts share the rest, a chunk at a time.
        budget_tokens = self.max_num_batched_tokens - len(decoding)
        prefills: list[PrefillChunk] = []
        if head is not None and not head.prompt_computed:
            budget_tokens -= self._add_chunk(prefills, head, budget_tokens)
        elif head is not None:
            decoding.remove(head)
            decoding.insert(0, head)
        # A slot for each decode's token; one the ledger refuses pauses, its token unspent.
        decodes = [s for s in decoding if self._grow(s, s.num_tokens) >= s.num_tokens]
        budget_tokens += len(decoding) - len(decodes)
        for seq in running:  # prompts started in an earlier step go on first
            if budget_tokens <= 0:
                break
            if not seq.prompt_computed and seq is not head:
                budget_tokens -= self._add_chunk(prefills, seq, budget_tokens)
        adapters = self._adapters()
        passed: list[Sequence] = []  # they cannot start yet: they keep their place in line
        while self.waiting and len(self.running) < self.max_num_seqs and budget_tokens > 0:
            seq = self.waiting.popleft()
            if (seq.reservation.awaits_share  # another choice is computing their prompt
                    or len(self.running) >= self.max_num_seqs
                    - self.headroom.kept_from(seq.priority)[1]  # seats kept for urgent ones
                    or not self._slot_for(seq, adapters) or not self._seat(seq)):
                passed.append(seq)
                continue
            if seq.lora is not None:
                adapters.add(id(seq.lora))
            budget_tokens -= self._add_chunk(prefills, seq, budget_tokens)
        self.waiting.extendleft(reversed(passed))
        self._note_adapters()
        # The runner pads each group of decodes to its longest: shortest context first.
        return ScheduledBatch(prefills, sorted(decodes, key=lambda s: s.num_tokens), self._fresh)

    def _seat_head(self) -> Sequence | None:
        """The sequence of the ledger's head, seated now if it was waiting in line (the
        check counted a seat and an adapter slot for it); None when there is none, or its
        request is not the engine's yet (a server still handing it over)."""
        reservation = self.ledger.head()
        seq = None if reservation is None else self._seq_of.get(reservation)
        if seq is None or seq.status is SequenceStatus.RUNNING:
            return seq
        # The check counted a seat and a slot for it, and never heads with a choice
        # awaiting its prompt (the one computing it needs no more and runs).
        if (reservation.awaits_share or len(self.running) >= self.max_num_seqs
                or not self._slot_for(seq, self._adapters()) or not self._seat(seq)):
            return None
        self.waiting.remove(seq)  # O(n), only over-committed with the head in line
        return seq

    def _adapters(self) -> set[int]:
        """The adapters running, by object: a reloaded adapter takes a slot of its own."""
        return {id(s.lora) for s in self.running.values() if s.lora is not None}

    def _slot_for(self, seq: Sequence, adapters: set[int]) -> bool:
        """Whether ``seq``'s adapter runs already or finds a free slot (``--max-loras``)."""
        return seq.lora is None or id(seq.lora) in adapters or len(adapters) < self.max_loras

    def _seat(self, seq: Sequence) -> bool:
        """Take a seat for ``seq`` if the ledger allows it (``KVLedger.seat``); it starts
        its prompt after the blocks cached for it since admission."""
        if not self.ledger.seat(seq.reservation):
            return False
        if seq.prompt_logprobs is None:
            seq.num_computed_tokens = self.ledger.pin_cached(seq.reservation, seq.prompt_token_ids)
        seq.status = SequenceStatus.RUNNING
        self.running[seq.request_id] = seq
        return True

    def _grow(self, seq: Sequence, num_tokens: int) -> int:
        """Draw the blocks for ``seq``'s first ``num_tokens`` tokens; the tokens it holds.
        Reserving, every draw succeeds; over-committing (``--admission safe``) one may be
        refused, and the sequence pauses, keeping its blocks."""
        block_ids = seq.reservation.block_ids
        drawn = len(block_ids)
        held = self.ledger.grow(seq.reservation, num_tokens)
        self._fresh += block_ids[drawn:]
        return held

    def _add_chunk(self, prefills: list[PrefillChunk], seq: Sequence, budget_tokens: int) -> int:
        """Add ``seq``'s next prompt chunk within ``budget_tokens``, shrunk to the blocks
        it could draw (none: it pauses and adds nothing); the tokens it takes."""
        if budget_tokens <= 0:
            return 0
        chunk = self._chunk(seq, budget_tokens)
        chunk.length = min(chunk.length, self._grow(seq, chunk.start + chunk.length) - chunk.start)
        if chunk.length <= 0:
            return 0
        prefills.append(chunk)
        return chunk.length

    def _note_adapters(self) -> None:
        if self.max_loras is not None:
            self.lora_names = (_adapter_names(self.running.values()), _adapter_names(self.waiting))

    @staticmethod
    def _chunk(seq: Sequence, budget_tokens: int) -> PrefillChunk:
        start = seq.num_computed_tokens
        return PrefillChunk(seq, start, min(seq.num_prompt_tokens - start, budget_tokens))

    def finish(self, seq: Sequence, reason: str, *, uncache: bool = False) -> None:
        """Mark finished and release its blocks at once: the one place the engine releases
        the reservation of a request it took. ``uncache``: the blocks it computed leave
        the prefix cache (``KVLedger.release``)."""
        if self.running.get(seq.request_id) is seq:
            del self.running[seq.request_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._seq_of.pop(seq.reservation, None)
        self.ledger.release(seq.reservation, uncache=uncache)
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
