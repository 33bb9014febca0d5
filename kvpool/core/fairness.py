"""Per-tenant fairness: a cost-weighted bound on what one tenant has in flight in a server.

One policy for three servers (``TenantLimits`` holds its options, ``TenantGate`` applies
them): the node's control plane (``kvpool/daemon/service.py``), the directory
(``kvpool/directory/service.py``, the same ``--tenant-*`` options) and the TCP data plane
(``kvpool/transport/shares.py``, bytes for cost units). It lives in core because all three
sit above it and none may import another.

Why: every tenant's calls share one pool of gRPC worker threads, one store lock and, in
Python, one interpreter lock. Without a bound, one tenant sending the largest requests the
daemon accepts (65,536-hash lookups, 4,096-id releases) back to back from many threads
takes most of the daemon's time and every worker, and another tenant's lookup waits
behind all of it (issue 10's benchmark target: the victim's lookup p99 within 2x of idle).

The rule (``TenantGate.admit``), per tenant (the credential's tenant name; without
credentials, the request's namespace, or the namespace of the lease or put a call names;
admin and cluster credentials are not gated):

- a call costs ``1 + items // COST_ITEMS_PER_UNIT`` units, ``items`` being the hashes,
  lease ids or checksums it carries (a 4,096-hash lookup costs 5, a 1-hash one 1; calls
  that scan the whole store, ``Snapshot``, cost a whole budget);
- a tenant may have at most ``budget_units`` units in flight; a call that does not fit
  waits (its tenant's calls are admitted in arrival order, so a large call is not starved
  by a stream of small ones) up to ``wait_ms`` for the tenant's own calls to finish, then
  is refused
  ``TenantBusy`` (``TENANT_BUSY``, gRPC RESOURCE_EXHAUSTED), having done nothing. A call
  that finds none of its tenant's calls in flight is always admitted, whatever its cost,
  so the largest allowed request still works, one at a time;
- a tenant may spend at most ``rate_units_per_s`` units per second on bulk (the units of
  a call beyond its first: a token bucket holding one budget, so bursts up to
  ``budget_units`` pass at once); a call past it waits for the tokens, up to ``wait_ms``,
  then is refused. **Every** call also pays ``call_rate_units`` (a fraction of a unit:
  ``--tenant-call-cost-items`` / 1024) into the bucket, and every call waits while its
  tenant's bucket is empty, so a flood of small calls is bounded by the rate too (its
  per-call cost: receiving, decoding, answering), and so is a tenant in debt for walked
  blocks; the fraction is small enough that an engine's call rate (thousands a second)
  never meets it. A refused call has still waited: a tenant that
  retries at once is slowed down by its own refusals (the daemon still pays for
  receiving each message: see docs/security.md for what this does not stop);
- work a call does that its request does not show (the blocks a hit lookup or a lease
  walks: a lookup of 8,192 hits takes several times the interpreter time of a 65,536-hash
  lookup that misses at once) is billed **after** the call (``charge``) against the same
  token bucket, which may go into debt by up to one second of rate: the tenant's next bulk
  calls wait it out. So a tenant flooding with the largest lookups that hit is held to its
  rate in work done, not in hashes sent;
- a tenant may hold at most ``max_requests`` worker threads (in flight and waiting
  together); past that a call is refused at once, so one tenant can never occupy every
  worker and other tenants always find one free.

Bounded: one small record per tenant with a call in flight (at most the worker count),
removed when its last call ends, and one token bucket per tenant seen lately
(``MAX_BUCKETS``, least recently used forgotten). ``budget_units`` 0 turns the gate off. Tests:
``tests/unit/test_daemon_fairness.py`` (hypothesis: the bounds hold under any
interleaving), ``tests/integration/test_tenant_limits.py::test_a_flooding_tenant_...``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvpool.core.errors import InvalidArgument, TenantBusy

#: items (hashes, lease ids, checksums) per cost unit beyond the first
COST_ITEMS_PER_UNIT = 1024
#: tenants whose token bucket is remembered (least recently used forgotten first: a full one)
MAX_BUCKETS = 4096
BUSY_HINT = "retry shortly (PoolClient does, with backoff), or send smaller batches (docs/security.md, fairness)"


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's share of a server: the ``--tenant-*`` options of ``kvpool serve`` and
    ``kvpool directory`` (the same names and meaning in both; docs/security.md)."""

    budget_units: int = 64  # cost units in flight per tenant; 0 = fairness off
    rate_units_per_s: int = 1000  # cost units per second per tenant; 0 = no rate
    max_calls: int = 0  # calls (in flight and waiting) per tenant; 0 = half the server's workers
    wait_ms: int = 200  # how long a call over its share waits before TENANT_BUSY
    walk_cost_items: int = 8  # items each block a lookup finds costs, billed after the call
    call_cost_items: int = 64  # items every call costs besides its own (small calls rate-limited too)

    def __post_init__(self) -> None:
        values = (
            self.budget_units,
            self.rate_units_per_s,
            self.max_calls,
            self.wait_ms,
            self.walk_cost_items,
            self.call_cost_items,
        )
        if min(values) < 0:
            raise InvalidArgument("the --tenant-* limits must be >= 0")

    def calls(self, workers: int) -> int:
        """Calls one tenant may hold in a server of ``workers`` threads (default half)."""
        return self.max_calls or max(1, workers // 2)

    def gate(self, workers: int) -> TenantGate:
        return TenantGate(
            self.budget_units,
            self.calls(workers),
            self.wait_ms,
            rate_units_per_s=self.rate_units_per_s,
            call_rate_units=self.call_cost_items / COST_ITEMS_PER_UNIT,
        )

    def walk_units(self, walked_blocks: int) -> float:
        """Cost units of ``walked_blocks`` found by a lookup, billed after it (``charge``)."""
        return self.walk_cost_items * max(0, walked_blocks) / COST_ITEMS_PER_UNIT


def tenant_key(named: bool, principal_name: str, namespace: bytes) -> Hashable:
    """Whose share a call counts against: with credentials (``named``) the credential's
    tenant; without (every caller is the same anonymous principal) the namespace the call
    names, or one shared share for calls that name none."""
    return principal_name if named else bytes(namespace)


def request_cost(items: int) -> int:
    """Cost units of a call that carries ``items`` hashes / ids / checksums."""
    return 1 + max(0, items) // COST_ITEMS_PER_UNIT


@dataclass
class _Share:
    cost: int = 0  # units of admitted calls
    requests: int = 0  # admitted and waiting calls
    queue: deque[int] = field(default_factory=deque)  # tickets of waiting calls, in arrival order
    next_ticket: int = 0


class TenantGate:
    def __init__(
        self,
        budget_units: int,
        max_requests: int,
        wait_ms: float,
        rate_units_per_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        call_rate_units: float = 0.0,
    ) -> None:
        """``call_rate_units``: what every call pays into its tenant's token bucket besides its
        bulk (0: calls of one unit are never rate-limited, the rule before)."""
        self.budget_units = budget_units
        self.call_rate_units = max(0.0, call_rate_units)
        self.max_requests = max(1, max_requests)
        self.wait_s = max(0.0, wait_ms) / 1000.0
        self.rate_units_per_s = max(0.0, rate_units_per_s)
        self._clock = clock
        self._cond = threading.Condition()
        self._shares: dict[Hashable, _Share] = {}
        # tenant -> [tokens, when last refilled]; least recently used first, MAX_BUCKETS at most
        self._buckets: OrderedDict[Hashable, list[float]] = OrderedDict()
        self.admitted = 0
        self.waited = 0  # admitted after waiting for room
        self.refused = 0

    @property
    def enabled(self) -> bool:
        return self.budget_units > 0

    def in_flight(self, tenant: Hashable) -> tuple[int, int]:
        """(cost units, calls) ``tenant`` has in the gate now."""
        with self._cond:
            share = self._shares.get(tenant)
            return (share.cost, share.requests) if share is not None else (0, 0)

    def tenants(self) -> int:
        with self._cond:
            return len(self._shares)

    def buckets(self) -> int:
        with self._cond:
            return len(self._buckets)

    def _tokens(self, tenant: Hashable, now: float) -> list[float]:
        """``tenant``'s token bucket, refilled to ``now`` (burst: one budget)."""
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = [float(self.budget_units), now]
            while len(self._buckets) > MAX_BUCKETS:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(tenant)
            bucket[0] = min(float(self.budget_units), bucket[0] + (now - bucket[1]) * self.rate_units_per_s)
            bucket[1] = now
        return bucket

    @contextmanager
    def admit(self, tenant: Hashable, cost: int, what: str = "call") -> Iterator[None]:
        """Run the body as one of ``tenant``'s calls of ``cost`` units, or raise TenantBusy."""
        if not self.enabled:
            yield
            return
        cost = max(1, cost)
        with self._cond:
            share = self._shares.setdefault(tenant, _Share())
            if share.requests >= self.max_requests:
                self._refuse(tenant, share)
                raise TenantBusy(
                    f"{what}: this tenant already has {share.requests} calls in this node (the most one tenant may)",
                    hint="wait for your calls to finish before sending more (fewer threads), then retry",
                )
            share.requests += 1
            ticket = share.next_ticket
            share.next_ticket += 1
            share.queue.append(ticket)
            deadline: float | None = None
            while True:
                now = self._clock()
                if deadline is None:
                    deadline = now + self.wait_s
                rated = self.rate_units_per_s and (cost > 1 or self.call_rate_units)
                bucket = self._tokens(tenant, now) if rated else None
                fits = share.cost == 0 or share.cost + cost <= self.budget_units
                if share.queue[0] == ticket and fits and (bucket is None or bucket[0] > 0):
                    break
                # in arrival order; room in flight; and, with a rate, tokens (the bucket may go into
                # debt by one call's cost: the calls after it wait the debt out)
                wake = deadline
                if bucket is not None and bucket[0] <= 0 and fits and share.queue[0] == ticket:
                    wake = min(deadline, now + (1e-6 - bucket[0]) / self.rate_units_per_s)
                # a call refused for its tenant's rate is refused only at its deadline, never at
                # once: a client that retries at once is slowed down too (backpressure), within
                # the worker threads its tenant may hold
                if now >= deadline:
                    share.queue.remove(ticket)
                    share.requests -= 1
                    self._refuse(tenant, share)
                    self._cond.notify_all()  # the call behind this one may be at the head now
                    raise TenantBusy(self._why(what, cost, share, bucket), hint=BUSY_HINT)
                self._cond.wait(wake - now)
            share.queue.popleft()
            if now > deadline - self.wait_s:
                self.waited += 1
            if bucket is not None:
                # the bulk part and the per-call part; a call alone owes one budget at most
                bucket[0] -= min(cost, self.budget_units) - 1 + self.call_rate_units
            share.cost += cost
            self.admitted += 1
            self._cond.notify_all()  # the next in line may fit beside this one
        try:
            yield
        finally:
            with self._cond:
                share.cost -= cost
                share.requests -= 1
                if share.requests == 0:
                    self._shares.pop(tenant, None)
                self._cond.notify_all()

    def charge(self, tenant: Hashable, units: float) -> None:
        """Bill ``units`` of work a call did beyond its admission cost (known only once it ran)
        to ``tenant``'s token bucket. A bill takes the bucket no lower than one second of rate
        in debt, so a tenant is never locked out for longer than that by one bill; it never
        forgives a deeper debt its admissions made (a bulk call may owe up to one budget).
        Without a rate this is a no-op."""
        if not self.enabled or not self.rate_units_per_s or units <= 0:
            return
        with self._cond:
            bucket = self._tokens(tenant, self._clock())
            bucket[0] = min(bucket[0], max(-self.rate_units_per_s, bucket[0] - units))

    def _why(self, what: str, cost: int, share: _Share, bucket: list[float] | None) -> str:
        if bucket is not None and bucket[0] <= 0:
            return (
                f"{what} of cost {cost}: this tenant used its {self.rate_units_per_s:g} cost units per second "
                f"in this node ({-bucket[0]:.0f} units over)"
            )
        return f"{what} of cost {cost}: this tenant has {share.cost} of its {self.budget_units} cost units in flight"

    def _refuse(self, tenant: Hashable, share: _Share) -> None:
        self.refused += 1
        if share.requests == 0:
            self._shares.pop(tenant, None)
