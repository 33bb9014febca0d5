"""Bounded records of what happened to blocks recently, for ``kvpool inspect lookup`` ("why
did this prompt miss?") and ``kvpool inspect hot`` (which blocks and prefixes are read most).

Guarantees (tests/unit/test_daemon_block_history.py, a hypothesis property test among them):
- ``RemovalLog`` keeps at most ``capacity`` records, the most recent removals; a block stored
  again loses its record (it is back, so nothing needs explaining); a block removed twice keeps
  the latest. Each record says how it went: ``evicted`` (by the tier's policy, naming it),
  ``checksum_failure`` (dropped after a failed check, on the tier that found it),
  ``io_error`` (the disk failed to read or write it), ``removed`` (a client's Remove, or
  ``kvpool inspect evict`` / ``clear``), and when (the node's clock, reported as an age).
- ``HotBlocks`` counts reads of at most ``capacity`` blocks and prefixes (after every read).
  When over, it halves every count and drops those that reach zero, again until under
  (amortised O(1) per read; blocks read often stay,
  one-off reads fall out), so the counts are a decayed popularity, not exact totals (docs say so).
  One read counts at most ``MAX_KEYS_PER_READ`` of its leading blocks.

- ``LeaseRefusals`` keeps, per namespace (at most ``capacity`` namespaces, least recently
  refused forgotten first), the latest lease this node refused or cut short and why (an
  error code's name, or ``NOT_PROMOTED``), until a lease of that namespace is granted again,
  so a lookup that hits can still say why the reader got nothing.

Nothing here is on the byte path: the node calls ``on_removed`` from its event sink and
``on_read`` after granting a lease, each an O(blocks) dict update under one lock.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from dataclasses import dataclass

#: removal records kept (about 120 bytes each)
REMOVAL_LOG_CAPACITY = 16_384
#: blocks and prefixes whose reads are counted at once
HOT_CAPACITY = 4_096
#: leading blocks of one read that are counted (a read's prefix is where sharing happens)
MAX_KEYS_PER_READ = 64

REASONS = ("evicted", "checksum_failure", "io_error", "removed")
#: namespaces whose latest lease refusal is kept
LEASE_REFUSAL_CAPACITY = 1_024
#: longest refusal message kept (a message names the namespace and the limit it hit)
MAX_REFUSAL_MESSAGE_CHARS = 300
#: why a lease was refused: an error code's name (TENANT_BUSY, PERMISSION_DENIED,
#: UNKNOWN_NAMESPACE, CAPACITY_EXHAUSTED for max_leases, INVALID_ARGUMENT for a batch past
#: max_batch_blocks, ...), or NOT_PROMOTED: a block held on disk / in HBM that host had no
#: room to take (host full of leased or pinned blocks, or the namespace's or tenant's quota)
NOT_PROMOTED = "NOT_PROMOTED"


@dataclass(frozen=True)
class Removal:
    """How a block left the node: ``reason`` in REASONS, from ``tier``, by ``policy``
    (evictions only), at ``at_ms`` on the node's clock."""

    reason: str
    tier: str
    policy: str
    at_ms: float


class RemovalLog:
    def __init__(self, capacity: int = REMOVAL_LOG_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._records: collections.OrderedDict[bytes, Removal] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.recorded = 0  # removals seen (including those that fell out)

    def on_removed(self, keys: Sequence[bytes], removal: Removal) -> None:
        records = self._records
        with self._lock:
            for key in keys:  # a key removed again moves to the end (the newest)
                records.pop(key, None)
                records[key] = removal
            self.recorded += len(keys)
            for _ in range(len(records) - self.capacity):
                records.popitem(last=False)

    def on_stored(self, keys: Sequence[bytes]) -> None:
        records = self._records
        with self._lock:
            for key in list(filter(records.__contains__, keys)):  # the membership pass in C
                records.pop(key, None)  # a key may come twice

    def get(self, key: bytes) -> Removal | None:
        with self._lock:
            return self._records.get(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)


class HotBlocks:
    """Decayed read counts of blocks and of prefixes (a read's first block)."""

    def __init__(self, capacity: int = HOT_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._blocks: dict[bytes, int] = {}
        self._prefixes: dict[bytes, tuple[int, int]] = {}  # first key -> (reads, longest read in blocks)
        self._lock = threading.Lock()

    def on_read(self, keys: Sequence[bytes]) -> None:
        """One read that was served ``keys`` (leading run, in chain order)."""
        if not keys:
            return
        with self._lock:
            for key in keys[:MAX_KEYS_PER_READ]:
                self._blocks[key] = self._blocks.get(key, 0) + 1
            while len(self._blocks) > self.capacity:  # ends: every count reaches 0 in log2(max) rounds
                self._blocks = {k: v // 2 for k, v in self._blocks.items() if v // 2 > 0}
            reads, longest = self._prefixes.get(keys[0], (0, 0))
            self._prefixes[keys[0]] = (reads + 1, max(longest, len(keys)))
            while len(self._prefixes) > self.capacity:
                self._prefixes = {k: (r // 2, n) for k, (r, n) in self._prefixes.items() if r // 2 > 0}

    def top_blocks(self, limit: int) -> list[tuple[bytes, int]]:
        with self._lock:
            return sorted(self._blocks.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]

    def top_prefixes(self, limit: int) -> list[tuple[bytes, int, int]]:
        """(first key, reads, longest read in blocks), most read first."""
        with self._lock:
            items = sorted(self._prefixes.items(), key=lambda kv: (-kv[1][0], kv[0]))[:limit]
        return [(k, reads, longest) for k, (reads, longest) in items]


@dataclass(frozen=True)
class LeaseRefusal:
    """The latest lease of a namespace this node refused (``code``: an error code's name or
    ``NOT_PROMOTED``), what it said, at ``at_ms`` on the node's clock."""

    code: str
    message: str
    at_ms: float


class LeaseRefusals:
    def __init__(self, capacity: int = LEASE_REFUSAL_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._records: collections.OrderedDict[bytes, LeaseRefusal] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.recorded = 0

    def note(self, namespace: bytes, code: str, message: str, at_ms: float) -> None:
        refusal = LeaseRefusal(code, message[:MAX_REFUSAL_MESSAGE_CHARS], at_ms)
        with self._lock:
            self._records.pop(namespace, None)
            self._records[namespace] = refusal
            self.recorded += 1
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)

    def on_granted(self, namespace: bytes) -> None:
        """A lease of ``namespace`` was granted: its readers are served again (a retry after
        TENANT_BUSY succeeded), so its refusal no longer explains anything."""
        if not self._records:  # the common case: nothing refused, no lock taken
            return
        with self._lock:
            self._records.pop(namespace, None)

    def get(self, namespace: bytes) -> LeaseRefusal | None:
        with self._lock:
            return self._records.get(namespace)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)
