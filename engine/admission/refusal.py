"""What a refused request is told: the limit it hit (LineFull: the line full;
TenantLineFull: its tenant's places taken; KVCacheFull: it may not wait, or its wait ran
out) and the wait after which enough blocks are due back for it and those ahead of it in
order (the server's Retry-After): the running requests' remaining caps at the observed
decode rate, soonest first (``due_back``), with jitter so refused clients do not return
in lock-step. Under overload a request is refused before its prompt is tokenized when the
answer cannot depend on the prompt's exact length (``early``).

With prefix caching a refusal counts the blocks the request would claim now, and its wait
what each running request's release really gives back (the ledger's ``blocks_returned``:
a prefix several chats pinned comes back with the last of them). A refusal only reads the
line's state; it changes nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Protocol

from kvledger.engine.admission.due_back import jittered_wait_s, seconds_until_freed
from kvledger.engine.admission.headroom import Headroom
from kvledger.engine.admission.order import ANONYMOUS, LineOrder, Tenant
from kvledger.engine.admission.ticket import Ticket
from kvledger.engine.errors import KVCacheFull, LineFull, TenantLineFull
from kvledger.engine.kv.claims import cacheable_blocks
from kvledger.engine.kv.ledger import KVLedger

DEFAULT_DECODE_TOKENS_PER_S = 20.0  # before the first decode step is observed


class LineState(Protocol):
    """What a refusal reads of the admission line (``line.Admission``): the line itself in
    order (``line``), its caps, the running requests and the pool."""

    ledger: KVLedger
    headroom: Headroom
    max_model_len: int
    max_num_seqs: int | None
    max_queue_len: int | None
    line: LineOrder
    running: dict[str, Ticket]

    @property
    def queues(self) -> bool: ...

    @property
    def queue_full(self) -> bool: ...

    def tenant_full(self, tenant: Tenant) -> bool: ...


class Refusals:
    """The refusals of one admission line (``state``), their waits estimated at the decode
    rate ``decode_tokens_per_s`` reports (None: none observed yet), jittered by ``rng``."""

    def __init__(self, state: LineState, decode_tokens_per_s: Callable[[], float | None],
                 rng: random.Random) -> None:
        self._state = state
        self._decode_tokens_per_s = decode_tokens_per_s
        self._rng = rng

    def estimate_wait_s(self, blocks: int, ahead_blocks: int | None = None,
                        kept_blocks: int = 0) -> float:
        """Seconds until ``blocks`` (behind ``ahead_blocks`` already queued; None: the
        whole line; with ``kept_blocks`` of the pool it may not take) can be reserved, as
        the admitted requests reach their caps (``seconds_until_freed``)."""
        state = self._state
        if ahead_blocks is None:
            ahead_blocks = sum(w.blocks for w in state.line)
        deficit = blocks + ahead_blocks + kept_blocks - state.ledger.free_blocks
        if deficit <= 0:
            return 0.0
        rate = self._decode_tokens_per_s() or DEFAULT_DECODE_TOKENS_PER_S
        return seconds_until_freed(deficit, list(state.running.values()), state.ledger, rate,
                                   state.max_num_seqs)

    def rejection(self, blocks: int, tenant: Tenant = ANONYMOUS, priority: int = 0, *,
                  wait_over: bool = False) -> KVCacheFull:
        """The refusal of a request of ``blocks`` from ``tenant`` at ``priority``, naming
        the limit it hit, with a jittered wait estimated for its own place in order (the
        blocks of those the line would grant before it)."""
        state = self._state
        place = state.line.place_for(tenant, priority)
        ahead = sum(w.blocks for w in state.line.ahead_of(place))
        kept = state.headroom.kept_from(priority)[0]
        wait_s = jittered_wait_s(self.estimate_wait_s(blocks, ahead, kept), self._rng)
        if not wait_over and state.queues and state.queue_full:
            return LineFull(len(state.line), state.max_queue_len, wait_s)
        if not wait_over and state.queues and state.tenant_full(tenant):
            return TenantLineFull(tenant.label, state.line.queued(tenant), wait_s)
        return KVCacheFull(blocks, state.ledger.free_blocks, wait_s)


    def early(self, max_prompt_tokens: int, requested: int | None, n: int = 1,
              tenant: Tenant = ANONYMOUS, priority: int = 0) -> KVCacheFull | None:
        """The KVCacheFull for a request whose prompt is at most ``max_prompt_tokens`` long,
        when the answer cannot depend on its exact length; else None (tokenize and ``admit``).

        Under overload this skips tokenizing, so the bound must hold whatever the prompt
        and the cache hold. Each choice draws the blocks of ``prompt + cap`` its cached
        hits do not cover, and hits are whole blocks before the prompt's last token: with
        a cap, a choice draws at least ``blocks_for(1 + cap)``, cached or not; with the
        cap unset it needs exactly ``max_model_len`` tokens, of which at most
        ``(max_prompt_tokens - 1) // block_size`` blocks may be cached.
        """
        state, ledger = self._state, self._state.ledger
        if (state.queues and not state.queue_full and not state.tenant_full(tenant)) \
                or max_prompt_tokens >= state.max_model_len:
            return None  # it would queue, or it might be PromptTooLong
        if requested is not None and max_prompt_tokens + requested > state.max_model_len:
            return None  # it might be CapTooLarge
        cached = 0
        if requested is None and ledger.prefix_cache.enabled:
            cached = cacheable_blocks(max_prompt_tokens, ledger.block_size)
        least = n * (ledger.blocks_for(state.max_model_len) - cached if requested is None
                     else ledger.blocks_for(1 + requested))
        # Free blocks decide unless the line is full, or when over-committing (safe).
        fits = (least <= ledger.free_blocks - state.headroom.kept_from(priority)[0]
                or ledger.overcommit is not None)
        if least > ledger.num_blocks or (fits and not state.queues):  # a full line: refused
            return None
        return self.rejection(least, tenant, priority)
