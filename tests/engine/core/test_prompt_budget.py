"""The step's prompt tokens shared between tenants by weight (core/prompt_budget.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.engine.admission.order import Tenant
from kvledger.engine.core.prompt_budget import Claim, claims_by_priority, share


@dataclass
class Prompt:
    name: str
    tokens: int
    tenant: Tenant
    priority: int = 0
    computed: list[int] = field(default_factory=list)


def _run(seq: Prompt, offered: int) -> int:
    took = min(offered, seq.tokens - sum(seq.computed))
    if took:
        seq.computed.append(took)
    return took


A, B, HEAVY = Tenant("a", "a"), Tenant("b", "b"), Tenant("h", "h", weight=3.0)


def test_one_tenant_takes_the_whole_budget_in_its_own_order() -> None:
    first, second = Prompt("1", 100, A), Prompt("2", 100, A)
    claims = claims_by_priority([first, second], [], fair=True)
    assert share(150, claims[0], _run) == 150
    assert (first.computed, second.computed) == ([100], [50])


def test_tenants_share_by_weight_and_what_one_cannot_spend_goes_to_the_others() -> None:
    long_a, short_b, heavy = Prompt("a", 1000, A), Prompt("b", 10, B), Prompt("h", 1000, HEAVY)
    claims = claims_by_priority([long_a], [short_b, heavy], fair=True)
    assert share(500, claims[0], _run) == 500
    assert sum(short_b.computed) == 10  # all it needs, at once
    # the other 490: a 1 to the heavy tenant's 3, after the first round's split
    assert sum(heavy.computed) > 2.5 * sum(long_a.computed)


def test_a_more_urgent_priority_is_served_first_and_unfair_is_one_claim() -> None:
    urgent, other = Prompt("u", 50, B, priority=-1), Prompt("o", 50, A)
    levels = claims_by_priority([other], [urgent], fair=True)
    assert [[c.seqs[0].name for c in level] for level in levels] == [["u"], ["o"]]
    assert len(claims_by_priority([other], [Prompt("x", 5, B)], fair=False)[0]) == 1


def test_a_prompt_that_cannot_go_is_skipped_for_the_next() -> None:
    refused, next_one = Prompt("r", 0, A), Prompt("n", 40, A)
    claim = Claim(1.0)
    claim.seqs.extend([refused, next_one])
    assert claim.spend(30, _run) == 30 and next_one.computed == [30]
