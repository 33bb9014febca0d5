"""What one disk tier knows, under one lock: the committed blocks (``index``), the blocks
queued for writing, which slot each live or pending block owns, the slot allocator, the
eviction policy and the counters, plus the placement rule (watermarks, evict by policy,
never a block being read).

Why one object: the writer, the reader, recovery and removal all change these together
(a removal must see a queued block, a read must pin an entry against eviction, recovery
installs a whole new set at once), so they share ``lock`` and nothing here does I/O: every
caller does its disk work outside it.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kvpool.core.errors import StorageFault
from kvpool.core.invariants import require
from kvpool.storage.disk_files import SlabFiles
from kvpool.storage.disk_index import DiskEntry, DiskIndexDB
from kvpool.storage.disk_layout import FILE_HEADER_BYTES, BufferPool
from kvpool.storage.disk_slots import DiskSlots
from kvpool.storage.eviction import EvictionPolicy, make_policy
from kvpool.storage.watermarks import WatermarkDrain

EvictSink = Callable[[list[bytes]], None]
#: blocks the tier dropped because reading or writing them failed, and why:
#: ``"checksum_failure"`` (the payload read back does not match its checksum) or
#: ``"io_error"`` (the read or the write failed), so "why did this miss" can say so
FailSink = Callable[[list[bytes], str], None]


@dataclass(frozen=True)
class DiskParts:
    """What the tier's reader and writer share: the state, the index, the files, the I/O
    pool, and the facade's callbacks (durable index deletes; blocks gone from the tier:
    evicted, or dropped after a failure, with its cause)."""

    state: DiskState
    db: DiskIndexDB
    files: SlabFiles
    pool: ThreadPoolExecutor
    delete: Callable[[list[bytes]], None]
    report_gone: EvictSink
    report_failed: FailSink


@dataclass
class DiskStats:
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0  # payload bytes written to disk
    bytes_out: int = 0  # payload bytes read from disk (incl. served from the write queue)
    writes: int = 0
    evictions: int = 0
    removed: int = 0
    checksum_failures: int = 0
    io_errors: int = 0
    queue_full_drops: int = 0  # demotions refused because the write-behind queue was full (exact count)
    disk_full: int = 0  # writes or preallocations refused because the filesystem was full
    unplaced_drops: int = 0  # demotions dropped: no slot could be freed
    queue_hits: int = 0  # reads served from the write-behind queue
    recovered_blocks: int = 0
    recovery_dropped: int = 0
    recovery_ms: float = 0.0
    index_rebuilt: bool = False
    faults: list[str] = field(default_factory=list)  # last few StorageFault messages


@dataclass
class QueuedBlock:
    """A block copied into an aligned buffer (header space + payload), waiting to be written."""

    key: bytes
    namespace: bytes
    size: int
    checksum: int
    buf: mmap.mmap
    cancelled: bool = False

    def payload(self) -> np.ndarray:
        return np.frombuffer(self.buf, dtype=np.uint8, count=self.size)


@dataclass(frozen=True)
class DiskBlock:
    """A block read back and verified: ``data`` is a private copy of its bytes."""

    key: bytes
    namespace: bytes
    checksum: int
    data: np.ndarray


class DiskState:
    """The shared state of one disk tier (see the module docstring). Every method is called
    with ``lock`` held unless it says otherwise."""

    def __init__(
        self,
        num_files: int,
        slab_file_bytes: int,
        policy: str,
        high_watermark: float,
        low_watermark: float,
        buffers: BufferPool,
    ) -> None:
        self.buffers = buffers  # the aligned buffers queued blocks and reads use
        self.lock = threading.RLock()
        self.idle = threading.Condition(self.lock)  # notified when a batch ends or recovery installs
        self.slab_file_bytes = slab_file_bytes
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.drain = WatermarkDrain(high_watermark, low_watermark)
        self.policy_name = policy
        self.policy: EvictionPolicy = make_policy(policy)
        self.index: dict[bytes, DiskEntry] = {}
        self.queued: dict[bytes, QueuedBlock] = {}
        self.slot_owner: dict[tuple[int, int], DiskEntry] = {}  # (file, slot) -> live entry
        self.slot_pending: dict[tuple[int, int], DiskEntry] = {}  # placed, index not yet committed
        self.slots = DiskSlots(num_files, slab_file_bytes)
        self.file_limit = num_files  # lowered when the disk runs out of space
        self.seq = 0
        self.stats = DiskStats()
        self.inflight_batches = 0
        self.closed = False
        self.recovered = threading.Event()
        self.removed_early: set[bytes] = set()  # removed while background recovery ran
        self.failed_early: set[bytes] = set()  # failed a check while background recovery ran

    def note_fault(self, fault: StorageFault) -> None:
        self.stats.faults = [*self.stats.faults[-4:], str(fault)]

    def io_fault(self, fault: StorageFault) -> None:
        """Record a failed disk operation (takes the lock itself)."""
        with self.lock:
            self.note_fault(fault)
            self.stats.io_errors += 1

    def slot_key(self, entry: DiskEntry) -> tuple[int, int]:
        slot = self.slots.slot_of(entry.slot_bytes, entry.offset)
        return entry.file, -1 if slot is None else slot

    def unown(self, entry: DiskEntry) -> None:
        slot_key = self.slot_key(entry)
        if self.slot_owner.get(slot_key) is entry:
            del self.slot_owner[slot_key]

    def forget(self, entry: DiskEntry) -> None:
        """Drop a committed entry from the index; its slot is freed now, or by its last
        reader (``doomed``) if a read holds it."""
        del self.index[entry.key]
        self.unown(entry)
        self.policy.on_remove(entry.key)
        if entry.readers:
            entry.doomed = True
        else:
            self.slots.free(entry.file, entry.offset)

    def finish_queued(self, block: QueuedBlock) -> None:
        """A queued block is written or dropped: forget it, recycle its buffer."""
        if self.queued.get(block.key) is block:
            del self.queued[block.key]
        self.buffers.release(block.buf)

    # -- placement and eviction ---------------------------------------------------------
    def alloc_slot(
        self,
        slot_bytes: int,
        victims: list[DiskEntry],
        new_files: list[tuple[int, int]],
        may_open: Callable[[int], bool],
        needs_file: Callable[[], bool],
        watermark: bool = True,
    ) -> tuple[int, int] | None:
        """A free slot, evicting by policy when the tier is full (never a block being read).
        None when nothing can be freed, or when ``needs_file()`` says an empty file must be
        preallocated first (outside the lock; the caller then asks again, ``watermark=False``
        since the watermark eviction already ran)."""
        if slot_bytes > self.slab_file_bytes - FILE_HEADER_BYTES:
            return None
        if watermark:
            self.evict_to_low_watermark(slot_bytes, victims)
        while True:
            empty_before = self.slots.empty_files
            where = self.slots.alloc(slot_bytes, may_open)
            if where is not None:
                if self.slots.empty_files < empty_before:  # an empty file was given this class
                    new_files.append((where[0], slot_bytes))
                return where
            if needs_file() or not self.evict_one(victims):
                return None

    def evict_to_low_watermark(self, slot_bytes: int, victims: list[DiskEntry]) -> None:
        """Once a write would take the tier above the high watermark (of the capacity it can
        use: ENOSPC may have stopped it short), each write evicts by policy its own room and as
        much again until usage is at the low watermark (storage/watermarks.py). The victims
        join the batch's durable index deletes like any other eviction; 1.0 / 1.0 evicts only
        when no slot is free."""
        capacity = self.file_limit * self.slab_file_bytes
        floor = self.drain.floor(self.slots.used_bytes, slot_bytes, capacity)
        self.drain.evict(floor, lambda: self.slots.used_bytes, lambda: self.evict_one(victims))

    def evict_one(self, victims: list[DiskEntry]) -> bool:
        """Evict one committed block by policy (never one being read); False if none can go."""
        key = self.policy.pop_victim(self.evictable)
        if key is None:
            return False
        victim = self.index.pop(key)
        self.unown(victim)
        victims.append(victim)
        self.stats.evictions += 1
        # Reusing the slot in this batch is safe: the batch commits the victims' index
        # deletes (synced) before any of its writes start, so no committed entry ever
        # points at bytes being overwritten.
        self.slots.free(victim.file, victim.offset)
        return True

    def evictable(self, key: bytes) -> bool:
        entry = self.index.get(key)
        return entry is not None and entry.readers == 0

    def check_invariants(self) -> None:
        """The tier's rules (debug mode; takes the lock; skipped while background recovery
        has not installed the index): every indexed block owns its slot, of its file's
        class, and is not doomed; queued blocks are live; the slots add up."""
        name = "DiskState"
        with self.lock:
            if not self.recovered.is_set() or self.closed:
                return
            self.slots.check_invariants()
            indexed = 0
            for key, entry in self.index.items():
                require(name, "an entry is indexed under its key", entry.key == key, key.hex)
                require(name, "an indexed entry is not doomed", not entry.doomed, key.hex)
                require(
                    name, "an indexed block owns its slot", self.slot_owner.get(self.slot_key(entry)) is entry, key.hex
                )
                require(
                    name,
                    "a block's slot is of its file's class",
                    self.slots.file_class[entry.file] == entry.slot_bytes,
                    key.hex,
                )
                require(name, "readers are not negative", entry.readers >= 0, key.hex)
                indexed += entry.slot_bytes
            for entry in self.slot_owner.values():
                require(name, "a slot's owner is indexed", self.index.get(entry.key) is entry, entry.key.hex)
            for key, block in self.queued.items():
                require(name, "a queued block is live", block.key == key and not block.cancelled, key.hex)
            require(name, "indexed blocks fit the used slots", indexed <= self.slots.used_bytes)
