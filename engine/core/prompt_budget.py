"""The step's prompt tokens (``max_num_batched_tokens``, less a token for each decode)
shared between tenants by their weights, the same fair share the lines keep
(``admission/order.py``), here in tokens of one step.

Each tenant's prompts at one priority are a ``Claim``: those seated first (in the order
they were seated), then those in line for a seat (in line order). The budget is handed out
in rounds (water-filling): each open claim is offered ``budget * weight / total weight``
of what is left, spends it on its prompts in order, a chunk at a time, and what a claim
cannot spend (its prompts all done, or refused a seat, or short of blocks) goes round
again to the others. So a tenant with one short prompt is not held behind another's long
ones that started first, and one tenant alone takes the whole budget, in its own order, as
before. A more urgent priority's claims are served before a less urgent one's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

# ``run(seq, tokens)``: the tokens of ``seq``'s prompt computed this step (seating it if
# it waits for a seat), at most ``tokens``; 0 when it cannot go this step.
Run = Callable[[Any, int], int]


@dataclass
class Claim:
    """One tenant's prompts at one priority, in the order they are served."""

    weight: float
    seqs: deque = field(default_factory=deque)

    def spend(self, quota: int, run: Run) -> int:
        """Up to ``quota`` tokens on its prompts in order; the tokens spent. A prompt that
        took less than it was offered is done for this step."""
        spent = 0
        while self.seqs and spent < quota:
            offered = quota - spent
            took = run(self.seqs[0], offered)
            spent += took
            if took < offered:
                self.seqs.popleft()
        return spent


def share(budget_tokens: int, claims: Iterable[Claim], run: Run) -> int:
    """Spend at most ``budget_tokens`` on ``claims`` (one priority's, in the order ties
    go) by weight, in rounds; the tokens spent."""
    spent = 0
    open_claims = [claim for claim in claims if claim.seqs]
    while open_claims and spent < budget_tokens:
        left = budget_tokens - spent
        total = sum(claim.weight for claim in open_claims)
        for claim in open_claims:
            quota = min(max(1, int(left * claim.weight / total)), budget_tokens - spent)
            if quota <= 0:
                break
            spent += claim.spend(quota, run)
        open_claims = [claim for claim in open_claims if claim.seqs]
    return spent


def claims_by_priority(seated: Iterable[Any], waiting: Iterable[Any],
                       fair: bool) -> list[list[Claim]]:
    """The claims of each priority, most urgent first: ``seated`` prompts (in seat order)
    before ``waiting`` ones (in line order), a claim a tenant (one for all when not
    ``fair``), tenants in the order of their first prompt."""
    levels: dict[int, dict[str, Claim]] = {}
    for seq in (*seated, *waiting):
        tenant = seq.tenant
        claims = levels.setdefault(seq.priority, {})
        key = tenant.key if fair else ""
        claim = claims.get(key)
        if claim is None:
            claim = claims[key] = Claim(tenant.weight if fair else 1.0)
        claim.seqs.append(seq)
    return [list(levels[priority].values()) for priority in sorted(levels)]
