"""Per-tenant fairness (``kvpool/core/fairness.py``): a tenant never has more than its
budget of cost units (unless one call runs alone) nor more than its share of worker
threads; a call past its share is ``TenantBusy`` having run nothing; other tenants are not
affected; the gate's state is bounded by the calls in it."""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.errors import TenantBusy
from kvpool.core.fairness import COST_ITEMS_PER_UNIT, TenantGate, request_cost


def test_cost_grows_with_the_items_a_call_carries() -> None:
    assert request_cost(0) == request_cost(1) == 1
    assert request_cost(4096) == 5
    assert request_cost(65536) == 1 + 65536 // COST_ITEMS_PER_UNIT


def test_a_call_alone_is_admitted_whatever_its_cost_and_a_second_waits_then_is_refused() -> None:
    gate = TenantGate(budget_units=8, max_requests=4, wait_ms=0)
    with gate.admit("a", 100):  # the largest allowed request still runs, alone
        assert gate.in_flight("a") == (100, 1)
        with pytest.raises(TenantBusy), gate.admit("a", 1):
            raise AssertionError("admitted past the budget")
        with gate.admit("b", 8):  # another tenant is not held up
            assert gate.in_flight("b") == (8, 1)
    assert gate.tenants() == 0 and gate.refused == 1


def test_a_tenant_holds_at_most_its_share_of_workers() -> None:
    gate = TenantGate(budget_units=1000, max_requests=2, wait_ms=1000)
    with gate.admit("a", 1), gate.admit("a", 1):
        with pytest.raises(TenantBusy), gate.admit("a", 1):  # refused at once, no waiting
            pass
        with gate.admit("b", 1):
            pass


def test_a_waiting_call_is_admitted_when_room_is_made() -> None:
    gate = TenantGate(budget_units=4, max_requests=4, wait_ms=10_000)
    inside = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def first() -> None:
        with gate.admit("a", 4):
            inside.set()
            release.wait(10)
            order.append("first")

    t = threading.Thread(target=first)
    t.start()
    inside.wait(10)
    threading.Timer(0.05, release.set).start()
    with gate.admit("a", 4):
        order.append("second")
    t.join(10)
    assert order == ["first", "second"] and gate.waited == 1


def test_the_gate_off_admits_everything() -> None:
    gate = TenantGate(budget_units=0, max_requests=1, wait_ms=0)
    with gate.admit("a", 10**9), gate.admit("a", 10**9):
        pass
    assert gate.admitted == 0 and gate.tenants() == 0


