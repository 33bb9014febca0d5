"""HostStore scenarios: two-phase puts, checksums, leases, pins, eviction, watermarks, sweep."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np
import pytest

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig
from kvpool.core.errors import CapacityExhausted, InvalidArgument, LeaseExpired, NotFound
from kvpool.core.events import EventKind
from kvpool.storage.host_store import HostStore

BLOCK = 1024
SLAB = 4096
NS = b"n" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payload(i: int) -> np.ndarray:
    return np.full(BLOCK, i % 251, dtype=np.uint8) ^ np.arange(BLOCK, dtype=np.uint8)


class Harness:
    """A store of ``slots`` 1 KiB slots (a multiple of 4: four slots per 4 KiB slab)."""

    def __init__(self, slots: int = 8, **overrides: object) -> None:
        assert slots % (SLAB // BLOCK) == 0
        fields: dict[str, object] = {"capacity_bytes": slots * BLOCK, "slab_bytes": SLAB,
                                     "high_watermark": 1.0, "low_watermark": 1.0}  # fmt: skip
        fields.update(overrides)
        self.config = StoreConfig(**fields)  # type: ignore[arg-type]
        self.clock = FakeClock()
        self.buffer = np.zeros(self.config.capacity_bytes, dtype=np.uint8)
        self.events: list[tuple[EventKind, list[bytes], bytes]] = []
        self.store = HostStore(self.buffer, self.config, self.clock,
                               on_event=lambda k, h, n: self.events.append((k, list(h), n)))  # fmt: skip

    def put(self, ids: Sequence[int]) -> int:
        grant = self.store.put_start(NS, [key(i) for i in ids], BLOCK)
        sums = []
        for index, offset in grant.slots:
            self.buffer[offset : offset + BLOCK] = payload(ids[index])
            sums.append(checksum64(payload(ids[index])))
        if grant.put_id == 0:
            return 0
        return self.store.put_commit(grant.put_id, sums).committed

    def read(self, i: int) -> np.ndarray | None:
        grant = self.store.lease([key(i)])
        if not grant.lease_id:
            return None
        loc = grant.locations[0]
        data = self.buffer[loc.offset : loc.offset + loc.size].copy()
        assert checksum64(data) == loc.checksum
        self.store.release(grant.lease_id)
        return data

    def present(self) -> set[int]:
        return {int.from_bytes(k, "big") for k in self.store.snapshot_keys()}


def test_put_then_read_returns_the_bytes_and_emits_stored() -> None:
    h = Harness()
    assert h.put([1, 2, 3]) == 3
    for i in (1, 2, 3):
        got = h.read(i)
        assert got is not None and np.array_equal(got, payload(i))
    assert h.store.lookup([key(1), key(2), key(3)]) == 3
    assert h.events == [(EventKind.STORED, [key(1), key(2), key(3)], NS)]
    assert h.store.used_bytes() == 3 * BLOCK


def test_half_written_block_is_invisible_until_commit() -> None:
    h = Harness()
    grant = h.store.put_start(NS, [key(1)], BLOCK)
    ((_index, offset),) = grant.slots
    h.buffer[offset : offset + BLOCK] = payload(1)
    assert h.store.lookup([key(1)]) == 0
    assert h.store.lease([key(1)]).lease_id == 0
    assert h.store.snapshot_keys() == []
    again = h.store.put_start(NS, [key(1)], BLOCK)  # another writer: told it is in flight
    assert again.put_id == 0 and again.in_flight == [0]
    assert h.store.put_commit(grant.put_id, [checksum64(payload(1))]).committed == 1
    assert h.store.lookup([key(1)]) == 1
    assert h.store.put_start(NS, [key(1)], BLOCK).already_present == [0]


def test_commit_with_bad_checksum_stores_nothing_and_frees_the_slot() -> None:
    h = Harness()
    grant = h.store.put_start(NS, [key(1), key(2)], BLOCK)
    for index, offset in grant.slots:
        h.buffer[offset : offset + BLOCK] = payload(index + 1)
    good = checksum64(payload(1))
    result = h.store.put_commit(grant.put_id, [good, good ^ 1])
    assert result.committed == 1 and result.checksum_failed == [1]
    assert h.store.lookup([key(1)]) == 1 and h.store.lookup([key(2)]) == 0
    assert h.store.used_bytes() == BLOCK
    assert h.store.summary()["checksum_failures"] == 1
    assert h.events == [(EventKind.STORED, [key(1)], NS)]


def test_commit_errors() -> None:
    h = Harness()
    with pytest.raises(NotFound):
        h.store.put_commit(12345, [])
    grant = h.store.put_start(NS, [key(1), key(2)], BLOCK)
    with pytest.raises(InvalidArgument, match="2 written blocks"):
        h.store.put_commit(grant.put_id, [0])
    assert h.store.used_bytes() == 0 and h.store.lookup([key(1)]) == 0
    with pytest.raises(NotFound):  # the put is gone
        h.store.put_commit(grant.put_id, [0, 0])
    assert h.put([1, 2]) == 2  # the keys are free to be written again


def test_abort_frees_slots_and_keys() -> None:
    h = Harness()
    grant = h.store.put_start(NS, [key(1)], BLOCK)
    h.store.put_abort(grant.put_id)
    h.store.put_abort(grant.put_id)  # idempotent
    assert h.store.used_bytes() == 0
    assert h.put([1]) == 1


def test_duplicate_keys_in_one_put_are_written_once() -> None:
    h = Harness()
    grant = h.store.put_start(NS, [key(1), key(1), key(2)], BLOCK)
    assert [i for i, _ in grant.slots] == [0, 2] and grant.in_flight == [1]


def test_lookup_is_the_longest_present_prefix() -> None:
    h = Harness()
    h.put([1, 2, 4])
    assert h.store.lookup([key(1), key(2), key(3), key(4)]) == 2
    assert h.store.lookup([key(3), key(1)]) == 0
    assert h.store.lookup([]) == 0
    grant = h.store.lease([key(1), key(2), key(3), key(4)])
    assert len(grant.locations) == 2
    assert h.store.summary()["hits"] == 2 and h.store.summary()["misses"] == 2


def test_leased_block_is_not_evicted_and_its_bytes_do_not_change() -> None:
    h = Harness(slots=4)
    h.put([1, 2, 3, 4])
    grant = h.store.lease([key(1)])
    loc = grant.locations[0]
    h.put([5])  # full: must evict an unleased block, LRU = 2 (1 was just accessed)
    assert 1 in h.present() and 2 not in h.present()
    assert np.array_equal(h.buffer[loc.offset : loc.offset + BLOCK], payload(1))
    h.store.release(grant.lease_id)


def test_remove_of_a_leased_block_defers_the_free() -> None:
    h = Harness(slots=4)
    h.put([1, 2, 3, 4])
    grant = h.store.lease([key(1)])
    loc = grant.locations[0]
    assert h.store.remove([key(1)]) == 1
    assert h.store.lookup([key(1)]) == 0
    assert h.store.used_bytes() == 4 * BLOCK  # slot still held by the lease
    h.put([5, 6])  # needs room: evicts 2, 3 but never reuses the leased slot
    assert np.array_equal(h.buffer[loc.offset : loc.offset + BLOCK], payload(1))
    h.store.release(grant.lease_id)
    assert h.store.used_bytes() == 3 * BLOCK


def test_release_unknown_or_twice_is_lease_expired() -> None:
    h = Harness()
    h.put([1])
    grant = h.store.lease([key(1)])
    h.store.release(grant.lease_id)
    with pytest.raises(LeaseExpired):
        h.store.release(grant.lease_id)
    with pytest.raises(LeaseExpired):
        h.store.release(999)


def test_expired_lease_is_reclaimed_by_sweep() -> None:
    h = Harness(slots=4, lease_ttl_ms=100)
    h.put([1, 2, 3, 4])
    grant = h.store.lease([key(1), key(2), key(3), key(4)])
    with pytest.raises(CapacityExhausted):
        h.put([5])
    h.clock.advance(99)
    assert h.store.sweep() == (0, 0)
    h.clock.advance(1)
    assert h.store.sweep() == (1, 0)
    assert h.put([5]) == 1
    with pytest.raises(LeaseExpired):
        h.store.release(grant.lease_id)


def test_dead_writer_put_is_reclaimed_by_sweep() -> None:
    h = Harness(put_ttl_ms=50)
    grant = h.store.put_start(NS, [key(1)], BLOCK)
    h.clock.advance(50)
    assert h.store.sweep() == (0, 1)
    assert h.store.used_bytes() == 0
    with pytest.raises(NotFound):
        h.store.put_commit(grant.put_id, [checksum64(payload(1))])
    assert h.put([1]) == 1


def test_hard_pin_is_never_evicted_until_unpinned() -> None:
    h = Harness(slots=4)
    h.put([1, 2, 3, 4])
    assert h.store.pin([key(1), key(2), key(3), key(4), key(99)], None) == 4
    with pytest.raises(CapacityExhausted):
        h.put([5])
    assert h.present() == {1, 2, 3, 4}
    assert h.store.unpin([key(2)]) == 1
    assert h.put([5]) == 1
    assert h.present() == {1, 3, 4, 5}


def test_soft_pin_protects_until_its_ttl() -> None:
    h = Harness(slots=4)
    h.put([1, 2, 3, 4])
    assert h.store.pin([key(1), key(2), key(3), key(4)], 1000) == 4
    with pytest.raises(CapacityExhausted):
        h.put([5])
    h.clock.advance(999)
    with pytest.raises(CapacityExhausted):
        h.put([5])
    h.clock.advance(1)
    assert h.put([5]) == 1
    assert h.present() == {2, 3, 4, 5}  # LRU: 1 went first


def test_capacity_exhausted_loses_nothing_when_nothing_is_evictable() -> None:
    h = Harness(slots=4)
    h.put([1, 2, 3, 4])
    grant = h.store.lease([key(i) for i in (1, 2, 3, 4)])
    with pytest.raises(CapacityExhausted) as info:
        h.put([5, 6])
    assert info.value.hint
    assert h.present() == {1, 2, 3, 4}
    assert h.store.used_bytes() == 4 * BLOCK and h.store.summary()["pending_puts"] == 0
    h.store.release(grant.lease_id)
    for i in (1, 2, 3, 4):
        got = h.read(i)
        assert got is not None and np.array_equal(got, payload(i))


def test_put_that_cannot_fit_does_not_evict_anything() -> None:
    h = Harness(slots=4)
    h.put([1, 2, 3, 4])
    h.store.pin([key(1), key(2)], None)
    with pytest.raises(CapacityExhausted):
        h.put([5, 6, 7])  # 3 new blocks; at most 2 slots can ever be freed
    assert h.present() == {1, 2, 3, 4}


def test_put_start_does_not_evict_the_blocks_it_reports_present() -> None:
    h = Harness(slots=8, high_watermark=0.9, low_watermark=0.6)
    h.put([0])
    h.put([2, 5, 6, 7])
    grant = h.store.put_start(NS, [key(0), key(1), key(3), key(4)], BLOCK)
    assert grant.already_present == [0]
    assert h.store.lookup([key(0)]) == 1, "block 0 was reported present, then evicted by the same put"


def test_watermarks_drain_to_low_in_lru_order_a_bounded_share_per_put() -> None:
    """Once a put would cross the high watermark, each put evicts its own room and as much
    again (oldest first) until usage is at the low watermark; then nothing until the next
    crossing (storage/watermarks.py: no one put evicts a tenth of the pool under the lock)."""
    h = Harness(slots=12, high_watermark=0.75, low_watermark=0.5)
    assert h.store.summary()["capacity_bytes"] == 12 * BLOCK
    h.put(list(range(9)))  # 9 of 12: exactly at high, no eviction
    assert h.store.summary()["evictions"] == 0
    h.read(0)  # touch 0: most recently used
    h.put([100])  # 10 > 9: the drain starts; this put evicts 2 (1, 2), not 4
    assert h.present() == {0, 3, 4, 5, 6, 7, 8, 100}
    h.put([101])  # draining: 2 more (3, 4)
    h.put([102])  # 2 more (5, 6): 5 blocks + this one = 6 = low, the drain is over
    assert h.present() == {0, 7, 8, 100, 101, 102}
    assert h.store.summary()["evictions"] == 6
    h.put([103, 104, 105])  # 9 = high again: nothing evicted below it
    assert h.store.summary()["evictions"] == 6
    removed = [hs for kind, hs, _ in h.events if kind is EventKind.REMOVED]
    assert removed == [[key(1), key(2)], [key(3), key(4)], [key(5), key(6)]]  # one event per put, in order


def test_a_drain_that_finds_nothing_to_evict_stops_until_the_next_crossing() -> None:
    h = Harness(slots=12, high_watermark=0.75, low_watermark=0.5)
    h.put(list(range(9)))
    for i in range(9):
        h.store.pin([key(i)], None)  # hard pins: nothing may go
    assert h.put([100]) == 1  # crosses high; the drain finds no victim and stops; a slot is free
    assert h.store.summary()["evictions"] == 0
    h.store.remove([key(i) for i in range(3)])
    h.store.unpin([key(i) for i in range(3, 9)])  # 7 of 12: between low (6) and high (9)
    h.put([101])  # below high and no drain running: nothing is evicted
    assert h.store.summary()["evictions"] == 0
    h.put([102, 103])  # 10 > 9: the next crossing starts a drain: its room and as much again
    assert h.store.summary()["evictions"] == 4 and h.present() == {7, 8, 100, 101, 102, 103}


def test_a_put_into_a_full_pool_looks_at_about_as_many_blocks_as_it_evicts() -> None:
    """In a full pool every put evicts: the check that the put can fit (before anything is
    evicted) stops once it has seen enough evictable blocks of the put's size, instead of
    walking the whole index per put (a million blocks in a large daemon)."""
    h = Harness(slots=512)
    assert h.put(list(range(512))) == 512
    seen: list[bytes] = []
    evictable = h.store._evictable
    h.store._evictable = lambda k: seen.append(k) or evictable(k)  # type: ignore[method-assign]
    assert h.put([1000, 1001, 1002]) == 3
    assert len(seen) <= 3 * 2 + 2, f"{len(seen)} blocks looked at for a 3-block put"
    assert h.present() == set(range(3, 512)) | {1000, 1001, 1002}  # the 3 oldest went


def test_the_evictions_of_a_put_go_out_in_events_of_at_most_max_batch_blocks() -> None:
    """One event for a put's evictions, cut at max_batch_blocks keys (a large put evicting in a
    large arena evicts more than a directory takes in one event), in eviction order."""
    h = Harness(slots=16, high_watermark=0.5, low_watermark=0.25, max_batch_blocks=3)
    for first in range(0, 8, 2):
        h.put([first, first + 1])  # 8 of 16: at high, no eviction yet
    h.events.clear()
    h.put([100, 101, 102])  # 11 > 8: evict toward 4 - 3 blocks, at most twice 3: the 6 oldest go
    removed = [hs for kind, hs, _ in h.events if kind is EventKind.REMOVED]
    assert [len(hs) for hs in removed] == [3, 3]
    assert [k for hs in removed for k in hs] == [key(i) for i in range(6)]


def test_an_event_sink_that_fails_on_evictions_leaks_no_slot() -> None:
    h = Harness(slots=8)
    assert h.put(list(range(8))) == 8

    def refuse(kind: EventKind, keys: list[bytes], namespace: bytes) -> None:
        if kind is EventKind.REMOVED:
            raise RuntimeError("event sink down")

    h.store._on_event = refuse
    with pytest.raises(RuntimeError):
        h.store.put_start(NS, [key(100), key(101)], BLOCK)
    h.store.check_invariants()  # the put's slots went back; the evicted blocks are gone
    assert h.store.summary()["used_bytes"] == 6 * BLOCK


def test_batch_limit() -> None:
    h = Harness(max_batch_blocks=3)
    with pytest.raises(InvalidArgument, match="split"):
        h.store.lookup([key(i) for i in range(4)])
    with pytest.raises(InvalidArgument):
        h.store.put_start(NS, [key(i) for i in range(4)], BLOCK)
    assert h.store.used_bytes() == 0


def test_buffer_smaller_than_capacity_is_refused() -> None:
    config = StoreConfig(capacity_bytes=8192, slab_bytes=4096)
    with pytest.raises(InvalidArgument):
        HostStore(np.zeros(4096, dtype=np.uint8), config, FakeClock())


def test_remove_emits_removed_and_counts() -> None:
    h = Harness()
    h.put([1, 2])
    assert h.store.remove([key(1), key(7)]) == 1
    assert h.events[-1] == (EventKind.REMOVED, [key(1)], NS)
    assert h.store.used_bytes() == BLOCK and h.store.summary()["removed"] == 1


def test_put_of_another_size_class_that_cannot_fit_evicts_nothing() -> None:
    config = StoreConfig(capacity_bytes=2 * SLAB, slab_bytes=SLAB, high_watermark=1.0, low_watermark=1.0)
    buffer = np.zeros(config.capacity_bytes, dtype=np.uint8)
    store = HostStore(buffer, config, FakeClock())

    def put(ids: list[int], size: int) -> None:
        grant = store.put_start(NS, [key(i) for i in ids], size)
        sums = []
        for index, offset in grant.slots:
            buffer[offset : offset + size] = ids[index]
            sums.append(checksum64(buffer[offset : offset + size]))
        store.put_commit(grant.put_id, sums)

    put([1, 2], SLAB // 4)  # slab 0: two small blocks (half used)
    put([3, 4], SLAB // 2)  # slab 1: two large blocks (full)
    store.pin([key(2), key(3), key(4)], None)  # only small block 1 is evictable; evicting it frees no slab
    assert store.used_bytes() + SLAB // 2 <= config.capacity_bytes  # bytes-wise there is "room"
    with pytest.raises(CapacityExhausted):
        put([9], SLAB // 2)  # a large block: needs a whole free slab, and none can be freed
    assert store.lookup([key(1)]) == 1, "block 1 was evicted by a put that failed anyway"


def test_drop_corrupt_reverifies_and_a_leased_bad_block_keeps_its_slot_until_release() -> None:
    h = Harness(slots=8)
    assert h.put([1, 2, 3]) == 3
    assert h.store.drop_corrupt([key(1), key(2), key(3), key(7)]) == []  # all verify: nothing dropped
    grant = h.store.lease([key(1), key(2)])
    bad = grant.locations[1]
    h.buffer[bad.offset + 5] ^= 0x80
    used = h.store.used_bytes()
    assert h.store.drop_corrupt([key(2)]) == [key(2)]
    assert h.store.lookup([key(1), key(2)]) == 1
    assert h.events[-1] == (EventKind.REMOVED, [key(2)], NS)
    assert h.store.summary()["checksum_failures"] == 1
    assert h.store.used_bytes() == used  # leased: hidden now, its slot freed at the release
    h.store.release(grant.lease_id)
    assert h.store.used_bytes() == used - BLOCK
    assert h.put([2]) == 1 and h.read(2) is not None and np.array_equal(h.read(2), payload(2))


def test_a_drain_share_is_evicted_in_pieces_with_the_lock_let_go_between(monkeypatch: pytest.MonkeyPatch) -> None:
    """A put's share of a drain is evicted DRAIN_LOCK_BLOCKS at a time after its slots were
    granted, so other callers' lookups run between the pieces; each piece's evictions go out
    as their own event, and the blocks the put reported present are never evicted for it."""
    from kvpool.storage import host_store

    h = Harness(slots=12, high_watermark=0.75, low_watermark=0.5)
    h.put(list(range(9)))
    h.events.clear()
    monkeypatch.setattr(host_store, "DRAIN_LOCK_BLOCKS", 1)
    free: list[bool] = []

    def another_thread_can_lock(_s: float) -> None:
        def attempt() -> None:
            got = h.store._lock.acquire(blocking=False)
            if got:
                h.store._lock.release()
            free.append(got)

        thread = threading.Thread(target=attempt)
        thread.start()
        thread.join()

    monkeypatch.setattr(host_store, "time", SimpleNamespace(sleep=another_thread_can_lock))  # this module's only
    assert h.put([0, 100, 101]) == 2  # 0 is present: 2 new, a share of 4 (0 kept: the put names it)
    assert free and all(free)  # the lock was let go after each piece
    removed = [hs for kind, hs, _ in h.events if kind is EventKind.REMOVED]
    assert removed == [[key(1)], [key(2)], [key(3)], [key(4)]]
    assert h.present() == {0, 5, 6, 7, 8, 100, 101}


def test_a_put_that_is_refused_or_writes_nothing_evicts_nothing() -> None:
    """The drain's share is evicted only after a grant with slots: a put refused for
    max_pending_puts, or one whose blocks are all stored or being written, evicts nothing,
    also with usage above the high watermark."""
    h = Harness(slots=12, high_watermark=0.75, low_watermark=0.5, max_pending_puts=1)
    h.put(list(range(9)))
    for i in range(9):
        h.store.pin([key(i)], None)
    h.put([100])  # above high now (10 of 12): the drain found nothing and stopped
    for i in range(9):
        h.store.unpin([key(i)])
    assert h.store.summary()["evictions"] == 0
    grant = h.store.put_start(NS, [key(0), key(100)], BLOCK)  # all stored: nothing to write
    assert grant.put_id == 0
    assert h.store.summary()["evictions"] == 0
    h.store.put_start(NS, [key(200)], BLOCK)  # one put in flight: the limit (it drains: 2 go)
    evicted = h.store.summary()["evictions"]
    with pytest.raises(CapacityExhausted, match="max_pending_puts"):
        h.store.put_start(NS, [key(201)], BLOCK)
    assert h.store.summary()["evictions"] == evicted
