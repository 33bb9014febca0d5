"""A ``BlockPool`` that an engine can lean on while the pool daemon comes and goes.

An engine must keep serving when the pool is not running at start, is killed mid-run or
restarts: the pool is a cache, so every failure to reach it is a miss, never an engine
error. ``ResilientPool`` wraps the real client and

* hashes locally (the chain needs only the namespace), so lookups and saves can be
  planned without a connection;
* turns ``Unavailable`` / ``DeadlineExceeded`` into misses (lookup 0, get_into 0, put
  skipped), logs one warning when the pool goes away and one line when it is back;
* while down, does not call the pool at all until ``retry_interval_ms`` has passed, so a
  dead pool costs at most one call timeout per interval, not one per request;
* reconnects with a new ``connect`` after every outage (a fresh channel and a fresh
  namespace registration, so a restarted daemon with a new arena is used at once).

Other typed errors (a spec the daemon refuses, bad input) are raised: they are bugs or
configuration errors to fix, not outages. The clock is passed in (tests drive it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from kvpool.client.blocks import BlockFill, BlockUse
from kvpool.connectors.pool_api import BlockPool, SlotPool, Staged
from kvpool.core.clock import Clock
from kvpool.core.errors import DeadlineExceeded, Unavailable
from kvpool.core.hashing import block_hashes
from kvpool.core.spec import Namespace

log = logging.getLogger("kvpool.connectors")

T = TypeVar("T")
OUTAGES = (Unavailable, DeadlineExceeded)


class ResilientPool:
    """``BlockPool`` over ``connect()``; see the module docstring. Thread-safe."""

    def __init__(
        self,
        connect: Callable[[], BlockPool],
        namespace: Namespace,
        clock: Clock,
        retry_interval_ms: int,
        address: str = "",
    ) -> None:
        """``connect``: makes the underlying pool client (e.g. ``lambda: PoolClient.connect(...)``); while it is
        unavailable every call is a miss and a reconnect is tried at most every ``retry_interval_ms`` on
        ``clock``; ``address`` names the pool in logs.
        """
        if retry_interval_ms <= 0:
            raise ValueError("retry_interval_ms must be positive")
        self._connect = connect
        self.namespace = namespace
        self.spec = namespace.spec
        self._clock = clock
        self._retry_interval_ms = retry_interval_ms
        self._address = address
        self._lock = threading.Lock()
        self._client: BlockPool | None = None
        self._down_since_ms: float | None = None
        self._next_try_ms = 0.0
        self.outages = 0  # times the pool went from up (or never up) to down
        self.skipped_calls = 0  # calls answered as misses without trying, while down

    @property
    def available(self) -> bool:
        """Whether the pool is connected and was not found down since."""
        return self._down_since_ms is None and self._client is not None

    def try_connect(self) -> bool:
        """Connect now if not connected (raises what ``connect`` raises except outages)."""
        return self._call(lambda c: True, False) is True

    def _client_or_none(self) -> BlockPool | None:
        with self._lock:
            now = self._clock.now_ms()
            if self._down_since_ms is not None and now < self._next_try_ms:
                self.skipped_calls += 1
                return None
            client = self._client
        if client is None:
            client = self._connect()  # raises an outage while the pool is not there
            with self._lock:
                self._client = client
        return client

    def _call(self, work: Callable[[BlockPool], T], on_outage: T) -> T:
        try:
            client = self._client_or_none()
            if client is None:
                return on_outage
            result = work(client)
        except OUTAGES as err:
            with self._lock:
                # drop the client: its gRPC channel would sit in reconnect backoff (up to
                # minutes) after the daemon comes back; the next try connects afresh. It is
                # not closed here: another thread may be mid-call on it, reading its arena
                # mapping; it is released with its last reference.
                self._client = None
                now = self._clock.now_ms()
                self._next_try_ms = now + self._retry_interval_ms
                if self._down_since_ms is None:
                    self._down_since_ms = now
                    self.outages += 1
                    log.warning(
                        "kvpool: the pool at %s is unavailable (%s); serving without it (misses) and "
                        "retrying every %d ms",
                        self._address,
                        err.message,
                        self._retry_interval_ms,
                    )
            return on_outage
        with self._lock:
            if self._down_since_ms is not None:
                log.warning(
                    "kvpool: the pool at %s is back after %.0f ms",
                    self._address,
                    self._clock.now_ms() - self._down_since_ms,
                )
                self._down_since_ms = None
        return result

    # -- BlockPool --------------------------------------------------------------------------
    def hashes(self, token_ids: Any) -> list[bytes]:
        """The hash chain of ``token_ids`` (computed locally: works while the pool is down)."""
        return block_hashes(self.namespace, token_ids)

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks held; 0 while the pool is down."""
        if not hashes:
            return 0
        return self._call(lambda c: c.lookup(hashes), 0)

    def get_into(self, hashes: Sequence[bytes], out: Any) -> int:
        """Read leading blocks into ``out``; 0 while the pool is down (the engine recomputes)."""
        if not hashes:
            return 0
        return self._call(lambda c: c.get_into(hashes, out), 0)

    def put(self, hashes: Sequence[bytes], blocks: Any) -> Any:
        """Store blocks; skipped (counted) while the pool is down."""
        if not hashes:
            return None
        return self._call(lambda c: c.put(hashes, blocks), None)

    def stage_put(self, hashes: Sequence[bytes], fill: BlockFill) -> Staged | None:
        """Write blocks in place (``PoolClient.stage_put``); None while the pool is down. The
        client ``connect`` makes must be a ``SlotPool`` (``PoolClient`` is)."""
        if not hashes:
            return None
        return self._call(lambda c: cast(SlotPool, c).stage_put(hashes, fill), None)

    def read_with(self, hashes: Sequence[bytes], use: BlockUse) -> int:
        """Hand leading verified blocks to ``use`` in place (``PoolClient.read_with``); 0 while down."""
        if not hashes:
            return 0
        return self._call(lambda c: cast(SlotPool, c).read_with(hashes, use), 0)

    def close(self) -> None:
        """Close the underlying client, if any."""
        with self._lock:
            client, self._client = self._client, None
        close = getattr(client, "close", None)
        if close is not None:
            close()
