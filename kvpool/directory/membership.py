"""Node liveness in etcd: each node keeps ``<prefix>/nodes/<id>`` under its own lease
(``Membership``); the directory leader follows that prefix with a watch (``MemberWatch``)
and drops a node whose key is gone (its lease expired: SIGKILL, partition).

Both run as tasks on an ``EtcdSession``'s loop (one connection per process).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from kvpool.core.clock import Clock, MonotonicClock
from kvpool.core.errors import Unavailable
from kvpool.directory.etcd import EtcdSession, nodes_prefix

log = logging.getLogger("kvpool.membership")

# a watch that has heard nothing for this long is re-listed (a cut connection may not say so)
RELIST_AFTER_S = 10.0
MAX_TRACKED_NODES = 100_000  # absent-node records kept by a MemberWatch


class Membership:
    """A node's liveness key under its own lease, renewed every ttl/3 until ``leave``."""

    def __init__(self, etcd: EtcdSession, cluster: str, node_id: str, info: dict[str, Any], ttl_s: int = 3) -> None:
        self.etcd = etcd
        self.key = nodes_prefix(cluster) + node_id.encode()
        self.value = json.dumps(info).encode()
        self.ttl_s = ttl_s
        self.renew_period_s = max(0.1, ttl_s / 3)
        self.etcd_ok = True
        self.joined = threading.Event()  # set once the key was first written
        self._lease_id = 0
        self._task: asyncio.Task[None] | None = None

    def start(self, on_crash: Callable[[BaseException], None], first_round_s: float = 0.0) -> None:
        self.etcd.spawn("membership", self._keep(), on_crash)
        if first_round_s > 0:
            self.joined.wait(first_round_s)

    async def _keep(self) -> None:
        self._task = asyncio.current_task()
        try:
            while True:
                try:
                    await self._renew_or_join()
                    self.etcd_ok = True
                except Unavailable as err:
                    if self.etcd_ok:
                        log.warning("node liveness: %s", err)
                    self.etcd_ok = False
                await asyncio.sleep(self.renew_period_s)
        finally:
            await self._revoke()

    async def _renew_or_join(self) -> None:
        if self._lease_id:
            lease_id = self._lease_id
            reply = await self.etcd.call(lambda c: c.refresh_lease(lease_id))
            if reply is not None and int(reply.TTL) > 0:
                return
            log.warning("node liveness: lease expired; joining again")
            self._lease_id = 0
        lease = await self.etcd.call(lambda c: c.lease(self.ttl_s))
        self._lease_id = lease.id
        await self.etcd.call(lambda c: c.put(self.key, self.value, lease=lease))
        self.joined.set()

    async def _revoke(self) -> None:
        lease_id, self._lease_id = self._lease_id, 0
        if lease_id:
            try:
                await self.etcd.revoke(lease_id)
            except Unavailable:
                pass  # etcd expires it

    def leave(self) -> None:
        """Stop renewing and revoke the lease (the key goes at once, not after the TTL)."""
        try:
            self.etcd.run(lambda _client: self._stop(), timeout_s=self.etcd.timeout_s * 2)
        except Unavailable:
            pass

    async def _stop(self) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])


class MemberWatch:
    """The directory's view of which nodes hold a liveness key, kept by a watch.

    ``absent_since_ms(node)`` is 0 while the node's key exists, else the local time from
    which its absence is known (the listing that lacked it, or the DELETE event): a node
    registered before that moment and absent now is dead. -1 until the first listing.
    """

    def __init__(self, etcd: EtcdSession, cluster: str, clock: Clock | None = None) -> None:
        self.etcd = etcd
        self.prefix = nodes_prefix(cluster)
        self._clock = clock or MonotonicClock()
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._listed_ms = -1.0
        self._deleted_ms: dict[str, float] = {}
        self.ok = True
        self.synced = threading.Event()

    def start(self, on_crash: Callable[[BaseException], None]) -> None:
        self.etcd.spawn("member-watch", self._follow(), on_crash)

    def live(self) -> set[str]:
        with self._lock:
            return set(self._live)

    def absent_since_ms(self, node_id: str) -> float:
        with self._lock:
            if self._listed_ms < 0:
                return -1.0
            if node_id in self._live:
                return 0.0
            return max(self._listed_ms, self._deleted_ms.get(node_id, 0.0))

    async def _follow(self) -> None:
        while True:
            try:
                await self._list_and_watch()
            except Unavailable as err:
                if self.ok:
                    log.warning("directory: cannot follow node liveness in etcd: %s", err)
                self.ok = False
                await asyncio.sleep(1.0)

    async def _list_and_watch(self) -> None:
        listed_ms = self._clock.now_ms()
        reply = await self.etcd.call(lambda c: c.get_prefix(self.prefix))
        live = {bytes(kv.key)[len(self.prefix) :].decode() for kv in reply}
        with self._lock:
            self._live, self._listed_ms = live, listed_ms
            self._deleted_ms = {k: v for k, v in self._deleted_ms.items() if k not in live}
        self.ok = True
        self.synced.set()
        revision = int(reply.header.revision)
        watch = await self.etcd.call(lambda c: c.watch_prefix(self.prefix, start_revision=revision + 1))
        try:
            iterator = aiter(watch)
            while True:
                try:
                    async with asyncio.timeout(RELIST_AFTER_S):
                        event = await anext(iterator)
                except TimeoutError:
                    return  # re-list: cheap, and a silently cut watch heals
                self._apply(event.kind, bytes(event.kv.key)[len(self.prefix) :].decode())
        except StopAsyncIteration:
            return
        except Exception as exc:  # the watch stream broke: re-list
            raise self.etcd.unavailable(f"watch ended: {exc}") from None
        finally:
            try:
                await asyncio.wait_for(watch.cancel(), 1.0)
            except Exception:
                pass

    def _apply(self, kind: str, node_id: str) -> None:
        with self._lock:
            if kind == "PUT":
                self._live.add(node_id)
                self._deleted_ms.pop(node_id, None)
            elif kind == "DELETE":
                self._live.discard(node_id)
                if len(self._deleted_ms) >= MAX_TRACKED_NODES:
                    self._deleted_ms.pop(next(iter(self._deleted_ms)))
                self._deleted_ms[node_id] = self._clock.now_ms()
