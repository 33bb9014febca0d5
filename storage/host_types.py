"""The records and results of the host tier (``storage/host_store.py``): what an index entry,
a lease, a pending put and a grant hold, and the counters. Plain data, no locking: the
``HostStore`` that owns them changes them under its lock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from kvpool.core.events import EventKind


class EventSink(Protocol):
    """Receives a store's KV events: ``kind`` for ``keys`` of ``namespace``, and ``tier``,
    the tier where the blocks now live ("host", "disk" or "device"; for REMOVED, the tier
    they left). A ``HostStore`` knows only its own tier and leaves ``tier`` and ``cause``
    out (so a 3-argument callable still works there); a ``TieredStore`` always names both
    (docs/tiers.md: which events a block's moves send). ``cause`` says why a REMOVED block
    left when the store itself knows better than "evicted": ``"checksum_failure"`` (a
    lower tier read it back wrong) or ``"io_error"`` (the disk failed it); "" otherwise
    (an eviction, or whatever the caller of the store's method is doing)."""

    def __call__(
        self, kind: EventKind, keys: list[bytes], namespace: bytes, tier: str = "host", cause: str = "", /
    ) -> None: ...


#: called with an evicted entry and a view of its bytes before its slot is freed (demotion)
DemoteHook = Callable[["Entry", np.ndarray], None]


class Entry:
    """One committed block. Slotted: the index may hold millions."""

    __slots__ = ("checksum", "doomed", "hard_pin", "key", "leases", "namespace", "offset", "size", "soft_pin_until_ms")

    def __init__(self, key: bytes, offset: int, size: int, checksum: int, namespace: bytes) -> None:
        self.key = key
        self.offset = offset
        self.size = size
        self.checksum = checksum
        self.namespace = namespace
        self.leases = 0
        self.hard_pin = False
        self.soft_pin_until_ms = 0.0
        self.doomed = False  # removed from the index while leased; freed at last release


class BlockLocation(NamedTuple):
    """Where a leased block's bytes are, and their checksum. A named tuple, not a frozen
    dataclass: a lease builds one per block under the store lock, and a frozen dataclass's
    ``__init__`` (``object.__setattr__`` per field) was a third of ``lease``'s time."""

    offset: int
    size: int
    checksum: int


@dataclass(frozen=True)
class LeaseGrant:
    lease_id: int  # 0 when nothing was leased
    locations: list[BlockLocation]
    expires_ms: float
    # why blocks a lower tier holds could not be brought into host for this lease (host full
    # of leased or pinned blocks, or a quota); "" when nothing was refused (TieredStore.lease)
    not_promoted: str = ""


@dataclass(frozen=True)
class PutGrant:
    """The blocks to write as two parallel lists, not a list of pairs: the daemon sends them
    as two packed fields, and a put of 16,384 small blocks built and took apart ~50,000
    tuples per call."""

    put_id: int  # 0 when nothing needs writing
    indices: list[int]  # index in the request of each block to write
    offsets: list[int]  # its arena offset
    already_present: list[int]  # request indices skipped: committed already
    in_flight: list[int]  # request indices skipped: another writer is writing them now

    @property
    def slots(self) -> list[tuple[int, int]]:
        """(index in the request, arena offset) for each block to write."""
        return list(zip(self.indices, self.offsets, strict=True))


@dataclass(frozen=True)
class CommitResult:
    committed: int
    checksum_failed: list[int]  # request indices whose bytes did not match: dropped, not stored


@dataclass
class _PendingPut:
    """A put started and not committed: per slot its request index, key and offset, as three
    parallel lists (see ``PutGrant``)."""

    namespace: bytes
    block_bytes: int
    deadline_ms: float
    indices: list[int]
    keys: list[bytes]
    offsets: list[int]


@dataclass
class _Lease:
    entries: list[Entry]
    expires_ms: float


@dataclass
class StoreStats:
    hits: int = 0  # blocks served through leases
    misses: int = 0  # blocks asked for in a lease request but not served
    lookups: int = 0
    puts: int = 0  # blocks committed
    put_bytes: int = 0
    skipped_present: int = 0
    evictions: int = 0
    removed: int = 0
    checksum_failures: int = 0
    commit_checked_blocks: int = 0  # blocks re-checksummed at commit (all, or a same-host put's sample)
    expired_leases: int = 0
    reclaimed_puts: int = 0
