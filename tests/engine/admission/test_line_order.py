"""The admission line's order (``admission/order.py``) and its refusals: priority under
``--scheduling-policy priority``, fair share between tenants, per-tenant places in line,
and the 429 that names the limit hit. Deterministic: admission's own line over a real
ledger, blocks freed by hand."""

from __future__ import annotations

import concurrent.futures
import random

import pytest

from kvledger.engine.admission.line import Admission
from kvledger.engine.admission.order import ANONYMOUS, LineOrder, Tenant
from kvledger.engine.errors import KVCacheFull, LineFull, TenantLineFull
from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.server.api_errors import admission_error

A, B, C = Tenant("a", "key-0"), Tenant("b", "key-1"), Tenant("c", "key-2", weight=2.0)


def _admission(num_blocks=4, **options):
    options = {"max_queue_len": None, "max_queue_wait_s": None, **options}
    return Admission(KVLedger(num_blocks, 16), max_model_len=64, rng=random.Random(0),
                     **options)


class Line:
    """Requests of one block each (16 tokens) lined up on a pool of ``num_blocks``:
    ``grants`` is the order their tickets came in."""

    def __init__(self, num_blocks=1, **options):
        self.adm = _admission(num_blocks, **options)
        self.grants: list[str] = []
        self.tickets = {}

    def send(self, name, tenant=ANONYMOUS, priority=0):
        outcome = concurrent.futures.Future()
        outcome.add_done_callback(lambda f: self._granted(name, f))
        self.adm.line_up(name, 8, 8, outcome, tenant=tenant, priority=priority)

    def _granted(self, name, future):
        if future.exception() is None:
            self.grants.append(name)
            self.tickets[name] = future.result()

    def finish(self, count=1):
        """The oldest ``count`` running requests end: their blocks come back."""
        for name in list(self.tickets)[:count]:
            ticket = self.tickets.pop(name)
            self.adm.give_back(ticket.reservations)
            self.adm.done(ticket)


def _drain(line: Line) -> list[str]:
    while line.adm.queue_length:
        line.finish()
    return line.grants


def test_one_tenant_one_priority_is_first_come_first_served():
    line = Line()
    for name in "rstuv":
        line.send(name)
    assert _drain(line) == list("rstuv")


def test_a_flood_delays_another_tenant_by_one_admission_not_the_flood():
    line = Line()
    for i in range(40):
        line.send(f"a{i}", A)
    line.finish()  # a0 ran; a1 is granted
    line.send("b0", B)
    order = _drain(line)
    assert order[:4] == ["a0", "a1", "b0", "a2"]  # next, though 38 of A's were ahead


def test_fairness_alternates_between_waiting_tenants_and_weights_count():
    line = Line()
    line.send("x", ANONYMOUS)  # holds the pool
    for i in range(6):
        line.send(f"a{i}", A)
    for i in range(6):
        line.send(f"c{i}", C)  # weight 2: two turns for each of A's
    order = _drain(line)[1:]
    assert order[:9] == ["a0", "c0", "c1", "a1", "c2", "c3", "a2", "c4", "c5"]


def test_without_fairness_the_flood_goes_first():
    line = Line(tenant_fairness=False)
    for i in range(5):
        line.send(f"a{i}", A)
    line.send("b0", B)
    assert _drain(line) == ["a0", "a1", "a2", "a3", "a4", "b0"]


def test_an_idle_tenant_saves_up_no_credit():
    """B sent nothing while A's 10 ran; then both send 4: they alternate, B does not get
    its missed 10 turns in a row."""
    line = Line()
    for i in range(10):
        line.send(f"a{i}", A)
    _drain(line)
    line.grants.clear()
    line.send("hold", ANONYMOUS)
    for i in range(4):
        line.send(f"a{10 + i}", A)
        line.send(f"b{i}", B)
    order = _drain(line)[1:]
    # B first (A had the last turn), then turn about: never B's missed ten in a row
    assert order == ["b0", "a10", "b1", "a11", "b2", "a12", "b3", "a13"]


