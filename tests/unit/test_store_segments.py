"""The host store with segment owners (per-tenant arenas, ``HostStore.set_segment_owners``):
blocks land in their namespace's owner's segments on every path (a put, a promotion from
disk); room is made by evicting the owner's own blocks first, then by emptying one whole
segment of another owner (the one with the fewest blocks); a segment that cannot be emptied
(a leased block) is left alone and the put fails whole with nothing evicted; the arena is
told before a segment changes owner. Debug invariants (``tests/conftest.py``) check after
every operation that each block's slot lies in a segment of its namespace's owner."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Sequence

import numpy as np
import pytest

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig, TierConfig
from kvpool.core.errors import CapacityExhausted
from kvpool.storage.host_store import HostStore
from kvpool.storage.tiered_store import TieredStore

BLOCK = 1024
SLAB = 4096
SEGMENT = 2 * SLAB  # 8 blocks a segment
SEGMENTS = 4
A = b"a" * 16
B = b"b" * 16
OWNERS = {A: 1, B: 2}
CONFIG = StoreConfig(capacity_bytes=SEGMENTS * SEGMENT, slab_bytes=SLAB, high_watermark=1.0, low_watermark=1.0)


def key(ns: bytes, i: int) -> bytes:
    return ns + i.to_bytes(16, "big")


def payload(i: int) -> np.ndarray:
    return np.full(BLOCK, i % 251, dtype=np.uint8)


class Segmented:
    def __init__(self, store: HostStore | TieredStore, buffer: np.ndarray) -> None:
        self.store, self.buffer = store, buffer
        self.told: list[tuple[int, int, int]] = []
        store.set_segment_owners(OWNERS, lambda seg, owner, gen: self.told.append((seg, owner, gen)))

    def put(self, ns: bytes, ids: Sequence[int]) -> list[int]:
        grant = self.store.put_start(ns, [key(ns, i) for i in ids], BLOCK)
        for index, offset in grant.slots:
            self.buffer[offset : offset + BLOCK] = payload(ids[index])
        if grant.put_id:
            self.store.put_commit(grant.put_id, [checksum64(payload(ids[index])) for index, _ in grant.slots])
        return [offset for _, offset in grant.slots]

    def held(self, ns: bytes, ids: Sequence[int]) -> list[int]:
        return [i for i in ids if self.store.tier_of(key(ns, i)) == "host"]

    def segments(self, ns: bytes, ids: Sequence[int]) -> set[int]:
        host = self.store.host if isinstance(self.store, TieredStore) else self.store
        entries = [host.entry(key(ns, i)) for i in ids]
        return {e.offset // SEGMENT for e in entries if e is not None}


@pytest.fixture
def seg() -> Segmented:
    buffer = np.zeros(CONFIG.capacity_bytes, dtype=np.uint8)
    return Segmented(HostStore(buffer, CONFIG, FakeClock(), segment_bytes=SEGMENT), buffer)


def test_blocks_of_two_owners_never_share_a_segment(seg: Segmented) -> None:
    seg.put(A, range(3))
    seg.put(B, range(3))
    assert seg.segments(A, range(3)).isdisjoint(seg.segments(B, range(3)))
    assert [owner for _, owner, _ in seg.told] == [1, 2]  # each took a fresh segment, generation 0
    gens = seg.store.segment_generations(seg.put(A, [10]))
    assert gens == [0]


def test_an_owner_evicts_its_own_blocks_before_another_owners(seg: Segmented) -> None:
    seg.put(A, range(24))  # three segments
    seg.put(B, range(8))  # the fourth
    seg.put(A, [100, 101])
    assert seg.held(B, range(8)) == list(range(8))  # B lost nothing
    assert len(seg.held(A, range(24))) == 22 and seg.held(A, [100, 101]) == [100, 101]


def test_an_owner_without_room_empties_one_whole_segment_of_another(seg: Segmented) -> None:
    seg.put(A, range(32))  # every segment is A's
    offsets = seg.put(B, range(3))
    assert len({o // SEGMENT for o in offsets}) == 1
    assert len(seg.held(A, range(32))) == 24  # exactly one segment of A's went, for B
    assert seg.told[-1][1:] == (2, 1)  # the arena was told: a new owner, generation 1
    assert seg.store.segment_generations(offsets) == [1, 1, 1]
    assert seg.held(B, range(3)) == [0, 1, 2]


def test_segments_that_cannot_be_emptied_are_left_alone(seg: Segmented) -> None:
    seg.put(A, range(32))
    lease = seg.store.lease([key(A, i) for i in range(0, 32, 8)])  # one leased block in each segment
    assert len(lease.locations) == 4
    with pytest.raises(CapacityExhausted):
        seg.put(B, [0])
    assert len(seg.held(A, range(32))) == 32  # nothing was evicted for a put that could not fit
    seg.store.release(lease.lease_id)
    seg.put(B, [0])
    assert seg.held(B, [0]) == [0]


def test_a_promotion_from_disk_lands_in_the_owner_segments(tmp_path: pathlib.Path) -> None:
    buffer = np.zeros(CONFIG.capacity_bytes, dtype=np.uint8)
    tiers = TierConfig(disk_dir=str(tmp_path), disk_capacity_bytes=1 << 21, disk_slab_file_bytes=1 << 20)
    store = TieredStore(buffer, CONFIG, tiers, FakeClock(), segment_bytes=SEGMENT)
    try:
        seg = Segmented(store, buffer)
        seg.put(A, range(8))  # one segment
        seg.put(B, range(24))  # the other three
        seg.put(A, range(100, 108))  # A's own oldest make room: demoted to disk
        assert seg.held(A, range(8)) == [] and len(seg.held(B, range(24))) == 24
        deadline = time.monotonic() + 30
        while store.disk is None or sum(store.disk.contains(key(A, i)) for i in range(8)) < 8:
            assert time.monotonic() < deadline, "the demotion to disk did not finish"
            time.sleep(0.01)
        freed = seg.segments(B, range(8))
        assert store.remove([key(B, i) for i in range(8)]) == 8  # B empties one segment
        lease = store.lease([key(A, i) for i in range(8)])  # promoted from disk into host
        assert len(lease.locations) == 8
        assert {loc.offset // SEGMENT for loc in lease.locations} == freed  # the freed segment, now A's
        assert {store.segment_owner_at(loc.offset) for loc in lease.locations} == {1}
        assert store.segment_generations([lease.locations[0].offset]) == [1]  # a new owner: fresh memory
        for i, loc in enumerate(lease.locations):
            assert np.array_equal(buffer[loc.offset : loc.offset + BLOCK], payload(i))
        store.release(lease.lease_id)
    finally:
        store.close()


def test_the_watermark_never_evicts_an_owner_that_has_room() -> None:
    """Arena-wide watermarks with owners: B holds most of the arena, so the arena is above
    its high watermark; A's put fits in A's own segment and must evict nothing of A's
    (only A's blocks can be evicted for A, so chasing the arena-wide target wiped A's cache)."""
    config = StoreConfig(capacity_bytes=SEGMENTS * SEGMENT, slab_bytes=SLAB, high_watermark=0.5, low_watermark=0.4)
    buffer = np.zeros(config.capacity_bytes, dtype=np.uint8)
    seg = Segmented(HostStore(buffer, config, FakeClock(), segment_bytes=SEGMENT), buffer)
    seg.put(A, range(2))  # A: one segment, 6 slots free
    seg.put(B, range(16))  # B: two segments; the arena is 18/32 used, above 0.5
    seg.put(A, [10, 11])
    assert seg.held(A, [0, 1, 10, 11]) == [0, 1, 10, 11]
    assert seg.held(B, range(16)) == list(range(16))
