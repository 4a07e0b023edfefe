"""Reservation admission: a request runs only once the KV ledger admits ``prompt + cap``.

The story of one request: ``effective_cap`` turns the requested ``max_tokens`` into the
cap (``cap.output_cap``: PromptTooLong, CapTooLarge), ``admit`` reserves ``prompt + cap``
tokens of KV blocks (PoolTooSmall when the pool could never hold them, the ledger's
``check_fits``), at once or after waiting in a line of at most ``max_queue_len`` (for at
most ``max_queue_wait_s``, when set), of which one tenant holds at most its
``max_queued`` places. The line's order (``order.LineOrder``) is priority (under
``--scheduling-policy priority``), then fair share between tenants (in tokens), then
arrival. Nobody
overtakes the first in that order, so the blocks that come back accumulate for it, never
for a smaller late-comer; with ``--backfill`` one whose start would delay none of the first
``BACKFILL_DEPTH`` in line may go first (``due_back``).
A request it cannot take is refused (LineFull, TenantLineFull, KVCacheFull) with the wait
``refusal`` estimates for it. ``done`` forgets the request; the engine releases the blocks
it was handed, ``give_back`` any it never was.
The server awaits ``admit``; ``LLM.generate``, which steps the engine itself, lines up with
``line_up`` and hands each ticket over as ``capacity_changed`` grants it. The errors are
the engine's (``kvledger.engine.errors``); the server maps them to HTTP.

With prefix caching the ledger pins the cached blocks the prompt begins with, so a
request may claim fewer blocks than ``blocks_for(prompt + cap)``: a refusal counts the
blocks it would claim now. Whether a request is too large for the pool (PoolTooSmall)
never depends on the cache.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvledger.engine.admission.cap import output_cap
from kvledger.engine.admission.due_back import projection
from kvledger.engine.admission.headroom import NO_HEADROOM, Headroom
from kvledger.engine.admission.order import ANONYMOUS, LineOrder, Tenant
from kvledger.engine.admission.refusal import Refusals
from kvledger.engine.admission.ticket import Outcome, Ticket, Waiter
from kvledger.engine.errors import KVCacheFull
from kvledger.engine.kv.block_pool import Salt
from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.kv.reservation import Reservation
from kvledger.engine.settings.serve_config import ServeConfig

if TYPE_CHECKING:
    from kvledger.engine.model.lora_adapter import LoraAdapter

__all__ = ["BACKFILL_DEPTH", "DEFAULT_MAX_QUEUE_LEN", "Admission", "Ticket"]

# At most this many requests wait in line for a reservation (--max-queue-len); one more is
# a LineFull whose wait counts the blocks of those ahead of it in order.
DEFAULT_MAX_QUEUE_LEN = ServeConfig.max_queue_len
# With --backfill: how many in line are planned. Simulated on bench/serving.py's overload,
# 4 gave 4% more goodput at the same p99; 16, 9% more at a 13% longer p99.
BACKFILL_DEPTH = 4


class Admission:
    """Admits requests against ``ledger``, in one line (``order.LineOrder``)."""

    def __init__(self, ledger: KVLedger, *, max_model_len: int,
                 max_queue_wait_s: float | None = 0.0,
                 max_queue_len: int | None = DEFAULT_MAX_QUEUE_LEN,
                 max_num_seqs: int | None = None, backfill: bool = False,
                 scheduling_policy: str = "fcfs",
                 tenant_fairness: bool = ServeConfig.tenant_fairness,
                 headroom: Headroom = NO_HEADROOM,
                 decode_tokens_per_s: Callable[[], float | None] = lambda: None,
                 rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ledger = ledger
        self.max_model_len = max_model_len
        self.max_queue_wait_s = max_queue_wait_s  # None: as long as it takes
        self.max_queue_len = max_queue_len  # None: no cap (``LLM``'s line)
        self.max_num_seqs = max_num_seqs  # the engine runs at most this many at once
        self.backfill = backfill
        self.headroom = headroom  # what only urgent requests may take (headroom.py)
        self.backfilled = 0  # requests admitted ahead of the line (kvledger_requests_backfilled_total)
        self.granted = 0  # requests admitted, at once or from the line (the line's stall watch)
        self._clock = clock
        self._next_plan = 0.0  # after an engine step, backfill no sooner (capacity_changed)
        self.line = LineOrder(policy=scheduling_policy, fair=tenant_fairness)  # who waits
        self.running: dict[str, Ticket] = {}
        # What a refused request is told: the limit it hit, and when to come back.
        self.refusals = Refusals(self, decode_tokens_per_s, rng or random.Random())

    # -- the cap -------------------------------------------------------------------
    def effective_cap(self, prompt_tokens: int, requested: int | None) -> int:
        """The output cap this request is admitted with (``output_cap``): PromptTooLong
        when the prompt fills the context, CapTooLarge when the requested cap overflows it."""
        return output_cap(self.max_model_len, prompt_tokens, requested)

    # -- admit ---------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        return len(self.line)

    @property
    def scheduling_policy(self) -> str:
        return self.line.policy

    @property
    def queues(self) -> bool:
        """Whether a request that cannot be reserved now may wait in line for it."""
        return ((self.max_queue_len is None or self.max_queue_len > 0)
                and (self.max_queue_wait_s is None or self.max_queue_wait_s > 0))

    @property
    def queue_full(self) -> bool:
        return self.max_queue_len is not None and len(self.line) >= self.max_queue_len

    def waiting_by_tenant(self) -> dict[str, int]:
        """Requests in line by tenant label (``kvledger_tenant_requests_waiting``)."""
        return self.line.queued_by_label()

    def tenant_full(self, tenant: Tenant) -> bool:
        """Whether ``tenant`` holds every place in line it may (``Tenant.max_queued``)."""
        return tenant.max_queued is not None and self.line.queued(tenant) >= tenant.max_queued

    def line_up(self, request_id: str, prompt_tokens: int, cap_tokens: int, outcome: Outcome,
                n: int = 1, *, prompt_token_ids: list[int] | None = None,
                use_cached: bool = True, salt: Salt | None = None,
                adapter: LoraAdapter | None = None, tenant: Tenant = ANONYMOUS,
                priority: int = 0) -> Waiter:
        """Reserve ``prompt + cap`` tokens for each of ``n`` choices, all at once, now or in
        line order later: ``outcome`` gets the ``Ticket`` when they are granted (now, or in a
        later ``capacity_changed``), or the error of a ``close``. Never waits itself:
        PoolTooSmall when the pool could never hold them, KVCacheFull (with its wait) when
        it may not join the line (LineFull, TenantLineFull: the line's or its ``tenant``'s
        places taken). With the prompt's ids the ledger pins the cached blocks it
        begins with (unless ``use_cached`` is False: echoed prompt logprobs need every
        position computed), among those keyed with the same ``salt``. ``adapter``: its LoRA
        adapter, which takes one of the engine's slots while it runs. ``tenant`` and
        ``priority`` decide its place in line (``order``)."""
        tokens = prompt_tokens + cap_tokens
        kept = self.headroom.kept_from(priority)
        # The choices share their prompt's full blocks (unless every position is computed).
        blocks = self.ledger.check_fits(tokens, n, prompt_tokens,
                                        share=use_cached and prompt_token_ids is not None,
                                        kept_blocks=kept[0])
        waiter = Waiter(request_id, prompt_tokens, cap_tokens, tokens, n, blocks,
                        prompt_token_ids, use_cached, salt, adapter, tenant, priority, kept)
        # With nobody in line it goes now if it fits. Else it joins the line, whose first
        # in order (perhaps itself: a higher priority, a tenant's fair turn) goes if it
        # fits, and whose backfilling may start it at once.
        reservations = None if self.line else waiter.try_reserve(self.ledger)
        if reservations is not None:
            self.line.served(tenant, priority, tokens * n)  # its share, all the same
            outcome.set_result(self._grant(waiter, reservations))
            return waiter
        # What it would claim now (its cached blocks considered), for the refusal's estimate.
        waiter.blocks = self.ledger.blocks_needed(tokens, n, prompt_token_ids,
                                                  use_cached=use_cached, salt=salt)
        if not self.queues or self.queue_full or self.tenant_full(tenant):
            # refused now; the wait counts those ahead of it in order
            raise self.refusals.rejection(waiter.blocks, tenant, priority)
        waiter.outcome = outcome
        waiter.place = self.line.join(waiter, tenant, priority, tokens * n)
        self.capacity_changed()  # it may be first in order
        return waiter

    async def admit(self, request_id: str, prompt_tokens: int, cap_tokens: int, n: int = 1, *,
                    prompt_token_ids: list[int] | None = None, use_cached: bool = True,
                    salt: Salt | None = None, adapter: LoraAdapter | None = None,
                    tenant: Tenant = ANONYMOUS, priority: int = 0) -> Ticket:
        """``line_up``, then wait in line for at most ``max_queue_wait_s``: the ticket, or
        KVCacheFull (with its wait) when the wait runs out; PoolTooSmall as ``line_up``.
        A caller cancelled while waiting leaves the line and holds nothing."""
        future: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        waiter = self.line_up(request_id, prompt_tokens, cap_tokens, future, n,
                              prompt_token_ids=prompt_token_ids, use_cached=use_cached,
                              salt=salt, adapter=adapter, tenant=tenant, priority=priority)
        if future.done():
            return future.result()
        return await self._wait_in_line(waiter, future)

    def _grant(self, waiter: Waiter, reservations: list[Reservation]) -> Ticket:
        """The admitted request's ticket, running from now: the line's next backfill
        check counts its blocks as coming back when it finishes."""
        ticket = Ticket(waiter.request_id, waiter.prompt_tokens, waiter.cap_tokens,
                        reservations, self._clock())
        self.running[waiter.request_id] = ticket
        self.granted += 1
        return ticket

    async def _wait_in_line(self, waiter: Waiter, future: asyncio.Future[Ticket]) -> Ticket:
        admitted = False
        try:
            ticket = await asyncio.wait_for(asyncio.shield(future), self.max_queue_wait_s)
            admitted = True
            return ticket
        except TimeoutError:
            if future.done():  # granted in the same instant the wait ran out
                admitted = True
                return future.result()
            future.cancel()
            self._leave(waiter)  # first: its wait counts those ahead of it, not itself
            raise self.refusals.rejection(waiter.blocks, waiter.tenant, waiter.priority,
                                          wait_over=True) from None
        except asyncio.CancelledError:
            granted = future.done() and not future.cancelled() and future.exception() is None
            if granted:  # the client left just as its blocks came: give them back
                ticket = future.result()
                self.running.pop(ticket.request_id, None)
                self.give_back(ticket.reservations)
            raise
        finally:
            if not future.done():
                future.cancel()
                self._leave(waiter)
            if not admitted:
                # Blocks given back, or a place at the head of the line given up, may be
                # all the next waiter needs; nothing else would wake it while the engine idles.
                self.capacity_changed()

    def early_rejection(self, max_prompt_tokens: int, requested: int | None,
                        n: int = 1, tenant: Tenant = ANONYMOUS,
                        priority: int = 0) -> KVCacheFull | None:
        """The refusal of a request whose prompt is at most ``max_prompt_tokens`` long, when
        the answer cannot depend on its exact length (``Refusals.early``); else None."""
        return self.refusals.early(max_prompt_tokens, requested, n, tenant, priority)

    def capacity_changed(self, step: bool = False) -> None:
        """Blocks may have come back: grant waiters in line order while they fit, then
        backfill. After an engine ``step`` the backfill plan is redone only once 9 times its
        last cost has passed (a long context's plan can take a step's time)."""
        while self.line:
            head = next(iter(self.line))
            reservations = head.try_reserve(self.ledger)
            if reservations is None:
                break
            self._leave(head, granted=True)
            head.outcome.set_result(self._grant(head, reservations))
        else:
            return
        if self.backfill and (not step or self._clock() >= self._next_plan):
            began = self._clock()
            self._backfill_line()
            ended = self._clock()
            self._next_plan = ended + 9 * (ended - began)

    def _backfill_line(self) -> None:
        """Plan the first ``BACKFILL_DEPTH`` live waiters in line order, each at its soonest
        start around the plans before it (``due_back``), and start those planned for now:
        none moves an earlier plan. Never the head (the ledger refused it), nor one the
        ledger refuses, nor anyone once every seat (``max_num_seqs``) is taken."""
        plan = projection(self.ledger, self.running.values())
        line = list(itertools.islice(self.line, BACKFILL_DEPTH))
        for place, waiter in enumerate(line):
            start = waiter.place_in(plan)
            if start is None:  # never, as projected (blocks held beyond it): plan no further
                return
            if start:
                continue
            seated = (self.max_num_seqs is None
                      or len(self.running) < self.max_num_seqs - waiter.kept[1])
            reservations = waiter.try_reserve(self.ledger) if place and seated else None
            if reservations is None:
                return
            self._leave(waiter, granted=True)
            self.backfilled += 1
            waiter.outcome.set_result(self._grant(waiter, reservations))

    def close(self, error: Exception) -> None:
        """Refuse every waiter with ``error`` (shutdown); later admits are the caller's to stop."""
        self.max_queue_len = 0
        for waiter in list(self.line):
            self._leave(waiter)
            waiter.outcome.set_exception(error)

    def _leave(self, waiter: Waiter, granted: bool = False) -> None:
        self.line.leave(waiter, waiter.tenant, waiter.place, granted=granted)

    def progress(self, ticket: Ticket, generated_tokens: int) -> None:
        ticket.generated_tokens = generated_tokens

    def give_back(self, reservations: list[Reservation]) -> None:
        """Release reservations granted but never handed to the engine (the engine
        releases those it was handed): the one release of the server and ``LLM``."""
        for reservation in reservations:
            self.ledger.release(reservation)

    def done(self, ticket: Ticket) -> None:
        """Forget a finished request and wake waiters (the engine releases the reservations
        it was handed, ``give_back`` the rest)."""
        self.running.pop(ticket.request_id, None)
        self.capacity_changed()