def test_priority_policy_orders_by_priority_then_tenant_then_arrival():
    line = Line(scheduling_policy="priority")
    line.send("hold")
    line.send("late", A, priority=10)
    line.send("later", B, priority=10)
    line.send("urgent", B, priority=0)
    line.send("urgent2", A, priority=0)
    line.send("first", A, priority=-5)
    assert _drain(line)[1:] == ["first", "urgent", "urgent2", "late", "later"]


def test_under_fcfs_priority_does_not_reorder():
    line = Line(scheduling_policy="fcfs")
    line.send("hold")
    line.send("late", priority=10)
    line.send("urgent", priority=0)
    assert _drain(line)[1:] == ["late", "urgent"]


def test_a_tenant_that_fills_its_places_gets_the_429_not_everyone():
    adm = _admission(1, max_queue_len=4)
    capped_a = Tenant("a", "key-0", max_queued=2)
    capped_b = Tenant("b", "key-1", max_queued=2)
    futures = []

    def send(tenant):
        future = concurrent.futures.Future()
        futures.append(future)
        adm.line_up(f"r{len(futures)}", 8, 8, future, tenant=tenant)

    send(capped_a)  # runs
    send(capped_a)
    send(capped_a)  # its two places
    with pytest.raises(TenantLineFull) as own:
        send(capped_a)
    answer = admission_error(own.value)
    assert answer.status == 429 and answer.code == "tenant_queue_full"
    assert "key-0" in answer.message and "Retry-After" in answer.headers
    send(capped_b)
    send(capped_b)  # the line's four places now taken
    with pytest.raises(LineFull) as full:
        send(Tenant("c", "key-2"))
    answer = admission_error(full.value)
    assert (answer.status, answer.code) == (429, "queue_full")
    assert "--max-queue-len 4" in answer.message


def test_a_refusal_when_it_may_not_wait_names_the_kv_cache():
    adm = _admission(1, max_queue_wait_s=0.0)
    adm.line_up("r0", 8, 8, concurrent.futures.Future())
    with pytest.raises(KVCacheFull) as info:
        adm.line_up("r1", 8, 8, concurrent.futures.Future())
    assert type(info.value) is KVCacheFull and admission_error(info.value).code == "kv_cache_full"


def test_retry_after_counts_only_those_ahead_in_the_tenants_own_place():
    """A flood of A's: B's estimate counts what is ahead of B's place (one of A's), A's
    counts all of A's waiters."""
    adm = _admission(8, max_queue_len=16, decode_tokens_per_s=lambda: 1.0)
    running = []
    for left in (2, 4, 12, 24):  # two blocks each, the whole pool, 2..24 tokens to go
        outcome = concurrent.futures.Future()
        adm.line_up(f"r{left}", 8, 24, outcome)
        adm.progress(outcome.result(), 24 - left)
        running.append(outcome.result())
    for i in range(8):
        adm.line_up(f"a{i}", 8, 24, concurrent.futures.Future(), tenant=A)
    line = adm.line
    assert len(list(line.ahead_of(line.place_for(B, 0)))) == 1
    assert len(list(line.ahead_of(line.place_for(A, 0)))) == 8
    # B's block and the one of A's ahead of it: back once two end (4 s at 1 token/s,
    # +25% and 0.25 s at most); A's behind all of A's: not before the last (24 s)
    refuse = adm.refusals.rejection
    assert refuse(1, B).wait_s <= 5.25 and refuse(1, A).wait_s >= 24


def test_the_order_refuses_unknown_policies_and_bad_weights():
    with pytest.raises(ValueError, match="fcfs, priority"):
        LineOrder(policy="lifo")
    with pytest.raises(ValueError, match="weight"):
        Tenant("x", "x", weight=0)
