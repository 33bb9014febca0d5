"""The host tier of one node: index + slab allocator + eviction + leases + two-phase puts
over one arena buffer.

Guarantees (checked by tests/property/test_store_*):
- a block is visible to lookups only after ``put_commit``; a half-written block is never
  visible. The commit verifies every block's checksum in the arena, or for a same-host
  client's put a random sample (``verify_one_in``: then a bad block outside the sample is
  visible, and reported STORED, until its first read fails and drops it: never served);
- a leased block is never evicted, freed or overwritten: ``remove`` of a leased block hides
  it from new lookups and frees its slot only when the last lease is released or expires;
- a hard-pinned block, or a soft-pinned one before its TTL, is never evicted;
- used bytes never exceed the arena; a put that cannot fit fails whole (nothing stored
  before it is lost or changed);
- puts whose writer died (not committed by ``put_ttl_ms``) and leases not released by
  ``lease_ttl_ms`` are reclaimed by ``sweep``;
- keys are opaque and exact: the daemon's keys are ``namespace digest || hash``
  (``kvpool.core.keys``), so no call of one namespace reaches another's block
  (tests/integration/test_tenancy.py);
- lease and put ids are capabilities: the daemon passes an unguessable ``id_source``, so
  a caller cannot release, commit or abort another caller's lease or put by guessing;
- soft pin TTLs are at most ``max_pin_ttl_ms``;
- with ``namespace_quota_bytes``, no namespace holds more than that many bytes (committed
  and being written): a put past it evicts that namespace's own least recently used blocks
  first, never another's, and fails whole (nothing evicted) if they cannot make room;
- with tenant quotas (``set_tenant_quotas``: a tenant's ``quota_bytes`` in the credentials
  file), the namespaces of such a tenant hold at most that many bytes together, the same
  way: a put evicts only that tenant's blocks (``tests/unit/test_store_quota.py``);
- with segment owners (``set_segment_owners``: per-tenant arenas, docs/security.md), a
  block's slot lies in a segment of its namespace's owner, whichever path stored it (a put,
  a promotion from disk or device): room is made by evicting that owner's own blocks first
  (the watermark eviction too), then, if it still has no room, by emptying one whole
  segment of another owner whose blocks can all be evicted (the one with the fewest), never
  by evicting blocks whose slots it could not use (``tests/unit/test_store_segments.py``).

The store works on a plain uint8 buffer so tests can run it without shared memory; the
daemon hands it the mapped arena. Its records and results are in ``host_types.py``, its
debug checks in ``host_checks.py``, the room-making rules in ``host_room.py``; what stays
here (~890 lines) is the one state machine under the one lock, kept whole on purpose: every
transition above is a method whose lock scope can be read in one place (one exception: a
put's share of a watermark drain is evicted after its grant, in pieces, ``_drain_after``).
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvpool.core.checksum import checksum64, checksum_at
from kvpool.core.clock import Clock
from kvpool.core.config import StoreConfig
from kvpool.core.errors import CapacityExhausted, InvalidArgument, LeaseExpired, NotFound
from kvpool.core.events import EventKind
from kvpool.core.invariants import checked_after
from kvpool.core.keys import BlockKeys
from kvpool.storage.allocator import NewOwnerHook, SlabAllocator, slot_size_for
from kvpool.storage.eviction import EvictionPolicy, LRUPolicy
from kvpool.storage.host_checks import check_host_store
from kvpool.storage.host_room import check_can_fit, evict_segment, make_quota_room
from kvpool.storage.host_types import (
    BlockLocation,
    CommitResult,
    DemoteHook,
    Entry,
    EventSink,
    LeaseGrant,
    PutGrant,
    StoreStats,
    _Lease,
    _PendingPut,
)
from kvpool.storage.watermarks import WatermarkDrain

#: keys a lookup walks per hold of the store lock
LOOKUP_LOCK_KEYS = 512
#: keys of a lookup's first chunk (a lookup that misses at once builds only these)
LOOKUP_FIRST_KEYS = 16
#: evictions of a drain's share per hold of the store lock (``_drain_after``)
DRAIN_LOCK_BLOCKS = 512

__all__ = [
    "BlockLocation",
    "CommitResult",
    "DemoteHook",
    "Entry",
    "EventSink",
    "HostStore",
    "LeaseGrant",
    "PutGrant",
    "StoreStats",
]


class HostStore:
    """Index, allocation, eviction and leases of one arena. Thread-safe (one lock)."""

    def __init__(
        self,
        buffer: np.ndarray,
        config: StoreConfig,
        clock: Clock,
        policy: EvictionPolicy | None = None,
        on_event: EventSink | None = None,
        on_evict: DemoteHook | None = None,
        id_source: Callable[[], int] | None = None,
        segment_bytes: int = 0,
    ) -> None:
        """``id_source``: lease and put ids (default 1, 2, 3, ...; the daemon passes random
        63-bit ids, so ids double as capabilities). ``segment_bytes``: the arena's segments
        (a per-tenant arena, ``set_segment_owners``); 0 = one piece."""
        if buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer.size < config.capacity_bytes:
            raise InvalidArgument("the store's buffer must be a 1-D uint8 array of at least capacity_bytes")
        self._buffer = buffer
        self.config = config
        self._clock = clock
        self._policy: EvictionPolicy = policy if policy is not None else LRUPolicy()
        self._on_event = on_event
        self._on_evict = on_evict
        self._alloc = SlabAllocator(config.capacity_bytes, config.slab_bytes, segment_bytes)
        self._drain = WatermarkDrain(config.high_watermark, config.low_watermark)
        self._segmented = segment_bytes > 0
        # segment owners: namespace -> owner (per-tenant arenas); empty = one owner, 0, for all
        self._owner_of: dict[bytes, int] = {}
        self._index: dict[bytes, Entry] = {}
        self._pending: dict[int, _PendingPut] = {}
        self._pending_keys: set[bytes] = set()
        # puts between the two halves of put_commit (verifying outside the lock): their slots
        # are still allocated and their keys still in flight
        self._verifying: dict[int, _PendingPut] = {}
        self._leases: dict[int, _Lease] = {}
        self._id_source: Callable[[], int] = id_source if id_source is not None else itertools.count(1).__next__
        self._lock = threading.RLock()
        self._protected: set[bytes] = set()  # keys a put in progress reported present: not evictable
        self._evicted: list[bytes] = []  # evicted by the put_start under way, reported at its end
        self._ns_bytes: dict[bytes, int] = {}  # namespace -> bytes committed + being written
        # tenant quotas: namespace -> (tenant, its quota); tenant -> bytes of all its namespaces
        self._tenant_of: dict[bytes, tuple[str, int]] = {}
        self._tenant_bytes: dict[str, int] = {}
        self.stats = StoreStats()
        # which blocks of a same-host put are re-checksummed at commit (``put_commit``)
        self._sampler = random.Random(os.urandom(16))

    # -- reads ---------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys present (longest cached prefix). Does not lease.

        The walk takes the lock ``LOOKUP_LOCK_KEYS`` keys at a time, so another tenant's
        short call gets in between the chunks of a long lookup instead of waiting for all
        of it. A lookup is a hint (the lease that follows is what counts), so a block
        removed or added between two chunks only changes the hint."""
        self._check_batch(keys)
        with self._lock:
            self.stats.lookups += 1
        n, total, size = 0, len(keys), LOOKUP_FIRST_KEYS
        while n < total:
            # keys are built outside the lock (a list comprehension in BlockKeys' slice) and
            # walked in C (takewhile over the dict's __contains__): about 2-3x less interpreter
            # time per hit than a Python loop, which is what a hit flood costs other tenants
            chunk = keys[n : n + size]
            with self._lock:
                found = len(list(itertools.takewhile(self._index.__contains__, chunk)))
            n += found
            if found < len(chunk):
                break
            size = LOOKUP_LOCK_KEYS
        return n

    def lookup_by_tier(self, keys: Sequence[bytes]) -> dict[str, int]:
        """``lookup`` with the tier holding each block of the leading run: here, all "host"
        (the daemon counts lookup hits per tier with it, docs/architecture.md "Counters")."""
        return {"host": self.lookup(keys)}

    @checked_after
    def drop_corrupt(self, keys: Sequence[bytes]) -> list[bytes]:
        """Re-verify the named blocks against their committed checksums and drop those whose
        bytes no longer match (counted in ``checksum_failures``, REMOVED sent), so the next
        put stores fresh bytes. A reader's report is never trusted by itself: a block that
        verifies is kept, whoever says otherwise (its lease may have expired and its slot
        been reused, or the bytes may have been damaged on the wire). Returns the dropped keys."""
        self._check_batch(keys)
        with self._lock:
            dropped = self.corrupt_keys(keys)
            namespace = b""
            for key in dropped:
                entry = self._index[key]
                self._policy.on_remove(key)
                namespace = entry.namespace
                self._unindex(entry)  # a leased block is hidden now and freed at its last release
            self.stats.checksum_failures += len(dropped)
            self.stats.removed += len(dropped)  # as TieredStore.drop_corrupt counts it (it removes)
            if dropped:
                self._emit(EventKind.REMOVED, dropped, namespace)
            return dropped

    def corrupt_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The named blocks held here whose bytes no longer match their committed checksum
        (checked, not dropped: the tiered store drops them from every tier)."""
        self._check_batch(keys)
        with self._lock:
            bad: list[bytes] = []
            for key in dict.fromkeys(keys):
                entry = self._index.get(key)
                if entry is not None and not self._intact(entry):
                    bad.append(key)
            return bad

    def _intact(self, entry: Entry) -> bool:
        return checksum64(self._buffer[entry.offset : entry.offset + entry.size]) == entry.checksum

    @checked_after
    def lease(self, keys: Sequence[bytes]) -> LeaseGrant:
        """Lease the leading present keys for reading; their bytes stay put until release."""
        self._check_batch(keys)
        with self._lock:
            now = self._clock.now_ms()
            entries: list[Entry] = []
            find = self._index.get
            for key in keys:
                entry = find(key)
                if entry is None:
                    break
                entries.append(entry)
            self.stats.hits += len(entries)
            self.stats.misses += len(keys) - len(entries)
            expires = now + self.config.lease_ttl_ms
            if not entries:
                return LeaseGrant(0, [], expires)
            if len(self._leases) >= self.config.max_leases:
                self._expire_leases(now)
                if len(self._leases) >= self.config.max_leases:
                    raise CapacityExhausted(
                        f"{len(self._leases)} read leases are held (max_leases)",
                        hint="release leases after reading, or raise --max-leases",
                    )
            on_access = self._policy.on_access
            locations: list[BlockLocation] = []
            for entry in entries:  # one pass: count the lease, touch the policy, say where it is
                entry.leases += 1
                on_access(entry.key)
                locations.append(BlockLocation(entry.offset, entry.size, entry.checksum))
            lease_id = self._new_id()
            self._leases[lease_id] = _Lease(entries, expires)
            return LeaseGrant(lease_id, locations, expires)

    @checked_after
    def release(self, lease_id: int) -> None:
        """End a read lease. Releasing an unknown or expired lease raises LeaseExpired: the
        caller's copy may have raced with reuse of the slot and must be re-verified."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                raise LeaseExpired(
                    f"lease {lease_id} is unknown or expired",
                    hint="reads must finish within lease_ttl_ms; data read under it must be re-verified",
                )
            self._drop_lease(lease)

    @checked_after
    def release_many(self, lease_ids: Sequence[int]) -> int:
        """End several read leases under one lock; returns how many were unknown or expired
        (no exception per id: a caller sending thousands of stale ids costs one pass)."""
        with self._lock:
            unknown = 0
            for lease_id in lease_ids:
                lease = self._leases.pop(lease_id, None)
                if lease is None:
                    unknown += 1
                else:
                    self._drop_lease(lease)
            return unknown

    # -- writes --------------------------------------------------------------------------
    @checked_after
    def put_start(self, namespace: bytes, keys: Sequence[bytes], block_bytes: int) -> PutGrant:
        """Reserve a slot for every key not present nor being written. All or nothing."""
        self._check_batch(keys)
        self._alloc.check_block_bytes(block_bytes)
        key_list = keys[:] if isinstance(keys, BlockKeys) else list(keys)  # BlockKeys: one numpy pass
        grant, drain_to, keep = self._put_start_locked(namespace, key_list, block_bytes)
        if drain_to is not None:
            try:
                self._drain_after(drain_to, keep)
            except BaseException:  # the event sink failed: the put goes, as if its own evictions had failed
                self.put_abort(grant.put_id)
                raise
        return grant

    def _put_start_locked(
        self, namespace: bytes, key_list: list[bytes], block_bytes: int
    ) -> tuple[PutGrant, float | None, set[bytes]]:
        """``put_start``'s work under one hold of the lock: (the grant, the usage its share of
        a watermark drain is evicted down to after it, or None; the keys reported present)."""
        with self._lock:
            now = self._clock.now_ms()
            if len(self._pending) >= self.config.max_pending_puts:
                self._reclaim_puts(now)
                if len(self._pending) >= self.config.max_pending_puts:
                    raise CapacityExhausted(
                        f"{len(self._pending)} puts are in flight (max_pending_puts)",
                        hint="commit or abort puts, or raise --max-pending-puts",
                    )
            present, in_flight, indices, wanted = self._split_new(key_list)
            self.stats.skipped_present += len(present)
            if not wanted:
                return PutGrant(0, [], [], present, in_flight), None, set()
            # the writer skips the blocks we report present: making room must not evict them
            keep = {key_list[i] for i in present}
            self._protected = keep
            try:
                need = len(wanted) * block_bytes
                owner = self._owner_of.get(namespace, 0)
                if self.config.namespace_quota_bytes or namespace in self._tenant_of:
                    # the arena's room first: the quota pass evicts, and a put that then found no
                    # room in the arena would have cost those blocks for nothing
                    check_can_fit(self, len(wanted), block_bytes, owner)
                    make_quota_room(self, namespace, need)
                offsets, drain_to = self._allocate(len(wanted), block_bytes, now, owner)
            finally:
                self._protected = set()
                self._report_evicted()  # those of a failed quota pass (_allocate reports its own)
            self._count(namespace, need)
            put_id = self._new_id()
            deadline_ms = now + self.config.put_ttl_ms
            self._pending[put_id] = _PendingPut(namespace, block_bytes, deadline_ms, indices, wanted, offsets)
            self._pending_keys.update(wanted)
            grant = PutGrant(put_id, indices[:], offsets[:], present, in_flight)  # copies: the put keeps its own
            return grant, drain_to, keep

    def _drain_after(self, drain_to: float, keep: set[bytes]) -> None:
        """A put's share of a watermark drain (storage/watermarks.py), evicted after its slots
        were granted, ``DRAIN_LOCK_BLOCKS`` at a time with the lock let go in between: a share
        is up to twice the put (8,192 evictions, ~16 ms, for a put of 4,096 blocks), and other
        callers' lookups and leases run between the pieces instead of waiting it out. After
        the grant, so a put never fails having evicted for its share; ``keep``: the blocks the
        put reported present, never evicted for it. ``drain_to`` is a usage level: puts that
        allocate meanwhile raise usage and this share evicts for them too (bounded by the low
        watermark the level was set from)."""
        used, evict_one = (lambda: self._alloc.used_bytes), (lambda: self._evict_one(None))
        while True:
            with self._lock:
                self._protected = keep
                try:
                    done = self._drain.evict(drain_to, used, evict_one, DRAIN_LOCK_BLOCKS)
                finally:
                    self._protected = set()
                    self._report_evicted()
            if done:
                return
            time.sleep(0)  # let a waiting caller take the lock

    def _split_new(self, keys: list[bytes]) -> tuple[list[int], list[int], list[int], list[bytes]]:
        """(present, in flight, indices to write, their keys) of a put's keys (lock held): a
        key committed already, one another put is writing or an earlier copy in the same
        request is skipped. The usual put (every key new) is recognised in three passes in C
        before the per-key walk."""
        index, pending = self._index, self._pending_keys
        if not any(map(index.__contains__, keys)) and pending.isdisjoint(keys) and len(set(keys)) == len(keys):
            return [], [], list(range(len(keys))), keys
        present: list[int] = []
        in_flight: list[int] = []
        indices: list[int] = []
        wanted: list[bytes] = []
        seen: set[bytes] = set()
        for i, key in enumerate(keys):
            if key in index:
                present.append(i)
            elif key in pending or key in seen:
                in_flight.append(i)
            else:
                seen.add(key)
                indices.append(i)
                wanted.append(key)
        return present, in_flight, indices, wanted

    @checked_after
    def put_commit(self, put_id: int, checksums: Sequence[int], verify_one_in: int = 1) -> CommitResult:
        """Verify the written blocks against their checksums and make the good ones visible.

        ``verify_one_in``: 1 (the default, for bytes that crossed a wire or came from
        anywhere this store cannot vouch for) re-checksums every block. N > 1 is for a
        same-host client that checksummed each block's source in the pass that copied it
        (``kvpool.client.blocks``): one block in N, at least one per put, chosen at random,
        and the whole put once any of those fails. Every reader verifies every block it
        reads (``get_into``, ``read_with``, the data plane, demotion to disk), so a block
        that slips through is a miss and dropped on its first read, never wrong KV; the
        sample catches a client whose writes are broken at its first put, for the cost of
        a second pass over 1/N of the bytes (a full pass is a third of a put's time here:
        docs/benchmarks.md).

        The checksums are computed outside the store lock, so puts of several clients
        verify at once and no lookup or lease waits behind a put's bytes: the put is taken
        out of the pending table first (nobody can reclaim, abort or write its slots then;
        its slots stay allocated and its keys stay "in flight"), then verified, then its
        good blocks are indexed under the lock."""
        if verify_one_in < 1:
            raise InvalidArgument(f"verify_one_in must be >= 1, not {verify_one_in}")
        # one block at random from each group of verify_one_in (drawn before the put is taken
        # out of the pending table, and outside the lock); None: every block
        sample = None
        if verify_one_in > 1:
            count, pick = len(checksums), self._sampler.randrange
            sample = [i + pick(min(verify_one_in, count - i)) for i in range(0, count, verify_one_in)]
        with self._lock:
            pending = self._pending.pop(put_id, None)
            if pending is None:
                raise NotFound(
                    f"put {put_id} is unknown: never started, already finished, or reclaimed after put_ttl_ms",
                    hint="start the put again",
                )
            if len(checksums) != len(pending.keys):
                self._drop_put(pending)
                raise InvalidArgument(
                    f"commit carries {len(checksums)} checksums for {len(pending.keys)} written blocks; put aborted"
                )
            self._verifying[put_id] = pending
        size = pending.block_bytes
        try:
            matches, checked = self._verify_written(pending, checksums, sample)
        except BaseException:  # nothing is indexed: the put is aborted, its slots freed
            with self._lock:
                del self._verifying[put_id]
                self._drop_put(pending)
            raise
        with self._lock:
            del self._verifying[put_id]
            self._pending_keys.difference_update(pending.keys)
            committed: list[bytes] = []
            failed: list[int] = []
            namespace, index, on_insert = pending.namespace, self._index, self._policy.on_insert
            slots = zip(pending.indices, pending.keys, pending.offsets, checksums, matches, strict=True)
            for request_index, key, offset, checksum, ok in slots:
                if not ok:
                    self._alloc.free(offset)
                    self._count(namespace, -size)
                    failed.append(request_index)
                    continue
                index[key] = Entry(key, offset, size, checksum, namespace)
                on_insert(key)
                committed.append(key)
            self.stats.puts += len(committed)
            self.stats.put_bytes += len(committed) * size
            self.stats.checksum_failures += len(failed)
            self.stats.commit_checked_blocks += checked
            if committed:
                self._emit(EventKind.STORED, committed, pending.namespace)
            return CommitResult(len(committed), failed)

    def _verify_written(
        self, pending: _PendingPut, checksums: Sequence[int], sample: list[int] | None
    ) -> tuple[list[bool], int]:
        """Per slot of ``pending``: whether its bytes match ``checksums``, and how many blocks
        were checksummed (outside the lock). ``sample``: the slots to check (None: all); a
        slot left out counts as matching, unless a sampled one fails (``put_commit``)."""
        offsets = pending.offsets
        checked = 0
        if sample is not None:
            digests = checksum_at(self._buffer, [offsets[i] for i in sample], pending.block_bytes)
            checked = len(sample)
            if all(digests[j] == checksums[i] for j, i in enumerate(sample)):
                return [True] * len(offsets), checked
            # a sampled block is bad: this writer's bytes cannot be trusted, check them all
        digests = checksum_at(self._buffer, offsets, pending.block_bytes)
        matches = [digest == checksum for digest, checksum in zip(digests, checksums, strict=True)]
        return matches, checked + len(offsets)

    def _drop_put(self, pending: _PendingPut) -> None:
        """Forget a put taken out of ``_pending``: its keys, slots and bytes (lock held)."""
        self._pending_keys.difference_update(pending.keys)
        for off in pending.offsets:
            self._alloc.free(off)
        self._count(pending.namespace, -len(pending.keys) * pending.block_bytes)

    def write_slot(self, put_id: int, slot: int, data: np.ndarray) -> bool:
        """Copy one block into ``grant.slots[slot]`` of a pending put, only if that put still
        holds the slot.

        A remote writer receives into a private buffer and copies through here: the check and
        the copy happen under the store lock, so a writer whose put was reclaimed (put_ttl_ms)
        can never overwrite a slot that another put has since been given. False = the put is
        gone (or ``slot`` is out of range, or ``data`` is not one block): nothing was written."""
        with self._lock:
            pending = self._pending.get(put_id)
            if pending is None or not 0 <= slot < len(pending.offsets) or data.nbytes != pending.block_bytes:
                return False
            offset = pending.offsets[slot]
            self._buffer[offset : offset + pending.block_bytes] = data.reshape(-1).view(np.uint8)
            return True

    def owner_of(self, capability_id: int) -> bytes | None:
        """The namespace of a live lease or pending put (the daemon counts a Release,
        PutCommit or PutAbort, which name no namespace, against it for per-tenant
        fairness), or None when the id is neither."""
        with self._lock:
            pending = self._pending.get(capability_id)
            if pending is not None:
                return pending.namespace
            lease = self._leases.get(capability_id)
            return lease.entries[0].namespace if lease is not None and lease.entries else None

    def put_in_flight(self, key: bytes) -> float | None:
        """The deadline (ms, this store's clock) of a put of ``key`` started and not yet
        committed, aborted or reclaimed, else None. Scans the pending puts (at most
        ``max_pending_puts``): for ``kvpool inspect lookup``, not for the hot path."""
        with self._lock:
            if key not in self._pending_keys:
                return None
            for put in self._pending.values():
                if key in put.keys:
                    return put.deadline_ms
        return None

    def put_pending(self, put_id: int) -> bool:
        """Whether ``put_id`` is a put started and not yet committed, aborted or reclaimed
        (the arena hand-off gives a writable mapping only to a client holding one)."""
        with self._lock:
            return put_id in self._pending

    @checked_after
    def put_abort(self, put_id: int) -> None:
        with self._lock:
            pending = self._pending.pop(put_id, None)
            if pending is None:
                return
            self._drop_put(pending)

    @checked_after
    def remove(self, keys: Sequence[bytes]) -> int:
        """Remove blocks; a leased one disappears from lookups now and is freed at release."""
        self._check_batch(keys)
        with self._lock:
            removed: list[bytes] = []
            namespace = b""
            for key in keys:
                entry = self._index.get(key)
                if entry is None:
                    continue
                self._policy.on_remove(key)
                namespace = entry.namespace
                self._unindex(entry)
                removed.append(key)
            self.stats.removed += len(removed)
            if removed:
                self._emit(EventKind.REMOVED, removed, namespace)
            return len(removed)

    @checked_after
    def pin(self, keys: Sequence[bytes], ttl_ms: int | None) -> int:
        """Pin present blocks: hard (ttl_ms None) until unpinned, soft until now + ttl_ms."""
        self._check_batch(keys)
        if ttl_ms is not None and not 0 < ttl_ms <= self.config.max_pin_ttl_ms:
            raise InvalidArgument(
                f"soft pin ttl_ms {ttl_ms} is outside 1..{self.config.max_pin_ttl_ms} ms",
                hint="pin for at most max_pin_ttl_ms and renew it, or use a hard pin",
            )
        with self._lock:
            until = self._clock.now_ms() + ttl_ms if ttl_ms is not None else 0.0
            n = 0
            for key in keys:
                entry = self._index.get(key)
                if entry is None:
                    continue
                if ttl_ms is None:
                    entry.hard_pin = True
                else:
                    entry.soft_pin_until_ms = max(entry.soft_pin_until_ms, until)
                n += 1
            return n

    @checked_after
    def unpin(self, keys: Sequence[bytes]) -> int:
        self._check_batch(keys)
        with self._lock:
            n = 0
            for key in keys:
                entry = self._index.get(key)
                if entry is not None and (entry.hard_pin or entry.soft_pin_until_ms):
                    entry.hard_pin = False
                    entry.soft_pin_until_ms = 0.0
                    n += 1
            return n

    # -- upkeep --------------------------------------------------------------------------
    @checked_after
    def sweep(self) -> tuple[int, int]:
        """Drop expired leases and reclaim puts whose writer died. Returns (leases, puts)."""
        with self._lock:
            now = self._clock.now_ms()
            return self._expire_leases(now), self._reclaim_puts(now)

    def snapshot_keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def tier_of(self, key: bytes) -> str:
        """ "host" if the block is here, else "" (the tiered store answers for lower tiers)."""
        with self._lock:
            return "host" if key in self._index else ""

    def entry(self, key: bytes) -> Entry | None:
        with self._lock:
            return self._index.get(key)

    def report_absent(self, keys: list[bytes], report: Callable[[list[bytes]], None]) -> None:
        """Call ``report`` with those of ``keys`` this tier does not hold, under its lock:
        a put that commits one of them is ordered after the report (its STORED follows), so
        a lower tier's "gone" can never be the last word on a block host holds."""
        with self._lock:
            absent = [k for k in keys if k not in self._index]
            if absent:
                report(absent)

    def used_bytes(self) -> int:
        return self._alloc.used_bytes

    @checked_after
    def set_tenant_quotas(self, quotas: dict[bytes, tuple[str, int]]) -> None:
        """Give tenants their own quotas: ``quotas`` maps each namespace of a tenant that has
        one to (tenant name, quota bytes); the namespace's bytes then count against the
        tenant's quota, together with its other namespaces', instead of
        ``namespace_quota_bytes``. Set once at start, before any put."""
        with self._lock:
            if self._index or self._pending:
                raise InvalidArgument("tenant quotas are set before the store holds anything")
            self._tenant_of = dict(quotas)

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes the namespaces of ``tenant`` (one with its own quota) hold here together."""
        with self._lock:
            return self._tenant_bytes.get(tenant, 0)

    @checked_after
    def set_segment_owners(self, owners: dict[bytes, int], on_new_owner: NewOwnerHook | None) -> None:
        """Per-tenant arenas: ``owners`` maps each namespace to the owner whose segments hold
        its blocks (namespaces not in it: owner 0); ``on_new_owner`` is told before a segment
        that had another owner is handed to a new one (the arena backs it with fresh memory).
        Set once at start, before any put."""
        with self._lock:
            if self._index or self._pending:
                raise InvalidArgument("segment owners are set before the store holds anything")
            if any(owner < 0 for owner in owners.values()):
                raise InvalidArgument("segment owners are non-negative")
            self._owner_of = dict(owners)
            self._alloc._on_new_owner = on_new_owner

    def segment_generations(self, offsets: list[int]) -> list[int]:
        """The generation of each offset's segment (``SlabAllocator.generations_of``), for the
        wire; empty for a one-piece arena (no segments configured). The slots of a
        lease or a pending put keep their segment owned, so its generation cannot change while
        the caller uses them: read without the lock."""
        return self._alloc.generations_of(offsets) if self._segmented else []

    def segment_owner_at(self, offset: int) -> int:
        """The owner of the segment holding ``offset`` now (``NO_OWNER`` when free)."""
        with self._lock:
            return self._alloc.segment_owner(self._alloc.segment_of(offset))

    def namespace_bytes(self, namespace: bytes) -> int:
        """Bytes ``namespace`` holds here (committed and being written): what its quota counts."""
        with self._lock:
            return self._ns_bytes.get(namespace, 0)

    def summary(self) -> dict[str, int]:
        with self._lock:
            s = self.stats
            return {
                "capacity_bytes": self._alloc.capacity_bytes,
                "used_bytes": self._alloc.used_bytes,
                "blocks": len(self._index),
                "hits": s.hits,
                "misses": s.misses,
                "lookups": s.lookups,
                "puts": s.puts,
                "put_bytes": s.put_bytes,
                "skipped_present": s.skipped_present,
                "evictions": s.evictions,
                "removed": s.removed,
                "checksum_failures": s.checksum_failures,
                "commit_checked_blocks": s.commit_checked_blocks,
                "leases_active": len(self._leases),
                "expired_leases": s.expired_leases,
                "pending_puts": len(self._pending),
                "reclaimed_puts": s.reclaimed_puts,
                "namespace_quota_bytes": self.config.namespace_quota_bytes,
            }

    def check_invariants(self) -> None:
        """The store's rules (debug mode, ``kvpool.core.invariants``): every slot is owned by
        exactly one committed, doomed or pending block; leases count what holds them; the
        byte counts per namespace and tenant add up and stay within their quotas
        (``storage/host_checks.py``)."""
        with self._lock:
            check_host_store(self)

    # -- internals -----------------------------------------------------------------------
    def _new_id(self) -> int:
        """A lease / put id not in use (0 means "none" on the wire)."""
        while True:
            new = self._id_source()
            if new and new not in self._leases and new not in self._pending:
                return new

    def _check_batch(self, keys: Sequence[bytes]) -> None:
        if len(keys) > self.config.max_batch_blocks:
            raise InvalidArgument(
                f"{len(keys)} blocks in one call; the limit is {self.config.max_batch_blocks}",
                hint="split the batch",
            )

    def _evictable(self, key: bytes) -> bool:
        entry = self._index.get(key)
        if entry is None or entry.leases or entry.hard_pin or key in self._protected:
            return False
        return entry.soft_pin_until_ms <= self._clock.now_ms()

    def _pop_victim(self, within: Callable[[bytes], bool] | None) -> Entry | None:
        """The policy's next victim, taken out of its order (only among blocks whose
        namespace is ``within``, if given); None when nothing may be evicted."""
        evictable = self._evictable
        if within is not None:
            index = self._index

            def evictable(key: bytes) -> bool:
                return within(index[key].namespace) and self._evictable(key)

        key = self._policy.pop_victim(evictable)
        return None if key is None else self._index[key]

    def _evict_one(self, within: Callable[[bytes], bool] | None = None) -> bool:
        """Evict the policy's next victim (only among blocks whose namespace is ``within``, if given)."""
        entry = self._pop_victim(within)
        if entry is None:
            return False
        self._evict_entry(entry)
        return True

    def _evict_for_slots(
        self, offsets: list[int], count: int, block_bytes: int, owner: int, within: Callable[[bytes], bool] | None
    ) -> bool:
        """Evict for a put whose size class has no free slot (``alloc_many`` just came back
        empty), until ``offsets`` holds ``count`` slots: a victim's slot that the allocator
        would hand out right after freeing it (``SlabAllocator.can_hand_over``, the usual
        victim of a full pool) goes straight into ``offsets``, still allocated; at the first
        other victim, its slot is freed and the caller asks the allocator again (that slot
        may have emptied a slab). Exactly the victims and slots of evicting one block and
        allocating again each time, without the free and the two allocations per block.
        False when nothing could be evicted."""
        evicted = False
        while len(offsets) < count:
            entry = self._pop_victim(within)
            if entry is None:
                return evicted
            evicted = True
            if not self._alloc.can_hand_over(entry.offset, block_bytes, owner):
                self._evict_entry(entry)
                return True
            self._evict_entry(entry, keep_slot=True)
            offsets.append(entry.offset)
        return True

    def _evict_entry(self, entry: Entry, keep_slot: bool = False) -> None:
        """Evict one block the policy has let go of: demote it (``on_evict``), free its slot
        (``keep_slot``: a put takes the slot over as it is, ``_evict_for_slots``)."""
        if self._on_evict is not None:
            self._on_evict(entry, self._buffer[entry.offset : entry.offset + entry.size])
        self._unindex(entry, keep_slot)
        self.stats.evictions += 1
        self._evicted.append(entry.key)

    def _report_evicted(self) -> None:
        """One REMOVED for the blocks evicted in this hold of the lock (a put's on-demand
        evictions, or one piece of its drain share; lock held; its keys
        name their namespaces). Why not one per block: in a full pool every block put evicts
        one, and an event per eviction (grouped, logged, recorded) was 60 % of PutStart,
        ~10 us a block. At most ``max_batch_blocks`` keys an event: a large put in a
        large arena evicts hundreds of thousands of blocks, more than a directory takes in
        one event."""
        keys, self._evicted = self._evicted, []
        step = self.config.max_batch_blocks  # what a directory takes in one event of a heartbeat
        for start in range(0, len(keys), step):
            self._emit(EventKind.REMOVED, keys[start : start + step], b"")

    def _allocate(self, count: int, block_bytes: int, now: float, owner: int = 0) -> tuple[list[int], float | None]:
        """``count`` slots of ``block_bytes`` in segments of ``owner``, evicting what they need
        (module docstring): its own blocks first, then one whole segment of another owner.
        Also the usage the put's share of a watermark drain is evicted down to after the grant
        (``_drain_after``), or None."""
        need = count * slot_size_for(block_bytes)
        capacity = self._alloc.capacity_bytes
        mine = self._owned_by(owner)
        check_can_fit(self, count, block_bytes, owner)
        # the watermarks keep headroom in a shared arena, a bounded share per put evicted
        # after the grant (storage/watermarks.py, _drain_after); with owners (per-tenant
        # segments) only the owner's own blocks could be evicted here, which would chase an
        # arena-wide target through one tenant's cache: there, room is made only on demand
        floor = self._drain.floor(self._alloc.used_bytes, need, capacity) if mine is None else None
        offsets: list[int] = []
        try:
            while len(offsets) < count:
                got = self._alloc.alloc_many(block_bytes, count - len(offsets), owner)
                if got:
                    offsets += got
                    continue
                if self._evict_for_slots(offsets, count, block_bytes, owner, mine) or (
                    mine is not None and evict_segment(self, owner)
                ):
                    continue
                raise CapacityExhausted(
                    f"no room for {count} blocks of {block_bytes} bytes: {self._alloc.used_bytes} of "
                    f"{capacity} bytes are used and nothing more can be evicted (leased, pinned or in flight)",
                    hint="raise --capacity-bytes, release leases and pins, or put fewer blocks at once",
                )
            self._report_evicted()  # inside the try: should the event sink raise, the slots go back
        except BaseException:  # full, or fresh memory for a segment could not be had
            for off in offsets:
                self._alloc.free(off)
            raise
        return offsets, (None if floor is None else floor + need)

    def _owned_by(self, owner: int) -> Callable[[bytes], bool] | None:
        """Whether a namespace's blocks lie in ``owner``'s segments (None: one owner, all do)."""
        if not self._owner_of:
            return None
        owner_of = self._owner_of

        def member(ns: bytes) -> bool:
            return owner_of.get(ns, 0) == owner

        return member

    def _count(self, namespace: bytes, delta: int) -> None:
        _bump(self._ns_bytes, namespace, delta)  # bounded: only namespaces holding bytes
        tenant = self._tenant_of.get(namespace)
        if tenant is not None:
            _bump(self._tenant_bytes, tenant[0], delta)

    def _quota_used(self, namespace: bytes) -> int:
        tenant = self._tenant_of.get(namespace)
        return self._tenant_bytes.get(tenant[0], 0) if tenant is not None else self._ns_bytes.get(namespace, 0)

    def _unindex(self, entry: Entry, keep_slot: bool = False) -> None:
        """Take a block out of the index and free its slot, or mark it doomed while leased
        (freed at its last release); ``keep_slot``: an evicted block's slot that a put takes
        over (never a leased one: it is not evictable)."""
        self._count(entry.namespace, -entry.size)
        del self._index[entry.key]
        if entry.leases:
            entry.doomed = True
        elif not keep_slot:
            self._alloc.free(entry.offset)

    def _drop_lease(self, lease: _Lease) -> None:
        for entry in lease.entries:
            entry.leases -= 1
            if entry.doomed and entry.leases == 0:
                self._alloc.free(entry.offset)

    def _expire_leases(self, now: float) -> int:
        expired = [lid for lid, lease in self._leases.items() if lease.expires_ms <= now]
        for lid in expired:
            self._drop_lease(self._leases.pop(lid))
        self.stats.expired_leases += len(expired)
        return len(expired)

    def _reclaim_puts(self, now: float) -> int:
        dead = [pid for pid, put in self._pending.items() if put.deadline_ms <= now]
        for pid in dead:
            self.put_abort(pid)
        self.stats.reclaimed_puts += len(dead)
        return len(dead)

    def _emit(self, kind: EventKind, keys: list[bytes], namespace: bytes) -> None:
        if self._on_event is not None:
            self._on_event(kind, keys, namespace)


def _bump(counts: dict[Any, int], key: Any, delta: int) -> None:
    """Add ``delta`` to ``counts[key]``, dropping the key at 0 (the table stays bounded by
    what holds bytes)."""
    left = counts.get(key, 0) + delta
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
