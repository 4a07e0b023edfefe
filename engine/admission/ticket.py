"""What admission hands out and what waits in its line: ``Ticket`` (an admitted request and
its reservations) and ``Waiter`` (a request in line, whose ``outcome`` receives its ticket
or the error that refused it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvledger.engine.kv.block_pool import Salt
from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.kv.projection import Projection
from kvledger.engine.kv.reservation import Reservation

if TYPE_CHECKING:
    from kvledger.engine.admission.order import Place, Tenant
    from kvledger.engine.model.lora_adapter import LoraAdapter


@dataclass
class Ticket:
    """An admitted request: what it reserved and how far it has got."""

    request_id: str
    prompt_tokens: int
    cap_tokens: int
    reservations: list[Reservation]  # one per choice (``n``), each ``prompt + cap``
    admitted_at: float
    generated_tokens: int = 0   # by the choice furthest from its cap

    @property
    def reservation(self) -> Reservation:
        """The first choice's reservation (the only one when ``n == 1``)."""
        return self.reservations[0]

    @property
    def remaining_tokens(self) -> int:
        return max(self.cap_tokens - self.generated_tokens, 0)


class Outcome(Protocol):
    """Where a waiter's ticket, or the error that refused it, is delivered: an
    ``asyncio.Future`` (the server's ``Admission.admit``) or a ``concurrent.futures.Future``
    (``LLM.generate``, which steps the engine itself)."""

    def set_result(self, result: Ticket, /) -> None: ...

    def set_exception(self, exception: BaseException, /) -> None: ...


@dataclass
class Waiter:
    """A request in the admission line: ``tokens`` (prompt + cap) for each of ``count``
    choices, ``blocks`` what it would claim now (its cached blocks considered)."""

    request_id: str
    prompt_tokens: int
    cap_tokens: int
    tokens: int
    count: int
    blocks: int
    prompt_token_ids: list[int] | None = field(repr=False)
    use_cached: bool
    salt: Salt | None = field(repr=False)
    adapter: LoraAdapter | None = field(repr=False)  # None: the base model
    tenant: Tenant = field(repr=False)
    priority: int = 0
    kept: tuple[int, int] = (0, 0)  # the blocks and seats it may not take (headroom)
    outcome: Outcome = field(init=False, repr=False)  # set when it joins the line
    place: Place = field(init=False, repr=False)      # its place in line, once it joins

    def try_reserve(self, ledger: KVLedger) -> list[Reservation] | None:
        return ledger.try_reserve_each(self.tokens, self.count, self.prompt_token_ids,
                                       use_cached=self.use_cached, salt=self.salt,
                                       adapter=self.adapter, kept=self.kept)

    def place_in(self, plan: Projection) -> int | None:
        """Its soonest start in ``plan``, where it is then placed."""
        shape = (self.prompt_tokens, self.tokens, self.count, self.blocks)
        start = plan.soonest_start(*shape)
        if start is not None:
            plan.place(start, *shape)
        return start
