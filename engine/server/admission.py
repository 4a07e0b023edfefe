"""Reservation admission: a request runs only once the KV ledger admits ``prompt + cap``.

The story of one request: ``effective_cap`` turns the requested ``max_tokens`` into the
cap (the engine's rule, ``output_cap``; its refusals are 413/400 here), ``admit``
reserves ``prompt + cap`` tokens of KV blocks (400 when the pool could never hold them,
the ledger's ``check_fits``), at once or after waiting in a FIFO line of at most
``max_queue_len`` (for at most ``max_queue_wait_s``, when set). Nobody overtakes the head
of the line, so the blocks that come back accumulate for the oldest waiter, never for a
smaller late-comer; with ``--backfill`` one whose start would delay none of the first
``BACKFILL_DEPTH`` in line may go first (``due_back``).
A refusal (the line full, or the wait over) carries the wait after which enough blocks are due
back: the running requests' remaining caps at the observed decode rate, soonest first,
with jitter so rejected clients do not return in lock-step. ``done`` forgets the
request; the engine releases the blocks it was handed, ``give_back`` any it never was.

With prefix caching the ledger pins the cached blocks the prompt begins with, so a
request may claim fewer blocks than ``blocks_for(prompt + cap)``: a refusal counts the
blocks it would claim now, and its wait what each running request's release really gives
back (the ledger's ``blocks_returned``: a prefix several chats pinned comes back with the
last of them). Whether a request is too large for the pool (400) never depends on the cache.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvledger.engine.core.request import output_cap
from kvledger.engine.errors import CapTooLarge, PoolTooSmall, PromptTooLong
from kvledger.engine.server.api_errors import ApiError
from kvledger.engine.server.due_back import projection, retry_after, seconds_until_freed

# At most this many requests wait in line for a reservation (--max-queue-len); one more is
# a 429 whose Retry-After counts the blocks of every request ahead of it.
DEFAULT_MAX_QUEUE_LEN = 256
DEFAULT_DECODE_TOKENS_PER_S = 20.0  # before the first decode step is observed
# With --backfill: how many in line are planned. Simulated on bench/serving.py's overload,
# 4 gave 4% more goodput at the same p99; 16, 9% more at a 13% longer p99.
BACKFILL_DEPTH = 4


@dataclass
class Ticket:
    """An admitted request: what it reserved and how far it has got."""

    request_id: str
    prompt_tokens: int
    cap_tokens: int
    reservations: list[Any]     # one per choice (``n``), each ``prompt + cap``
    admitted_at: float
    generated_tokens: int = 0   # by the choice furthest from its cap

    @property
    def reservation(self) -> Any:
        """The first choice's reservation (the only one when ``n == 1``)."""
        return self.reservations[0]

    @property
    def remaining_tokens(self) -> int:
        return max(self.cap_tokens - self.generated_tokens, 0)


@dataclass
class _Waiter:
    request_id: str
    prompt_tokens: int
    cap_tokens: int
    tokens: int
    count: int
    blocks: int
    prompt_token_ids: list[int] | None = field(repr=False)
    use_cached: bool
    salt: str | None = field(repr=False)
    adapter: Any = field(repr=False)  # its LoRA adapter (None: the base model)
    future: asyncio.Future = field(init=False, repr=False)  # set when it joins the line
    gone: bool = False  # timed out or cancelled; skipped when it reaches the head

    def try_reserve(self, ledger: Any) -> list[Any] | None:
        return ledger.try_reserve_each(self.tokens, self.count, self.prompt_token_ids,
                                       use_cached=self.use_cached, salt=self.salt,
                                       adapter=self.adapter)

    def place_in(self, plan: Any) -> int | None:
        """Its soonest start in ``plan`` (a ``Projection``), where it is then placed."""
        shape = (self.prompt_tokens, self.tokens, self.count, self.blocks)
        start = plan.soonest_start(*shape)
        if start is not None:
            plan.place(start, *shape)
        return start


