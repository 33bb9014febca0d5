"""A full pool's put takes over its victims' slots (``SlabAllocator.can_hand_over``,
``HostStore._evict_for_slots``) instead of freeing each and allocating again: under any
sequence of puts of two block sizes, leases, pins and removes, with on-demand eviction or
a watermark drain, a store that hands slots over grants exactly the slots, evicts exactly
the blocks, reports exactly the events and ends in exactly the allocator state of a store
that frees and allocates one block at a time (the code before, kept as the reference by
refusing every hand-over)."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig
from kvpool.core.errors import CapacityExhausted
from kvpool.storage.host_store import HostStore

SMALL, LARGE = 200, 500  # slots of 256 and 512 bytes: 4 or 2 a slab
SLAB = 1024
SLABS = 6
NS = b"\x07" * 16

IDS = st.integers(0, 40)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.sampled_from([SMALL, LARGE]), st.lists(IDS, min_size=1, max_size=9)),
        st.tuples(st.just("lease"), st.just(0), st.lists(st.integers(0, 40), min_size=1, max_size=3)),
        st.tuples(st.just("release"), st.just(0), st.just([])),
        st.tuples(st.just("pin"), st.just(0), st.lists(st.integers(0, 40), min_size=1, max_size=2)),
        st.tuples(st.just("remove"), st.just(0), st.lists(st.integers(0, 40), min_size=1, max_size=3)),
    ),
    min_size=1,
    max_size=40,
)


def key(size: int, i: int) -> bytes:
    """Keys of the two sizes never collide (a key names one block size, as a namespace does)."""
    return bytes([size % 251]) + i.to_bytes(15, "big")


class Run:
    """One store and what it did, step by step."""

    def __init__(self, watermarks: tuple[float, float], hand_over: bool) -> None:
        high, low = watermarks
        config = StoreConfig(capacity_bytes=SLABS * SLAB, slab_bytes=SLAB, high_watermark=high, low_watermark=low)
        self.buffer = np.zeros(config.capacity_bytes, dtype=np.uint8)
        self.log: list[Any] = []
        self.store = HostStore(self.buffer, config, FakeClock(), on_event=lambda k, h, n: self.log.append((k, list(h))))
        if not hand_over:  # the reference: every victim's slot is freed and allocated again
            self.store._alloc.can_hand_over = lambda offset, block_bytes, owner: False  # type: ignore[method-assign]
        self.leases: list[int] = []

    def step(self, op: str, size: int, ids: list[int]) -> None:
        store = self.store
        if op == "put":
            keys = [key(size, i) for i in ids]
            try:
                grant = store.put_start(NS, keys, size)
            except CapacityExhausted:
                self.log.append("full")
                return
            self.log.append(("grant", grant.indices, grant.offsets, grant.already_present, grant.in_flight))
            sums = []
            for index, offset in grant.slots:
                data = np.full(size, ids[index] % 251, dtype=np.uint8)
                self.buffer[offset : offset + size] = data
                sums.append(checksum64(data))
            if grant.put_id:
                self.log.append(("commit", store.put_commit(grant.put_id, sums).committed))
        elif op == "lease":
            grant = store.lease([key(SMALL, i) for i in ids])
            if grant.lease_id:
                self.leases.append(grant.lease_id)
        elif op == "release" and self.leases:
            store.release(self.leases.pop(0))
        elif op == "pin":
            store.pin([key(SMALL, i) for i in ids] + [key(LARGE, i) for i in ids], None)
        elif op == "remove":
            store.remove([key(SMALL, i) for i in ids] + [key(LARGE, i) for i in ids])

    def state(self) -> Any:
        alloc = self.store._alloc
        slabs = [(alloc.slot_bytes_at(s * SLAB), alloc.slab_used_slots(s)) for s in range(alloc.num_slabs)]
        index = sorted((k, e.offset) for k, e in self.store._index.items())
        return slabs, alloc.used_bytes, alloc.free_slabs(), index, self.store.summary()["evictions"]


@settings(max_examples=150, deadline=None)
@given(ops=OPS, watermarks=st.sampled_from([(1.0, 1.0), (0.9, 0.6), (0.75, 0.5)]))
def test_handing_victims_slots_over_is_exactly_freeing_and_allocating_them(
    ops: list[tuple[str, int, list[int]]], watermarks: tuple[float, float]
) -> None:
    fast, reference = Run(watermarks, hand_over=True), Run(watermarks, hand_over=False)
    for op in ops:
        fast.step(*op)
        reference.step(*op)
        assert fast.log == reference.log
        assert fast.state() == reference.state()
        fast.store.check_invariants()


def test_a_full_pool_of_one_size_hands_every_victims_slot_over() -> None:
    """The case it is for: a pool full of one block size, a put of new blocks of that size;
    each slot granted is a slot an evicted block held, and nothing was freed and allocated."""
    run = Run((1.0, 1.0), hand_over=True)
    per_slab = SLAB // 256
    run.step("put", SMALL, list(range(SLABS * per_slab)))  # full
    held = {e.offset for e in run.store._index.values()}
    frees: list[int] = []
    free = run.store._alloc.free
    run.store._alloc.free = lambda offset: frees.append(offset) or free(offset)  # type: ignore[method-assign]
    run.step("put", SMALL, [100, 101, 102])
    grant = next(entry for entry in reversed(run.log) if entry[0] == "grant")
    assert set(grant[2]) <= held and len(grant[2]) == 3
    assert frees == []
    assert run.store.summary()["evictions"] == 3
