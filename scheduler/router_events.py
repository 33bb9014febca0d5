"""Follow a pool node's KV events into the router's index, resyncing on a gap.

The source is anything with ``snapshot() -> (last_seq, hashes)``,
``events(from_seq) -> Iterator[KVEvent]``, ``node_id`` and ``close()``: the
``PoolSource`` adapter wraps ``kvpool.client.PoolClient`` (the only place that knows
its API), tests pass fakes. Protocol: snapshot, then stream from ``last_seq + 1``;
an event whose ``seq`` is not previous + 1 means events were lost, so drop the
stream and start over from a new snapshot. A failed connection is retried with a
bounded back-off; the follower never silently stops (its thread logs and retries).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

from kvpool.core.events import KVEvent
from kvpool.core.retry import RetryPolicy
from kvpool.core.spec import KVSpec
from kvpool.scheduler.router_core import RouterCore

log = logging.getLogger(__name__)


class EventSource(Protocol):
    node_id: str

    def snapshot(self) -> tuple[int, list[bytes]]: ...

    def events(self, from_seq: int) -> Iterator[KVEvent]: ...

    def close(self) -> None: ...


class PoolSource:
    """Adapter over ``kvpool.client.PoolClient`` (imported lazily: the client is optional here)."""

    def __init__(
        self, address: str, spec: KVSpec, salt: bytes = b"", token: str = "", tls_root_certs: bytes | None = None
    ) -> None:
        """``token``: the tenant credential for a pool with credentials; ``tls_root_certs``:
        the CA of a pool that serves TLS (docs/security.md)."""
        from kvpool.client.pool_client import PoolClient

        self._client = PoolClient.connect(address, spec, salt=salt, token=token, tls_root_certs=tls_root_certs)
        self.node_id: str = self._client.node_id or address

    def snapshot(self) -> tuple[int, list[bytes]]:
        return self._client.snapshot()

    def events(self, from_seq: int) -> Iterator[KVEvent]:
        return self._client.events(from_seq)

    def close(self) -> None:
        self._client.close()


class EventFollower:
    """Runs in its own thread: snapshot, stream, resync on a gap, retry on failure."""

    def __init__(
        self,
        connect: Callable[[], EventSource],
        core: RouterCore,
        retry_s: float = 0.5,
        max_retry_s: float = 5.0,
    ) -> None:
        self._connect = connect
        self.core = core
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self._stop = threading.Event()
        self._source: EventSource | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.gaps = 0
        self.errors = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="router-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            if self._source is not None:
                self._source.close()  # cancels the blocking stream
        if self._thread is not None:
            self._thread.join(timeout=5)

    def run(self) -> None:
        backoff = RetryPolicy(self.retry_s * 1000, self.max_retry_s * 1000).backoff()
        while not self._stop.is_set():
            try:
                self.follow_once()
                backoff.reset()
            except Exception as exc:  # keep following: the pool may restart
                self.errors += 1
                delay_s = backoff.next_delay_s()
                log.warning("event follower: %s; retrying in %.1f s", exc, delay_s)
                self._stop.wait(delay_s)

    def follow_once(self) -> None:
        """One snapshot + stream, until a gap, the stream's end or stop."""
        source = self._connect()
        with self._lock:
            self._source = source
        try:
            if self._stop.is_set():
                return
            last_seq, hashes = source.snapshot()
            self.core.resync(source.node_id, last_seq, hashes)
            expected = last_seq + 1
            for ev in source.events(expected):
                if self._stop.is_set():
                    return
                if ev.seq < expected:
                    continue  # already covered by the snapshot
                if ev.seq != expected:
                    self.gaps += 1
                    log.info("event gap on %s: got seq %d, expected %d; resyncing", ev.node_id, ev.seq, expected)
                    return
                self.core.apply_event(ev)
                expected += 1
        finally:
            with self._lock:
                self._source = None
            source.close()
