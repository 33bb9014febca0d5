"""One node's store over its tiers: device (HBM, optional) -> host (shared-memory arena)
-> disk (NVMe, optional), presenting exactly the ``HostStore`` method set so the daemon
uses it unchanged.

Why the host tier stays in charge: clients read and write blocks through the mapped host
arena, so every lease is a lease on host slots. The other tiers sit around it:
- a host miss that another tier holds is *promoted* (disk or device -> host: read, checksum
  verified, written into a host slot through a normal two-phase put, committed) and then
  leased, so the client path never changes;
- a host eviction *demotes* the block to disk: the ``on_evict`` hook hands over the bytes
  before the slot is freed, they are copied into the disk tier's bounded write-behind queue
  and written by its writer thread (a full queue drops the demotion and counts it rather
  than stall the host under its lock);
- ``disk_admission="second-hit"`` keeps one-hit blocks off the disk: a block evicted from
  host without any read hit is only remembered (a bounded ghost set) the first time;
- blocks hit repeatedly on host are copied to the device tier (when configured); device
  evictions of blocks no other tier holds are demoted back to host.

KV events keep the directory's view right and name the tier where a block now lives (its
fastest copy, in the directory's read order host, device, disk): a block that leaves host
but stays on the node (demoted to disk, or still in HBM) sends STORED with tier "disk" /
"device" instead of the host's REMOVED; a promotion back sends STORED "host"; REMOVED is
sent only when the block leaves the node's last tier.

A disk or device tier that cannot start (unwritable dir, other hash scheme, no CUDA) is
logged with its hint and reported in ``summary()["tiers"]``; the store keeps serving from
the tiers it has.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from kvpool.core.checksum import checksum64
from kvpool.core.clock import Clock
from kvpool.core.config import StoreConfig, TierConfig
from kvpool.core.errors import CapacityExhausted, InvalidArgument, KVPoolError, LeaseExpired, StorageFault
from kvpool.core.events import EventKind
from kvpool.core.invariants import checked_after, require
from kvpool.storage.allocator import NewOwnerHook
from kvpool.storage.block_record import BlockTable, DeviceDemotion, Fence
from kvpool.storage.device_tier import DeviceTier
from kvpool.storage.disk_tier import DiskBlock, DiskTier
from kvpool.storage.eviction import make_policy
from kvpool.storage.host_store import (
    CommitResult,
    Entry,
    EventSink,
    HostStore,
    LeaseGrant,
    PutGrant,
)
from kvpool.storage.shutdown_flush import ShutdownFlushReport, flush_host_to_disk
from kvpool.storage.tier_stats import HostTierStats, tiered_summary

log = logging.getLogger(__name__)

#: host hits after which a block is copied up to the device tier
DEVICE_PROMOTE_AFTER_HITS = 2


class Promoted(NamedTuple):
    """What one promotion into host did: how many leading keys are now in host, the keys it
    committed, and why host could not take them ("" unless it could not)."""

    in_host: int
    keys: set[bytes]
    refusal: str = ""


class TieredStore:
    """Host + optional disk + optional device tiers, with the ``HostStore`` interface."""

    GHOST_KEYS = 65_536  # second-hit admission memory, in keys

    def __init__(
        self,
        buffer: np.ndarray,
        config: StoreConfig,
        tiers: TierConfig,
        clock: Clock,
        *,
        on_event: EventSink | None = None,
        device_allow_cpu: bool = False,
        disk_direct_io: bool | None = None,
        id_source: Callable[[], int] | None = None,
        segment_bytes: int = 0,
    ) -> None:
        """``segment_bytes``: a per-tenant arena's segments (``HostStore``); 0 = one piece."""
        self.config = config
        self.tier_config = tiers
        self._buffer = buffer
        self._on_event = on_event
        # every block's moves, removals, hits and pending events: one record per block, one
        # lock (storage/block_record.py); the counters below are kept under the same lock
        self.records = BlockTable(self.GHOST_KEYS)
        self._lock = self.records.lock
        self.host_stats = HostTierStats()
        # per-block host hit counts feed second-hit admission and device promotion only
        self._count_hits = tiers.disk_admission == "second-hit" or tiers.device_capacity_bytes > 0
        self.disk: DiskTier | None = None
        self.disk_fault = ""
        self.device: DeviceTier | None = None
        self.device_fault = ""
        if tiers.disk_dir:
            try:
                self.disk = DiskTier(
                    tiers.disk_dir,
                    tiers.disk_capacity_bytes,
                    tiers.disk_slab_file_bytes,
                    policy=tiers.disk_policy,
                    io_threads=tiers.disk_io_threads,
                    queue_blocks=tiers.write_behind_queue_blocks,
                    direct_io=disk_direct_io,
                    on_evict=self._on_lower_tier_dropped,
                    on_failed=self._on_disk_failed,
                    background_recovery=True,  # serve the first hits while the index loads
                    high_watermark=tiers.disk_high_watermark,
                    low_watermark=tiers.disk_low_watermark,
                )
            except StorageFault as exc:
                self.disk_fault = str(exc)
                log.error("disk tier disabled, serving from the other tiers: %s", exc)
        if tiers.device_capacity_bytes > 0:
            try:
                self.device = DeviceTier(
                    tiers.device_capacity_bytes,
                    config.slab_bytes,
                    device=tiers.device,
                    policy=tiers.device_policy,
                    allow_cpu=device_allow_cpu,
                    on_evict=self._on_device_evict,
                    high_watermark=tiers.device_high_watermark,
                    low_watermark=tiers.device_low_watermark,
                )
            except KVPoolError as exc:
                self.device_fault = str(exc)
                log.error("device tier disabled, serving from the other tiers: %s", exc)
            # a per-tenant arena maps fresh memory over a segment that changes owner, which a
            # cudaHostRegister of the old pages would not follow: it stays pageable (correct, slower)
            if segment_bytes:
                log.warning("per-tenant arena: the host arena is not page-locked; copies to HBM will be slower")
            elif self.device is not None and not self.device.pin_host(buffer) and tiers.device.startswith("cuda"):
                log.warning("could not page-lock the host arena (cudaHostRegister); copies to HBM will be slower")
        self.host = HostStore(
            buffer,
            config,
            clock,
            policy=make_policy(tiers.host_policy),
            on_event=self._on_host_event,
            on_evict=self._on_host_evict,
            id_source=id_source,
            segment_bytes=segment_bytes,
        )

    # -- reads ---------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Longest prefix present in any tier (does not lease or promote)."""
        n = self.host.lookup(keys)
        while n < len(keys) and self._lower_has(keys[n]):
            n += 1
        return n

    def lookup_by_tier(self, keys: Sequence[bytes]) -> dict[str, int]:
        """``lookup``, with how many blocks of the leading run each tier holds (the fastest
        copy, in the read order host, device, disk). Does not lease or promote."""
        by_tier = {"host": self.host.lookup(keys)}
        n = by_tier["host"]
        while n < len(keys):
            key = keys[n]
            if self.device is not None and self.device.contains(key):
                tier = "device"
            elif self.disk is not None and self.disk.contains(key):
                tier = "disk"
            else:
                break
            by_tier[tier] = by_tier.get(tier, 0) + 1
            n += 1
        return by_tier

    @checked_after
    def drop_corrupt(self, keys: Sequence[bytes]) -> list[bytes]:
        """Re-verify the named host blocks (what readers read) and drop each one whose bytes
        no longer match its committed checksum from every tier, with one REMOVED, so the next
        put stores fresh bytes (a lower tier's copy goes too: the block is rewritten whole).
        A block that verifies is kept, whatever the reader said. Returns the dropped keys."""
        bad = self.host.corrupt_keys(keys)
        if bad:
            with self._lock:
                self.host_stats.checksum_failures += len(bad)
            self.remove(bad)
        return bad

    @checked_after
    def lease(self, keys: Sequence[bytes]) -> LeaseGrant:
        """Lease the leading present keys, promoting host misses held by another tier first."""
        grant = self.host.lease(keys)
        n_host = len(grant.locations)
        promoted_keys: set[bytes] = set()
        if n_host < len(keys) and (self.disk is not None or self.device is not None):
            promoted, promoted_keys, refusal = self._promote(list(keys[n_host:]))
            if promoted:
                wider = self.host.lease(keys)
                if grant.lease_id:
                    try:
                        self.host.release(grant.lease_id)
                    except LeaseExpired:
                        pass
                grant = wider
            if refusal:
                grant = dataclasses.replace(grant, not_promoted=refusal)
        self._after_lease(keys, grant, promoted_keys)
        self._drain_device_demotions()
        return grant

    @checked_after
    def release(self, lease_id: int) -> None:
        self.host.release(lease_id)

    @checked_after
    def release_many(self, lease_ids: Sequence[int]) -> int:
        return self.host.release_many(lease_ids)

    def owner_of(self, capability_id: int) -> bytes | None:
        return self.host.owner_of(capability_id)

    def set_tenant_quotas(self, quotas: dict[bytes, tuple[str, int]]) -> None:
        """Tenant quotas count the host tier (``HostStore.set_tenant_quotas``); blocks
        evicted to make room are demoted like any eviction, and lower tiers are shared."""
        self.host.set_tenant_quotas(quotas)

    def tenant_bytes(self, tenant: str) -> int:
        return self.host.tenant_bytes(tenant)

    def set_segment_owners(self, owners: dict[bytes, int], on_new_owner: NewOwnerHook | None) -> None:
        """Per-tenant arenas count the host tier only (``HostStore.set_segment_owners``): a
        promotion from disk or device is a host put in the block's namespace, so it lands in
        that namespace's owner's segments; the lower tiers are not mapped by clients."""
        self.host.set_segment_owners(owners, on_new_owner)

    def segment_generations(self, offsets: list[int]) -> list[int]:
        return self.host.segment_generations(offsets)

    def segment_owner_at(self, offset: int) -> int:
        return self.host.segment_owner_at(offset)

    # -- writes --------------------------------------------------------------------------
    @checked_after
    def put_start(self, namespace: bytes, keys: Sequence[bytes], block_bytes: int) -> PutGrant:
        """Reserve host slots for keys no tier holds; keys only a lower tier holds are
        reported ``already_present`` (a lease will promote them)."""
        if self.disk is None and self.device is None:
            return self.host.put_start(namespace, keys, block_bytes)
        if len(keys) > self.config.max_batch_blocks:
            raise InvalidArgument(
                f"{len(keys)} blocks in one call; the limit is {self.config.max_batch_blocks}", hint="split the batch"
            )
        on_disk = self.disk.present(keys) if self.disk is not None else [False] * len(keys)
        below = [
            i
            for i, key in enumerate(keys)
            if (on_disk[i] or (self.device is not None and self.device.contains(key))) and self.host.entry(key) is None
        ]
        if not below:
            grant = self.host.put_start(namespace, keys, block_bytes)
        else:
            skip = set(below)
            rest = [i for i in range(len(keys)) if i not in skip]
            inner = self.host.put_start(namespace, [keys[i] for i in rest], block_bytes)
            grant = PutGrant(
                inner.put_id,
                [rest[j] for j in inner.indices],
                inner.offsets,
                sorted([rest[j] for j in inner.already_present] + below),
                [rest[j] for j in inner.in_flight],
            )
        self._drain_device_demotions()
        return grant

    @checked_after
    def put_commit(self, put_id: int, checksums: Sequence[int], verify_one_in: int = 1) -> CommitResult:
        return self.host.put_commit(put_id, checksums, verify_one_in)

    @checked_after
    def put_abort(self, put_id: int) -> None:
        self.host.put_abort(put_id)

    def put_in_flight(self, key: bytes) -> float | None:
        return self.host.put_in_flight(key)

    def put_pending(self, put_id: int) -> bool:
        return self.host.put_pending(put_id)

    def write_slot(self, put_id: int, slot: int, data: np.ndarray) -> bool:
        """Pass-through to ``HostStore.write_slot`` (put slots are host slots; ``slot`` indexes
        the grant's ``slots``, whose order this class keeps when it remaps request indices)."""
        return self.host.write_slot(put_id, slot, data)

    @checked_after
    def remove(self, keys: Sequence[bytes]) -> int:
        """Remove blocks from every tier, including device evictions still on their way to
        host. Two transitions of the block records (``prepare_remove`` fences every move
        in flight, ``complete_remove`` ends the fence and reports REMOVED once for what only
        a lower tier held); the host reports its own blocks' REMOVED."""
        unique = list(dict.fromkeys(keys))
        self.records.prepare_remove(unique)
        in_host: set[bytes] = set()
        below: set[bytes] = set()
        try:
            in_host = {key for key in unique if self.host.entry(key) is not None}
            self.host.remove(keys)
            if self.device is not None:
                below.update(key for key in unique if self.device.remove(key))
            if self.disk is not None:
                below.update(self.disk.remove(unique))
        finally:
            gone = self.records.complete_remove(
                unique, below, in_host, lambda removed: self._emit(EventKind.REMOVED, removed, b"")
            )
        return len(in_host) + gone

    @checked_after
    def pin(self, keys: Sequence[bytes], ttl_ms: int | None) -> int:
        """Pins hold host blocks (pinned blocks are the ones worth keeping in DRAM): a block
        that only a lower tier holds is promoted first, so pinning a demoted system prompt
        brings it back."""
        if self.disk is not None or self.device is not None:
            missing = [key for key in keys if self.host.entry(key) is None and self._lower_has(key)]
            i = 0
            while i < len(missing):
                if self.host.entry(missing[i]) is None:
                    i += max(1, self._promote(missing[i:])[0])
                else:
                    i += 1
        return self.host.pin(keys, ttl_ms)

    @checked_after
    def unpin(self, keys: Sequence[bytes]) -> int:
        return self.host.unpin(keys)

    # -- upkeep --------------------------------------------------------------------------
    @checked_after
    def sweep(self) -> tuple[int, int]:
        return self.host.sweep()

    def snapshot_keys(self) -> list[bytes]:
        keys = dict.fromkeys(self.host.snapshot_keys())
        if self.device is not None:  # device-only blocks were announced (STORED device)
            keys.update(dict.fromkeys(self.device.keys()))
        if self.disk is not None:
            keys.update(dict.fromkeys(self.disk.keys()))
        return list(keys)

    def tier_of(self, key: bytes) -> str:
        """The fastest tier holding ``key`` ("host", "device", "disk"), or "" if none does."""
        if self.host.entry(key) is not None:
            return "host"
        if self.device is not None and self.device.contains(key):
            return "device"
        if self.disk is not None and self.disk.meta(key) is not None:
            return "disk"
        return ""

    def entry(self, key: bytes) -> Entry | None:
        """The host entry; for a block only a lower tier holds, a detached ``Entry`` with
        ``offset == -1`` (namespace, size and checksum are right; it has no arena slot)."""
        found = self.host.entry(key)
        if found is not None:
            return found
        meta = self.device.meta(key) if self.device is not None else None
        if meta is None and self.disk is not None:
            meta = self.disk.meta(key)
        if meta is None:
            return None
        namespace, size, checksum = meta
        return Entry(key, -1, size, checksum, namespace)

    def used_bytes(self) -> int:
        return self.host.used_bytes()

    def namespace_bytes(self, namespace: bytes) -> int:
        """Host bytes of ``namespace`` (its quota counts the host tier, where clients read)."""
        return self.host.namespace_bytes(namespace)

    @property
    def stats(self) -> Any:
        return self.host.stats

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for the disk write-behind queue to drain (tests, benchmarks, shutdown)."""
        return self.disk.flush(timeout_s) if self.disk is not None else True

    def shutdown_flush(self, timeout_ms: int) -> ShutdownFlushReport | None:
        """Before the daemon exits: write the host blocks the disk tier does not hold to it,
        within ``timeout_ms`` (``storage/shutdown_flush.py``). None without a disk tier."""
        if self.disk is None:
            return None
        return flush_host_to_disk(self.host, self._buffer, self.disk, timeout_ms)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
        if self.device is not None:
            self.device.close()

    def summary(self) -> dict[str, Any]:
        """The host store's keys (hits/misses now count every tier) plus ``tiers``."""
        host = self.host.summary()
        with self._lock:
            stats = dataclasses.replace(self.host_stats)
        disk = {"enabled": True, **self.disk.summary()} if self.disk is not None else None
        device = {"enabled": True, **self.device.summary()} if self.device is not None else None
        return tiered_summary(
            host,
            stats,
            disk or {"enabled": False, "fault": self.disk_fault},
            device
            or {
                "enabled": False,
                "fault": self.device_fault,
            },
        )

    # -- promotion -------------------------------------------------------------------------
    def _lower_has(self, key: bytes) -> bool:
        return (self.device is not None and self.device.contains(key)) or (
            self.disk is not None and self.disk.contains(key)
        )

    def _promote(self, keys: list[bytes]) -> Promoted:
        """Bring the leading run of ``keys`` held by the device or disk tier into host.
        Returns (how many leading keys are now in host, the keys this call committed)."""
        run: list[bytes] = []
        for key in keys:
            if not self._lower_has(key):
                break
            run.append(key)
        if not run:
            return Promoted(0, set())
        fence = self.records.prepare_moves(run, "promote")
        try:
            return self._promote_fenced(run, fence)
        finally:
            self.records.complete_moves(fence, "promote")

    def _promote_fenced(self, run: list[bytes], fence: Fence) -> Promoted:
        """``_promote`` of a run its fence covers. The bytes may still serve a lease already
        in flight, but a block removed meanwhile is not committed (no STORED), and one
        removed between the check and the commit is removed again right after it."""
        blocks: list[DiskBlock | None] = [None] * len(run)
        from_disk: list[int] = []
        device_failed: list[bytes] = []  # in HBM, failed its check there (device.get dropped it)
        for i, key in enumerate(run):
            in_device = self.device is not None and self.device.contains(key)
            got = self.device.get(key) if self.device is not None and in_device else None
            if got is not None:
                namespace, checksum, data = got
                blocks[i] = DiskBlock(key, namespace, checksum, data)
            else:
                if in_device:
                    device_failed.append(key)
                from_disk.append(i)
        if from_disk and self.disk is not None:
            got = self.disk.read_many([run[i] for i in from_disk])
            for i, block in zip(from_disk, got, strict=True):
                blocks[i] = block
        gone = [k for k in device_failed if self.host.entry(k) is None and not self._lower_has(k)]
        if gone:  # the device tier drops a bad copy silently: the node no longer holds it
            self._emit(EventKind.REMOVED, gone, b"", "device", "checksum_failure")
        # leading run of blocks of one namespace and size (one host put); no checksum pass
        # here: device.get and disk reads verify their private copies (a disk queue hit was
        # verified before it was queued), and put_commit verifies the bytes again in host
        # (in full: the default for anything but a same-host client's put)
        good: list[DiskBlock] = []
        for block in blocks:
            if block is None:
                break
            if good and (block.namespace != good[0].namespace or block.data.size != good[0].data.size):
                break
            good.append(block)
        fenced = set(self.records.fenced(fence, [b.key for b in good]))
        if fenced:  # removed after this promotion started: the read must not bring it back
            good = good[: next(i for i, b in enumerate(good) if b.key in fenced)]
        if not good:
            return Promoted(0, set())
        size = int(good[0].data.size)
        try:
            # the host's STORED event (tier "host") tells subscribers the block moved up
            grant = self.host.put_start(good[0].namespace, [b.key for b in good], size)
        except CapacityExhausted as exc:  # host full, or the namespace's / tenant's quota
            with self._lock:
                self.host_stats.promotion_failures += len(good)
            return Promoted(0, set(), exc.message)
        checksums: list[int] = []
        for index, offset in grant.slots:
            self._buffer[offset : offset + size] = good[index].data
            checksums.append(good[index].checksum)
        written = {good[index].key for index, _ in grant.slots}
        committed = 0
        if grant.put_id:
            if self.records.fenced(fence, written):
                self.host.put_abort(grant.put_id)  # a remove() landed during the copy
                return Promoted(0, set())
            committed = self.host.put_commit(grant.put_id, checksums).committed
        with self._lock:
            self.host_stats.promotions += committed
            self.host_stats.bytes_in += committed * size
        fenced = set(self.records.fenced(fence, written)) if committed else set()
        if fenced:
            # a remove() raced the commit: whichever ran first, remove again so the block is
            # gone and its last event is REMOVED (the host's own REMOVED when it is found)
            self.remove(list(fenced))
            return Promoted(self.host.lookup([b.key for b in good]), written - fenced)
        if committed < len(written):
            written = {key for key in written if self.host.entry(key) is not None}
        return Promoted(committed + len(grant.already_present), written)

    def _after_lease(self, keys: Sequence[bytes], grant: LeaseGrant, promoted: set[bytes]) -> None:
        served = len(grant.locations)
        lower = sum(1 for key in keys[:served] if key in promoted) if promoted else 0
        with self._lock:
            h = self.host_stats
            h.hits += served - lower  # served from host directly
            h.misses += len(keys) - (served - lower)  # includes what a lower tier then served
            h.lower_hits += lower
            h.bytes_out += sum(loc.size for loc in grant.locations)
        if not self._count_hits or not served:
            return
        hot = self.records.count_hits(keys[:served], DEVICE_PROMOTE_AFTER_HITS)
        if self.device is not None:
            for key in hot:
                entry = self.host.entry(key)
                if entry is None or self.device.contains(key):
                    continue
                # the block is leased by this grant, so its slot cannot change under the copy
                data = self._buffer[entry.offset : entry.offset + entry.size]
                if checksum64(data) == entry.checksum:
                    self.device.put(key, entry.namespace, data, entry.checksum)

    # -- hooks -----------------------------------------------------------------------------
    def _on_host_evict(self, entry: Entry, data: np.ndarray) -> None:
        """Called under the host lock, before the slot is freed: copy the bytes down. The
        other tiers are asked first, outside the records' lock (their locks come first)."""
        key = entry.key
        in_device = self.device is not None and self.device.contains(key)
        on_disk = self.disk is not None and self.disk.contains(key)
        action = self.records.host_evicted(
            key, in_device, on_disk, self.disk is not None, self.tier_config.disk_admission == "second-hit"
        )
        if action == "keep":
            return
        if action == "skip":
            with self._lock:
                self.host_stats.admission_skips += 1
            return
        assert self.disk is not None
        if checksum64(data) != entry.checksum:
            self.records.evicted_bad(key)
            with self._lock:
                self.host_stats.checksum_failures += 1
            log.error("host block %s failed its checksum on eviction; not demoted", key.hex())
            return
        if self.disk.enqueue(key, entry.namespace, data, entry.checksum):
            self.records.demoted(key)
            with self._lock:
                self.host_stats.demotions += 1
        else:
            with self._lock:
                self.host_stats.demotion_drops += 1

    def _on_host_event(self, kind: EventKind, keys: list[bytes], namespace: bytes, tier: str = "host") -> None:
        """The host's events, with its REMOVED of a block that stays on the node turned into
        STORED naming the tier it now lives in (the eviction hook ran just before)."""
        self.records.host_event(
            kind is EventKind.REMOVED,
            keys,
            lambda ks, t, cause: self._emit(kind, ks, namespace, t, cause),
            lambda ks, t: self._emit(EventKind.STORED, ks, namespace, t),
        )

    def _on_lower_tier_dropped(self, keys: list[bytes], cause: str = "") -> None:
        """The disk tier evicted (``cause`` "") or dropped blocks: gone from the node unless
        another tier has them."""
        below_host = [k for k in keys if self.device is None or not self.device.contains(k)]
        # checked and sent under the host lock: a put committing one of them meanwhile sends
        # its STORED after this REMOVED, never before it
        self.host.report_absent(below_host, lambda gone: self._emit(EventKind.REMOVED, gone, b"", "disk", cause))

    def _on_disk_failed(self, keys: list[bytes], cause: str) -> None:
        """The disk tier dropped blocks that failed their checksum or an I/O (``cause``)."""
        self._on_lower_tier_dropped(keys, cause)

    def _on_device_evict(self, key: bytes, namespace: bytes, checksum: int, data: np.ndarray) -> None:
        """Called under the device lock: queue the block for host if no other tier has it."""
        self.records.queue_demotion(key, DeviceDemotion(namespace, checksum, data))

    def _drain_device_demotions(self) -> None:
        if self.device is None:
            return
        pending, fence = self.records.take_demotions()
        if not pending:
            return
        try:
            for key, demotion in pending:
                self._demote_to_host(key, demotion, fence)
        finally:
            self.records.complete_moves(fence, "demote")

    def _demote_to_host(self, key: bytes, demotion: DeviceDemotion, fence: Fence) -> None:
        """Put one block evicted from HBM back into host, unless a faster copy exists or a
        remove() fenced it (that remove counted it and sent REMOVED)."""
        assert self.device is not None
        namespace, checksum, data = demotion.namespace, demotion.checksum, demotion.data
        if self.host.entry(key) is not None or self.device.contains(key):
            return  # the last event already named a faster tier
        if self.records.fenced(fence, [key]):
            return
        if self.disk is not None and self.disk.contains(key):
            # only the disk copy is left; a remove() that started first reports REMOVED instead
            self.records.emit_unless_fenced(fence, key, lambda: self._emit(EventKind.STORED, [key], namespace, "disk"))
            return
        if checksum64(data) != checksum:
            self._emit(EventKind.REMOVED, [key], namespace, "device", "checksum_failure")
            return
        try:
            grant = self.host.put_start(namespace, [key], int(data.size))
        except KVPoolError:  # evicted from HBM and host has no room: an eviction
            self._emit(EventKind.REMOVED, [key], namespace, "device")
            return
        for _, offset in grant.slots:
            self._buffer[offset : offset + data.size] = data
        if not grant.put_id:
            return
        if self.records.fenced(fence, [key]):
            self.host.put_abort(grant.put_id)
            return
        self.host.put_commit(grant.put_id, [checksum])  # the host's STORED (tier "host") reports it
        if self.records.fenced(fence, [key]):
            self.remove([key])  # the remove raced the commit: it must stick, REMOVED last

    def check_invariants(self) -> None:
        """Each part's own rules (debug mode): the block records, the host store, the
        device and disk tiers, and the counters here."""
        self.records.check_invariants()
        self.host.check_invariants()
        if self.device is not None:
            self.device.check_invariants()
        if self.disk is not None:
            self.disk.check_invariants()
        with self._lock:
            h = self.host_stats
            require("TieredStore", "lower hits were promoted", h.lower_hits <= h.promotions, f"{h}")

    def _emit(self, kind: EventKind, keys: list[bytes], namespace: bytes, tier: str = "host", cause: str = "") -> None:
        if self._on_event is not None:
            self._on_event(kind, keys, namespace, tier, cause)
