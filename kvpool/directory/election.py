"""Leader election of the directory instances, on etcd, fenced by revision and lease.

Each instance races to create one key (``leader_key``) bound to its own lease, in one
transaction (``create_revision == 0``). The winner's **term** is the key's create revision:
it leads only while

- the key still exists with that create revision (checked on every renewal), and
- its lease is known to be alive: ``is_leader`` is true only until ``renewed + ttl``, where
  ``renewed`` is the local time a renewal that etcd acknowledged was *sent*. etcd counts the
  lease's TTL from when it *received* that renewal, so the local deadline always passes
  first: a leader cut off from etcd stops serving writes before etcd can let anyone else
  take the key. That is what makes "one leader at a time" hold through a partition
  (``tests/integration/test_etcd_failover.py``), not only through a crash.

A standby watches the key (no polling) and campaigns again when it is deleted (the leader
resigned or its lease expired). Leadership lost for any reason is never resumed: the next
win is a new term. Terms only grow (etcd revisions do).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

import aetcd

from kvpool.core.clock import Clock, MonotonicClock
from kvpool.core.errors import Unavailable
from kvpool.directory.etcd import EtcdSession, leader_key, wait_for_change

log = logging.getLogger("kvpool.election")


class LeaderElection:
    """One directory instance's side of the election; runs on its ``EtcdSession``'s loop."""

    def __init__(
        self, etcd: EtcdSession, cluster: str, address: str, ttl_s: int = 3, clock: Clock | None = None
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.etcd = etcd
        self.key = leader_key(cluster)
        self.address = address
        self.ttl_s = ttl_s
        self.renew_period_s = max(0.1, ttl_s / 3)
        self._clock = clock or MonotonicClock()
        self._lock = threading.Lock()
        self._term = 0  # create revision of our leader key while we lead, else 0
        self._valid_until_ms = 0.0
        self._leader_address = ""
        self._etcd_ok = True
        self._stale_lease = 0  # a lease of a lost term, revoked before campaigning again
        self._task: asyncio.Task[None] | None = None
        self._started = threading.Event()
        self.terms_won = 0

    # -- what the service reads (any thread) -------------------------------------------------
    def is_leader(self) -> bool:
        with self._lock:
            return self._term > 0 and self._clock.now_ms() < self._valid_until_ms

    @property
    def term(self) -> int:
        """The term this instance leads in, 0 when it does not lead."""
        with self._lock:
            return self._term if self._term > 0 and self._clock.now_ms() < self._valid_until_ms else 0

    @property
    def leader_address(self) -> str:
        with self._lock:
            return self._leader_address

    @property
    def etcd_ok(self) -> bool:
        """False while etcd does not answer. A held term whose lease ran out unrenewed counts
        as not answering from that instant: ``is_leader`` turns false by the clock, while the
        renewal that etcd left unanswered times out (and closes its channel) only a moment
        later, and in that moment a status read must not say "not leader, etcd ok"."""
        with self._lock:
            lapsed = self._term > 0 and self._clock.now_ms() >= self._valid_until_ms
            return self._etcd_ok and not lapsed

    def _set(self, **fields: Any) -> None:
        with self._lock:
            for name, value in fields.items():
                setattr(self, f"_{name}", value)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, on_crash: Callable[[BaseException], None], first_round_s: float = 0.0) -> None:
        """Campaign until ``resign``; ``first_round_s`` > 0 waits that long for the first
        round to finish, so a lone instance leads as soon as ``start`` returns."""
        self.etcd.spawn("election", self._campaign(), on_crash)
        if first_round_s > 0:
            self._started.wait(first_round_s)

    def resign(self) -> None:
        """Stop campaigning; a leader revokes its lease (its key goes with it), so a standby
        takes over at once instead of after the TTL."""
        try:
            self.etcd.run(lambda _client: self._stop_campaign(), timeout_s=self.etcd.timeout_s * 2)
        except Unavailable:
            pass
        self._set(term=0)

    async def _stop_campaign(self) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])

    # -- the campaign (on the loop) ---------------------------------------------------------------
    async def _campaign(self) -> None:
        self._task = asyncio.current_task()
        try:
            while True:
                try:
                    await self._round()
                    self._set(etcd_ok=True)
                except Unavailable as err:
                    if self.etcd_ok:
                        log.warning("directory %s: %s", self.address, err)
                    self._set(etcd_ok=False)
                    self._started.set()
                    await asyncio.sleep(self.renew_period_s)
        finally:
            await self._give_up()

    async def _round(self) -> None:
        """One try: lead for as long as the lease holds, or stand by until the key changes."""
        if self._stale_lease:
            lease_id = self._stale_lease
            await self.etcd.revoke(lease_id)
            self._stale_lease = 0
        sent_ms = self._clock.now_ms()
        lease = await self.etcd.call(lambda c: c.lease(self.ttl_s))
        try:
            won, responses = await self.etcd.call(lambda c: self._take(c, lease))
        except Unavailable:
            self._stale_lease = lease.id
            raise
        if won:
            term = int(responses[0].response_put.header.revision)
            self._set(term=term, valid_until_ms=sent_ms + self.ttl_s * 1000.0, leader_address=self.address)
            self.terms_won += 1
            log.info("directory %s is now the leader (term %d)", self.address, term)
            self._started.set()
            try:
                await self._hold(lease, term)
            finally:
                self._set(term=0)
                self._stale_lease = lease.id
            return
        await self.etcd.revoke(lease.id)
        kvs = responses[0]  # aetcd: [(value, Get)] for the failure branch's range
        current_revision = int(kvs[0][1].mod_revision) if kvs else 0
        self._set(leader_address=bytes(kvs[0][0]).decode() if kvs else "")
        self._started.set()
        if current_revision:
            # the watch ends on any change of the key; re-read at least every TTL anyway
            await self.etcd.call(
                lambda c: wait_for_change(c, self.key, current_revision + 1, self.ttl_s * 2.0),
                timeout_s=self.ttl_s * 2.0 + self.etcd.timeout_s,
            )

    async def _take(self, client: aetcd.Client, lease: aetcd.Lease) -> tuple[bool, list[Any]]:
        tx = client.transactions
        result: tuple[bool, list[Any]] = await client.transaction(
            compare=[tx.create(self.key) == 0],
            success=[tx.put(self.key, self.address.encode(), lease=lease)],
            failure=[tx.get(self.key)],
        )
        return result

    async def _hold(self, lease: aetcd.Lease, term: int) -> None:
        """Renew every ttl/3; return when leadership is lost. Renewal failures are retried
        until the local deadline passes: after it ``is_leader`` is already false."""
        while True:
            await asyncio.sleep(self.renew_period_s)
            sent_ms = self._clock.now_ms()
            budget_s = max(0.1, (self._deadline_ms() - sent_ms) / 1000.0)  # no later than the lease
            try:
                reply = await self.etcd.call(lambda c: c.refresh_lease(lease.id), timeout_s=budget_s)
                current = await self.etcd.call(lambda c: c.get(self.key), timeout_s=budget_s)
            except Unavailable as err:
                self._set(etcd_ok=False)
                if self._clock.now_ms() >= self._deadline_ms():
                    log.warning("directory %s cannot renew its leader lease (%s): stepping down", self.address, err)
                    raise
                continue
            if reply is None or int(reply.TTL) <= 0:
                log.warning("directory %s: its leader lease expired: stepping down", self.address)
                return
            if current is None or int(current.create_revision) != term:
                log.warning("directory %s: the leader key is no longer its term %d: stepping down", self.address, term)
                return
            ttl_ms = min(self.ttl_s, int(reply.TTL)) * 1000.0
            self._set(valid_until_ms=sent_ms + ttl_ms, etcd_ok=True)

    def _deadline_ms(self) -> float:
        with self._lock:
            return self._valid_until_ms

    async def _give_up(self) -> None:
        """Revoke the lease of the term we held (which deletes our key with it; a newer
        leader's key is under its own lease and stays), bounded and best effort."""
        lease_id, self._stale_lease = self._stale_lease, 0
        self._set(term=0)
        if lease_id:
            try:
                await self.etcd.revoke(lease_id)
            except Unavailable:
                pass  # etcd expires the lease by itself
