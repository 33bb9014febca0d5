"""The directory's read leases and the removes they defer.

A lookup may lease its hits for a while (``lease_ms``, at most ``max_lease_ms``) so a
``Remove`` racing a read is forwarded to the nodes only once the read is done (its lease
released or expired). Bounded: at most ``max_leases`` leases at once; a lookup past that
gets its answer without a lease (``grant`` returns 0, counted in ``leases_refused``): its
read is then unprotected against a concurrent remove, and reads as a miss if it loses the
race (the node's read lease and the checksum guard the bytes), never as wrong bytes.

Lease ids are random 63-bit values (not a counter), and each lease remembers the namespace
of its keys: a ``Release`` names the namespaces its caller may use (``may_release``), so a
tenant can neither guess another tenant's lease ids nor release them if it did.

Not thread-safe on its own: ``DirectoryState`` calls it under its lock.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvpool.core.invariants import require
from kvpool.core.keys import NAMESPACE_BYTES

MAX_LEASES = 65_536


@dataclass
class _Lease:
    expires_ms: float
    keys: frozenset[bytes]
    namespace: bytes  # of its keys (one lookup names one namespace)


class LeaseTable:
    def __init__(
        self,
        max_lease_ms: int = 60_000,
        max_leases: int = MAX_LEASES,
        random_id: Callable[[], int] = lambda: secrets.randbits(63),
    ) -> None:
        """``random_id``: where lease ids come from (a seeded one in tests, to replay them)."""
        if max_lease_ms <= 0 or max_leases <= 0:
            raise ValueError("max_lease_ms and max_leases must be positive")
        self._random_id = random_id
        self.max_lease_ms = max_lease_ms
        self.max_leases = max_leases
        self._leases: dict[int, _Lease] = {}
        self._leased_count: dict[bytes, int] = {}
        self._deferred: dict[bytes, bytes] = {}  # block key -> namespace of the remove
        self.refused = 0

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def deferred(self) -> int:
        return len(self._deferred)

    def is_leased(self, key: bytes) -> bool:
        return key in self._leased_count

    def grant(self, keys: Sequence[bytes], lease_ms: int, now_ms: float) -> int:
        """Lease ``keys`` until ``now_ms + min(lease_ms, max_lease_ms)``; 0 when the table is
        full even after dropping the expired ones."""
        if len(self._leases) >= self.max_leases:
            self.expire(now_ms)
            if len(self._leases) >= self.max_leases:
                self.refused += 1
                return 0
        lease_id = 0
        while lease_id == 0 or lease_id in self._leases:
            lease_id = self._random_id()
        leased = frozenset(keys)
        namespace = keys[0][:NAMESPACE_BYTES] if keys else b""
        self._leases[lease_id] = _Lease(now_ms + min(lease_ms, self.max_lease_ms), leased, namespace)
        for key in leased:
            self._leased_count[key] = self._leased_count.get(key, 0) + 1
        return lease_id

    def release(self, lease_ids: Iterable[int], may_release: Callable[[bytes], bool] | None = None) -> int:
        """Drop these leases; with ``may_release`` only those whose namespace it accepts
        (the caller's own): another tenant's id is ignored, as an unknown one is."""
        released = 0
        for lease_id in lease_ids:
            lease = self._leases.get(lease_id)
            if lease is not None and (may_release is None or may_release(lease.namespace)):
                released += self._drop(lease_id)
        return released

    def expire(self, now_ms: float) -> int:
        due = [i for i, lease in self._leases.items() if lease.expires_ms <= now_ms]
        for lease_id in due:
            self._drop(lease_id)
        return len(due)

    def _drop(self, lease_id: int) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        for key in lease.keys:
            left = self._leased_count.get(key, 1) - 1
            if left <= 0:
                self._leased_count.pop(key, None)
            else:
                self._leased_count[key] = left
        return True

    def check_invariants(self) -> None:
        """Bounded, and the per-key lease counts are exactly the leases' keys (debug mode)."""
        name = "LeaseTable"
        require(name, "leases are bounded", len(self._leases) <= self.max_leases)
        counts: dict[bytes, int] = {}
        for lease in self._leases.values():
            for key in lease.keys:
                counts[key] = counts.get(key, 0) + 1
        require(name, "lease counts match the leases", counts == self._leased_count)

    # -- removes deferred by leases ------------------------------------------------------------
    def defer(self, key: bytes, namespace: bytes) -> None:
        """Forward the remove of ``key`` once no lease holds it (only leased keys wait: the
        table stays within the leased keys)."""
        self._deferred[key] = namespace

    def take_due(self) -> dict[bytes, list[bytes]]:
        """Deferred removes no lease holds any more, by namespace; forgotten here."""
        due = [k for k in self._deferred if k not in self._leased_count]
        by_ns: dict[bytes, list[bytes]] = {}
        for key in due:
            by_ns.setdefault(self._deferred.pop(key), []).append(key)
        return by_ns
