"""Continuous batching with chunked prefill: each step decodes every running sequence,
then spends the rest of ``max_num_batched_tokens`` on prompts, a chunk at a time.

Every place a request waits shares by the same rule as the admission line
(``admission/order.py``: priority, then the tenants' fair share in tokens, then arrival):

- seats (``max_num_seqs``): admitted requests wait in a line of that order; the seats free
  go to its first, a best-effort one only while the seats kept for urgent requests
  (``--priority-headroom``) stay free;
- adapter slots (``--max-loras``): a waiter refused a slot is not overtaken by requests of
  the running adapters (they would keep the slot from it for as long as they come), only
  by requests without an adapter;
- the step's prompt tokens: each priority's prompts, those seated first, are shared
  between tenants by weight (``core/prompt_budget.py``), so a tenant's short prompt is
  not held behind another's long ones that started first.

With one tenant this is first come, first served (by priority first under
``--scheduling-policy priority``). The choices of one request (``n > 1``) share their
prompt's blocks: the others start once the first has computed them
(``KVLedger.share_prompt``); until then they keep their place in line, and those behind
them go on.

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

from dataclasses import dataclass, field

from kvledger.engine.admission.headroom import NO_HEADROOM, Headroom
from kvledger.engine.admission.order import LineOrder
from kvledger.engine.core.prompt_budget import claims_by_priority, share
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
        # The line for a seat: priority, the tenants' fair share (in tokens), arrival.
        self.waiting = LineOrder(policy="priority", fair=True)
        self._chunks: dict[str, PrefillChunk] = {}  # this step's, by request
        self.running: dict[str, Sequence] = {}  # insertion-ordered; O(1) removal
        self._seq_of: dict[Reservation, Sequence] = {}  # every sequence here, by reservation
        self._fresh: list[int] = []  # blocks drawn by the step being scheduled

    @property
    def fair(self) -> bool:
        """Whether seats and prompt tokens are shared fairly between tenants (the server's
        ``--tenant-fairness``, as its admission line is), else in arrival order."""
        return self.waiting.fair

    @fair.setter
    def fair(self, on: bool) -> None:
        self.waiting.fair = on

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
        """In line for a seat (``order.LineOrder``): by priority, then its tenant's fair
        share of the seats (in tokens: prompt + cap), then arrival."""
        seq.place = self.waiting.join(seq, seq.tenant, seq.priority,
                                      seq.num_prompt_tokens + seq.max_tokens)
        self._seq_of[seq.reservation] = seq

    def schedule(self) -> ScheduledBatch:
        """This step's prompt chunks and decodes, their blocks drawn (see the module
        docstring). Over-committing, the ledger's ``head`` goes first: seated if it waits,
        then drawing before anyone else, so the request the safety check proved able to
        finish always progresses (``kv/safety.py``)."""
        self._fresh, self._chunks = [], {}
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
        if budget_tokens > 0:
            seated = [s for s in running if not s.prompt_computed and s is not head]

            def run(seq: Sequence, tokens: int) -> int:
                if seq.status is not SequenceStatus.RUNNING and not self._seat(seq):
                    return 0
                return self._add_chunk(prefills, seq, tokens)

            for claims in claims_by_priority(seated, self._seatable(), self.fair):
                budget_tokens -= share(budget_tokens, claims, run)
                if budget_tokens <= 0:
                    break
        self._note_adapters()
        # The runner pads each group of decodes to its longest: shortest context first.
        return ScheduledBatch(prefills, sorted(decodes, key=lambda s: s.num_tokens), self._fresh)

    def _seatable(self) -> list[Sequence]:
        """The waiters that may take the seats free now, in line order: a seat each (less
        those the headroom keeps from their priority), an adapter slot each. Behind a
        waiter refused a slot only requests without an adapter go: those of the running
        adapters would keep its slot from it for as long as they come."""
        seats, adapters = len(self.running), self._adapters()
        slot_refused = False
        chosen = []
        for seq in self.waiting:
            if seats >= self.max_num_seqs:
                break
            if (seq.reservation.awaits_share  # another choice is computing their prompt
                    or seats >= self.max_num_seqs - self.headroom.kept_from(seq.priority)[1]):
                continue
            if seq.lora is not None:
                if slot_refused or not self._slot_for(seq, adapters):
                    slot_refused = True
                    continue
                adapters.add(id(seq.lora))
            chosen.append(seq)
            seats += 1
        return chosen

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
        return seq

    def _adapters(self) -> set[int]:
        """The adapters running, by object: a reloaded adapter takes a slot of its own."""
        return {id(s.lora) for s in self.running.values() if s.lora is not None}

    def _slot_for(self, seq: Sequence, adapters: set[int]) -> bool:
        """Whether ``seq``'s adapter runs already or finds a free slot (``--max-loras``)."""
        return seq.lora is None or id(seq.lora) in adapters or len(adapters) < self.max_loras

    def _seat(self, seq: Sequence) -> bool:
        """Take a seat for ``seq`` if the ledger allows it (``KVLedger.seat``): it leaves
        the line, and starts its prompt after the blocks cached for it since admission."""
        if not self.ledger.seat(seq.reservation):
            return False
        self.waiting.leave(seq, seq.tenant, seq.place, granted=True)
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
        """Add (or lengthen) ``seq``'s prompt chunk of this step by up to ``budget_tokens``,
        shrunk to the blocks it could draw (none: it pauses and adds nothing); the tokens
        it takes."""
        if budget_tokens <= 0:
            return 0
        chunk = self._chunks.get(seq.request_id)
        start = seq.num_computed_tokens if chunk is None else chunk.start
        had = 0 if chunk is None else chunk.length
        wanted = min(seq.num_prompt_tokens - start, had + budget_tokens)
        length = min(wanted, self._grow(seq, start + wanted) - start)
        if length <= had:
            return 0
        if chunk is None:
            chunk = self._chunks[seq.request_id] = PrefillChunk(seq, start, 0)
            prefills.append(chunk)
        chunk.length = length
        return length - had

    def _note_adapters(self) -> None:
        if self.max_loras is not None:
            self.lora_names = (_adapter_names(self.running.values()), _adapter_names(self.waiting))

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
            self.waiting.leave(seq, seq.tenant, seq.place, granted=False)  # aborts are rare
        self.finish(seq, "abort")
        return seq


def _adapter_names(seqs) -> tuple[str, ...]:
    return tuple(sorted({s.lora.name for s in seqs if s.lora is not None}))