class Admission:
    """Admits requests against ``ledger`` (a ``KVLedger``)."""

    def __init__(self, ledger: Any, *, max_model_len: int, max_queue_wait_s: float | None = 0.0,
                 max_queue_len: int = DEFAULT_MAX_QUEUE_LEN, max_num_seqs: int | None = None,
                 backfill: bool = False,
                 decode_tokens_per_s: Callable[[], float | None] = lambda: None,
                 rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ledger = ledger
        self.max_model_len = max_model_len
        self.max_queue_wait_s = max_queue_wait_s  # None: as long as it takes
        self.max_queue_len = max_queue_len
        self.max_num_seqs = max_num_seqs  # the engine runs at most this many at once
        self.backfill = backfill
        self.backfilled = 0  # requests admitted ahead of the line (kvledger_requests_backfilled_total)
        self._decode_tokens_per_s = decode_tokens_per_s
        self._rng = rng or random.Random()
        self._clock = clock
        self._next_plan = 0.0  # after an engine step, backfill no sooner (capacity_changed)
        self._waiters: deque[_Waiter] = deque()
        self._queued = 0
        self.running: dict[str, Ticket] = {}

    # -- the cap -------------------------------------------------------------------
    def effective_cap(self, prompt_tokens: int, requested: int | None) -> int:
        """The output cap this request is admitted with (``output_cap``); 413 when the
        prompt fills the context, 400 when the requested cap overflows it."""
        try:
            return output_cap(self.max_model_len, prompt_tokens, requested)
        except PromptTooLong as exc:
            raise ApiError(413, f"prompt is {exc.prompt_tokens} tokens, at or over the context "
                                f"limit of {exc.max_model_len} tokens",
                           code="context_length_exceeded", param="prompt",
                           reason="prompt_too_long") from None
        except CapTooLarge as exc:
            raise ApiError(400, f"prompt ({exc.prompt_tokens} tokens) + max_tokens "
                                f"({exc.max_tokens}) = {exc.prompt_tokens + exc.max_tokens} "
                                f"exceeds the context limit of {exc.max_model_len} tokens; "
                                f"lower max_tokens to at most {exc.room_tokens}",
                           code="context_length_exceeded", param="max_tokens",
                           reason="over_context") from None

    # -- admit ---------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        return self._queued

    @property
    def queues(self) -> bool:
        """Whether a request that cannot be reserved now may wait in line for it."""
        return self.max_queue_len > 0 and (self.max_queue_wait_s is None
                                           or self.max_queue_wait_s > 0)

    @property
    def queue_full(self) -> bool:
        return self._queued >= self.max_queue_len

    async def admit(self, request_id: str, prompt_tokens: int, cap_tokens: int, n: int = 1, *,
                    prompt_token_ids: list[int] | None = None, use_cached: bool = True,
                    salt: str | None = None, adapter: Any = None) -> Ticket:
        """Reserve ``prompt + cap`` tokens for each of ``n`` choices, all at once, or raise
        a 429 ``ApiError`` with Retry-After. With the prompt's ids the ledger pins the
        cached blocks it begins with (unless ``use_cached`` is False: echoed prompt
        logprobs need every position computed), among those keyed with the same ``salt``.
        ``adapter``: its LoRA adapter, which takes one of the engine's slots while it runs."""
        tokens = prompt_tokens + cap_tokens
        try:  # the choices share their prompt's full blocks (unless every position is computed)
            blocks = self.ledger.check_fits(tokens, n, prompt_tokens,
                                            share=use_cached and prompt_token_ids is not None)
        except PoolTooSmall as exc:
            choices = f" for {n} choices" if n > 1 else ""
            raise ApiError(400, f"the request needs {exc.needed_blocks} KV blocks ({tokens} "
                                f"tokens{choices}) but the whole pool holds {exc.pool_blocks}; "
                                f"lower max_tokens{' or n' if n > 1 else ''}",
                           code="kv_pool_too_small", param="max_tokens",
                           reason="over_pool") from None
        waiter = _Waiter(request_id, prompt_tokens, cap_tokens, tokens, n, blocks,
                         prompt_token_ids, use_cached, salt, adapter)
        # Nobody overtakes a live waiter (departed ones do not count): it joins the line,
        # whose backfilling may start it at once.
        reservations = None if self._queued else waiter.try_reserve(self.ledger)
        if reservations is None:
            return await self._wait_in_line(waiter)
        return self._grant(waiter, reservations)

    def _grant(self, waiter: _Waiter, reservations: list[Any]) -> Ticket:
        """The admitted request's ticket, running from now: the line's next backfill
        check counts its blocks as coming back when it finishes."""
        ticket = Ticket(waiter.request_id, waiter.prompt_tokens, waiter.cap_tokens,
                        reservations, self._clock())
        self.running[waiter.request_id] = ticket
        return ticket

    async def _wait_in_line(self, waiter: _Waiter) -> Ticket:
        # What it would claim now (its cached blocks considered), for the 429's estimate.
        waiter.blocks = self.ledger.blocks_needed(waiter.tokens, waiter.count,
                                                  waiter.prompt_token_ids,
                                                  use_cached=waiter.use_cached, salt=waiter.salt)
        if not self.queues or self.queue_full:  # refused now; Retry-After counts those ahead
            raise self.rejection(waiter.blocks)
        waiter.future = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._queued += 1
        self.capacity_changed()  # departed waiters may have been all that was ahead
        admitted = False
        try:
            ticket = await asyncio.wait_for(asyncio.shield(waiter.future), self.max_queue_wait_s)
            admitted = True
            return ticket
        except TimeoutError:
            if waiter.future.done():  # granted in the same instant the wait ran out
                admitted = True
                return waiter.future.result()
            waiter.gone = True
            raise self.rejection(waiter.blocks) from None
        except asyncio.CancelledError:
            granted = (waiter.future.done() and not waiter.future.cancelled()
                       and waiter.future.exception() is None)
            if granted:  # the client left just as its blocks came: give them back
                ticket = waiter.future.result()
                self.running.pop(ticket.request_id, None)
                self.give_back(ticket.reservations)
            raise
        finally:
            if not waiter.future.done():
                waiter.future.cancel()
                waiter.gone = True
                self._queued -= 1
            if not admitted:
                # Blocks given back, or a place at the head of the line given up, may be
                # all the next waiter needs; nothing else would wake it while the engine idles.
                self.capacity_changed()

    def early_rejection(self, max_prompt_tokens: int, requested: int | None,
                        n: int = 1) -> ApiError | None:
        """The 429 for a request whose prompt is at most ``max_prompt_tokens`` long, when the
        answer cannot depend on its exact length; else None (tokenize and ``admit``).

        Under overload this skips tokenizing, so the bound must hold whatever the prompt
        and the cache hold. Each choice draws the blocks of ``prompt + cap`` its cached
        hits do not cover, and hits are whole blocks before the prompt's last token: with
        a cap, a choice draws at least ``blocks_for(1 + cap)``, cached or not; with the
        cap unset it needs exactly ``max_model_len`` tokens, of which at most
        ``(max_prompt_tokens - 1) // block_size`` blocks may be cached.
        """
        if (self.queues and not self.queue_full) or max_prompt_tokens >= self.max_model_len:
            return None  # it would queue, or it might be a 413
        if requested is not None and max_prompt_tokens + requested > self.max_model_len:
            return None  # it might be a 400
        cached = 0
        if requested is None and self.ledger.enable_prefix_caching:
            cached = (max_prompt_tokens - 1) // self.ledger.block_size
        least = n * (self.ledger.blocks_for(self.max_model_len) - cached if requested is None
                     else self.ledger.blocks_for(1 + requested))
        # Free blocks decide unless the line is full, or when over-committing (safe).
        fits = least <= self.ledger.free_blocks or self.ledger.overcommit is not None
        if least > self.ledger.num_blocks or (fits and not self.queues):  # a full line: 429
            return None
        return self.rejection(least)

    def capacity_changed(self, step: bool = False) -> None:
        """Blocks may have come back: grant waiters in FIFO order while they fit, then
        backfill. After an engine ``step`` the backfill plan is redone only once 9 times its
        last cost has passed (a long context's plan can take a step's time)."""
        while self._waiters:
            head = self._waiters[0]
            if head.gone:
                self._waiters.popleft()
                continue
            reservations = head.try_reserve(self.ledger)
            if reservations is None:
                break
            self._waiters.popleft()
            self._queued -= 1
            head.future.set_result(self._grant(head, reservations))
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
        line = [waiter for waiter in self._waiters if not waiter.gone][:BACKFILL_DEPTH]
        for place, waiter in enumerate(line):
            start = waiter.place_in(plan)
            if start is None:  # never, as projected (blocks held beyond it): plan no further
                return
            if start:
                continue
            seated = self.max_num_seqs is None or len(self.running) < self.max_num_seqs
            reservations = waiter.try_reserve(self.ledger) if place and seated else None
            if reservations is None:
                return
            self._waiters.remove(waiter)
            self._queued -= 1
            self.backfilled += 1
            waiter.future.set_result(self._grant(waiter, reservations))

    def close(self, error: Exception) -> None:
        """Refuse every waiter with ``error`` (shutdown); later admits are the caller's to stop."""
        self.max_queue_len = 0
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.gone:
                self._queued -= 1
                waiter.future.set_exception(error)

    def progress(self, ticket: Ticket, generated_tokens: int) -> None:
        ticket.generated_tokens = generated_tokens

    def give_back(self, reservations: list[Any]) -> None:
        """Release reservations granted but never handed to the engine (the engine
        releases those it was handed): the server's one release."""
        for reservation in reservations:
            self.ledger.release(reservation)

    def done(self, ticket: Ticket) -> None:
        """Forget a finished request and wake waiters (the engine releases the reservations
        it was handed, ``give_back`` the rest)."""
        self.running.pop(ticket.request_id, None)
        self.capacity_changed()

    # -- Retry-After ----------------------------------------------------------------
    def estimate_wait_s(self, blocks: int, ahead_blocks: int | None = None) -> float:
        """Seconds until ``blocks`` (behind ``ahead_blocks`` already queued) can be reserved,
        as the admitted requests reach their caps (``seconds_until_freed``)."""
        if ahead_blocks is None:
            ahead_blocks = sum(w.blocks for w in self._waiters if not w.gone)
        deficit = blocks + ahead_blocks - self.ledger.free_blocks
        if deficit <= 0:
            return 0.0
        rate = self._decode_tokens_per_s() or DEFAULT_DECODE_TOKENS_PER_S
        return seconds_until_freed(deficit, list(self.running.values()), self.ledger, rate,
                                   self.max_num_seqs)

    def rejection(self, blocks: int, ahead_blocks: int | None = None) -> ApiError:
        """The 429 for a request of ``blocks``, with a jittered, estimated Retry-After."""
        jittered, headers = retry_after(self.estimate_wait_s(blocks, ahead_blocks), self._rng)
        return ApiError(429, f"the KV cache cannot hold this request now ({blocks} blocks needed, "
                             f"{self.ledger.free_blocks} free); retry in {jittered:.1f}s",
                        code="kv_cache_full", reason="kv_cache_full", headers=headers)