@settings(max_examples=40, deadline=None)
@given(
    budget=st.integers(1, 32),
    max_requests=st.integers(1, 6),
    calls=st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 40)), min_size=1, max_size=24),
)
def test_under_any_interleaving_no_tenant_exceeds_its_share(
    budget: int, max_requests: int, calls: list[tuple[str, int]]
) -> None:
    gate = TenantGate(budget_units=budget, max_requests=max_requests, wait_ms=20)
    lock = threading.Lock()
    running: dict[str, list[int]] = defaultdict(list)
    violations: list[str] = []
    outcomes: list[str] = []

    def call(tenant: str, cost: int) -> None:
        try:
            with gate.admit(tenant, cost):
                with lock:
                    running[tenant].append(cost)
                    total, count = sum(running[tenant]), len(running[tenant])
                    if count > max_requests or (count > 1 and total > budget):
                        violations.append(f"{tenant}: {count} calls, {total} units")
                threading.Event().wait(0.001)
                with lock:
                    running[tenant].remove(cost)
            outcomes.append("ok")
        except TenantBusy:
            outcomes.append("busy")

    threads = [threading.Thread(target=call, args=c) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert violations == []
    assert len(outcomes) == len(calls) and outcomes.count("busy") == gate.refused
    assert gate.tenants() == 0  # nothing left behind


class StepClock:
    """A clock that moves ``step_s`` on every read: time passes only as the gate looks at it."""

    def __init__(self, step_s: float) -> None:
        self.now_s = 0.0
        self.step_s = step_s

    def __call__(self) -> float:
        self.now_s += self.step_s
        return self.now_s


@settings(max_examples=25, deadline=None)
@given(
    rate=st.integers(200, 5000), budget=st.integers(1, 16), costs=st.lists(st.integers(1, 20), min_size=1, max_size=60)
)
def test_a_tenant_never_spends_more_than_its_rate_plus_one_burst(rate: int, budget: int, costs: list[int]) -> None:
    clock = StepClock(0.0005)
    gate = TenantGate(budget_units=budget, max_requests=4, wait_ms=5, rate_units_per_s=rate, clock=clock)
    spent = 0.0
    for cost in costs:
        try:
            with gate.admit("a", cost):
                spent += min(cost, budget) - 1  # the bulk part of a call is what the rate counts
        except TenantBusy:
            pass
    # every admitted call found tokens left: at most one burst, the refill, and one call's debt
    assert spent <= budget + clock.now_s * rate + budget
    with gate.admit("b", 2):  # another tenant has its own bucket, full
        pass
    assert gate.buckets() == (2 if any(c > 1 for c in costs) else 1)  # only bulk calls need a bucket


def test_the_rate_refuses_bulk_only_after_waiting_and_refills() -> None:
    clock = StepClock(0.001)
    gate = TenantGate(budget_units=5, max_requests=4, wait_ms=3, rate_units_per_s=10, clock=clock)
    with gate.admit("a", 5):  # the burst: 4 bulk units of the 5 in the bucket
        pass
    with gate.admit("a", 5):  # one unit (and what refilled) left lets one more in, into debt
        pass
    before = clock.now_s
    with pytest.raises(TenantBusy, match="cost units per second"), gate.admit("a", 5):
        pass
    assert clock.now_s - before >= 0.003  # it waited its deadline out first
    for _ in range(100):  # calls without bulk are never rate-limited, debt or not
        with gate.admit("a", 1):
            pass
    clock.now_s += 1.0  # a second later the debt is paid and the bucket full again
    with gate.admit("a", 5):
        pass


@settings(max_examples=25, deadline=None)
@given(
    rate=st.integers(200, 5000),
    budget=st.integers(2, 16),
    calls=st.lists(st.tuples(st.integers(2, 20), st.integers(0, 400)), min_size=1, max_size=60),
)
def test_work_billed_after_a_call_counts_against_the_rate(rate: int, budget: int, calls: list[tuple[int, int]]) -> None:
    """A call admitted for its request's cost that then did ``work`` units more (the blocks a hit
    lookup walked) is billed them after: a tenant never does more than its rate in work plus one
    burst and one second of debt, and another tenant's bucket is untouched."""
    clock = StepClock(0.0005)
    gate = TenantGate(budget_units=budget, max_requests=4, wait_ms=5, rate_units_per_s=rate, clock=clock)
    done = 0.0
    for cost, work in calls:
        try:
            with gate.admit("a", cost):
                done += min(cost, budget) - 1 + work
        except TenantBusy:
            continue
        gate.charge("a", work)
    # every admitted call found the bucket above 0: burst + refill + the last call's bill and debt
    worst_call = max(min(c, budget) - 1 + w for c, w in calls)
    assert done <= budget + clock.now_s * rate + worst_call + rate
    with gate.admit("b", budget):  # b's bucket is full: admitted at once, whatever a owes
        pass


def test_a_charged_tenant_waits_its_debt_out_and_the_debt_is_bounded() -> None:
    clock = StepClock(0.001)
    gate = TenantGate(budget_units=8, max_requests=4, wait_ms=50, rate_units_per_s=100, clock=clock)
    with gate.admit("a", 2):
        pass
    gate.charge("a", 10**9)  # an enormous bill: capped at one second of rate (100 units)
    with pytest.raises(TenantBusy), gate.admit("a", 2):  # 50 ms refill 5 units: still in debt
        pass
    for _ in range(10):
        with gate.admit("a", 1):  # calls without bulk still run, debt or not
            pass
    clock.now_s += 1.1  # one second of rate pays the capped debt
    with gate.admit("a", 2):
        pass
    TenantGate(budget_units=0, max_requests=1, wait_ms=0).charge("a", 5)  # off: a no-op


@settings(max_examples=25, deadline=None)
@given(
    rate=st.integers(50, 2000),
    per_call_items=st.integers(1, 1024),
    calls=st.lists(st.tuples(st.integers(1, 3), st.integers(0, 40)), min_size=1, max_size=120),
)
def test_with_a_per_call_cost_small_calls_are_rate_limited_too(
    rate: int, per_call_items: int, calls: list[tuple[int, int]]
) -> None:
    """``call_rate_units``: every call, also one of a single unit, pays into its tenant's
    bucket and waits while it is empty, so a flood of small calls (and their walks billed
    after) is held to the rate: spent <= one burst + the refill + the last call + one second
    of debt. Another tenant is untouched."""
    per_call = per_call_items / COST_ITEMS_PER_UNIT
    clock = StepClock(0.0005)
    budget = 8
    gate = TenantGate(budget, 4, 5, rate_units_per_s=rate, clock=clock, call_rate_units=per_call)
    spent = 0.0
    for cost, work in calls:
        try:
            with gate.admit("a", cost):
                spent += min(cost, budget) - 1 + per_call + work
        except TenantBusy:
            continue
        gate.charge("a", work)
    worst_call = max(min(c, budget) - 1 + per_call + w for c, w in calls)
    assert spent <= budget + clock.now_s * rate + worst_call + rate
    with gate.admit("b", 1):  # b's bucket is its own, full
        pass


def test_a_tenant_in_debt_waits_even_for_one_unit_calls_with_a_per_call_cost() -> None:
    clock = StepClock(0.001)
    gate = TenantGate(8, 4, 20, rate_units_per_s=100, clock=clock, call_rate_units=1 / 16)
    with gate.admit("a", 1):
        pass
    gate.charge("a", 10**9)  # walked far more than it asked for: one second of rate in debt
    with pytest.raises(TenantBusy, match="cost units per second"), gate.admit("a", 1):
        pass  # before the per-call cost, a one-unit call ran whatever the debt
    with gate.admit("b", 1):  # another tenant is not held by a's debt
        pass
    clock.now_s += 1.1
    with gate.admit("a", 1):  # the debt paid, a's small calls run again
        pass
    assert gate.refused == 1


def test_a_bill_after_a_bulk_call_never_forgives_the_debt_the_call_made() -> None:
    """A bulk call may take its tenant's bucket a whole budget into debt; the small bill for
    its walk that follows must not lift that debt to the one-second floor of a bill (it did:
    a 9-unit call at a rate of 1/s owed 7 s, and its 16-item bill cut that to 1 s)."""
    clock = StepClock(0.001)
    gate = TenantGate(budget_units=8, max_requests=4, wait_ms=50, rate_units_per_s=1, clock=clock)
    with gate.admit("a", 9):  # 8 tokens, then 7 owed: 1 left
        pass
    with gate.admit("a", 9):  # 1 token > 0: admitted, 6 in debt
        pass
    gate.charge("a", 16 / COST_ITEMS_PER_UNIT)
    clock.now_s += 2.0  # two seconds pay two of the six units
    with pytest.raises(TenantBusy, match="cost units per second"), gate.admit("a", 2):
        pass
    clock.now_s += 5.0
    with gate.admit("a", 2):  # the debt paid
        pass
