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
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig
from kvpool.core.errors import CapacityExhausted
from kvpool.storage.eviction import POLICIES, make_policy
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


# -- the same equivalence with everything else a victim's slot can meet --------------------------
# Three tenants, two of them sharing a per-tenant arena's segment owner; block sizes of 200 and
# 250 bytes share the 256-byte slot class (a victim of the other size may hand its slot over),
# 500 bytes is a class of its own, 600 bytes takes a whole slab (a slot that must not be handed
# over: freeing it gives its slab back to the segment); namespace quotas; puts aborted after their bytes were
# written; a demotion hook that checks it was handed the victim's committed bytes (a slot
# handed over must not be written before its victim was demoted); every eviction policy.
TENANTS = [b"\x01" * 16, b"\x02" * 16, b"\x03" * 16]
SIZES = [200, 250, 500, 600]
SEGMENT = 2 * SLAB
WIDE_IDS = st.integers(0, 60)


def tenant_op(name: str, most: int) -> st.SearchStrategy[tuple[str, int, int, list[int], bool]]:
    return st.tuples(
        st.just(name),
        st.integers(0, 2),
        st.sampled_from(SIZES),
        st.lists(WIDE_IDS, min_size=1, max_size=most),
        st.booleans() if name == "put" else st.just(False),
    )


TENANT_OPS = st.lists(
    st.one_of(
        tenant_op("put", 12),
        tenant_op("put", 12),
        tenant_op("put", 12),
        tenant_op("lease", 3),
        tenant_op("release", 1),
        tenant_op("pin", 2),
        tenant_op("remove", 3),
    ),
    min_size=1,
    max_size=50,
)


def tenant_key(tenant: int, size: int, i: int) -> bytes:
    return bytes([tenant, size % 251]) + i.to_bytes(14, "big")


class TenantRun:
    """One store of three tenants and what it did, step by step."""

    def __init__(
        self, policy: str, segments: bool, watermarks: tuple[float, float], quota_bytes: int, hand_over: bool
    ) -> None:
        high, low = watermarks
        config = StoreConfig(
            capacity_bytes=8 * SLAB,
            slab_bytes=SLAB,
            high_watermark=high,
            low_watermark=low,
            namespace_quota_bytes=quota_bytes,
        )
        self.buffer = np.zeros(config.capacity_bytes, dtype=np.uint8)
        self.log: list[Any] = []
        self.wrong_demotions: list[bytes] = []

        def on_evict(entry: Any, data: np.ndarray) -> None:
            if checksum64(np.array(data)) != entry.checksum:
                self.wrong_demotions.append(entry.key)
            self.log.append(("demote", entry.key, entry.offset))

        self.store = HostStore(
            self.buffer,
            config,
            FakeClock(),
            on_event=lambda k, h, n: self.log.append((k, list(h), n)),
            on_evict=on_evict,
            policy=make_policy(policy),
            segment_bytes=SEGMENT if segments else 0,
        )
        if segments:
            owners = {TENANTS[0]: 0, TENANTS[1]: 1, TENANTS[2]: 1}
            self.store.set_segment_owners(owners, lambda *args: self.log.append(("new owner", *args)))
        if not hand_over:
            self.store._alloc.can_hand_over = lambda offset, block_bytes, owner: False  # type: ignore[method-assign]
        self.leases: list[int] = []

    def step(self, op: str, tenant: int, size: int, ids: list[int], abort: bool) -> None:
        store, keys = self.store, [tenant_key(tenant, size, i) for i in ids]
        if op == "put":
            try:
                grant = store.put_start(TENANTS[tenant], keys, size)
            except CapacityExhausted:
                self.log.append("full")
                return
            self.log.append(("grant", grant.indices, grant.offsets, grant.already_present, grant.in_flight))
            if not grant.put_id:
                return
            sums = []
            for index, offset in grant.slots:
                data = np.random.default_rng(ids[index] * 7 + size + tenant).integers(0, 255, size, dtype=np.uint8)
                self.buffer[offset : offset + size] = data
                sums.append(checksum64(data))
            if abort:
                store.put_abort(grant.put_id)
                self.log.append("abort")
            else:
                self.log.append(("commit", store.put_commit(grant.put_id, sums).committed))
        elif op == "lease":
            lease = store.lease(keys)
            if lease.lease_id:
                self.leases.append(lease.lease_id)
        elif op == "release" and self.leases:
            store.release(self.leases.pop(0))
        elif op == "pin":
            store.pin(keys, None)
        elif op == "remove":
            store.remove(keys)

    def state(self) -> Any:
        alloc, store = self.store._alloc, self.store
        slabs = [(alloc.slot_bytes_at(s * SLAB), alloc.slab_used_slots(s)) for s in range(alloc.num_slabs)]
        owners = (list(alloc._seg_owner), alloc._seg_generation.tolist())
        index = sorted((k, e.offset) for k, e in store._index.items())
        policy = repr(sorted((name, repr(value)) for name, value in vars(store._policy).items()))
        usage = (alloc.used_bytes, alloc.free_slabs(), store.summary(), dict(store._ns_bytes))
        return slabs, usage, owners, index, policy


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=60, deadline=None)
@given(
    ops=TENANT_OPS,
    segments=st.booleans(),
    watermarks=st.sampled_from([(1.0, 1.0), (0.9, 0.6)]),
    quota_bytes=st.sampled_from([0, 2048]),
)
def test_hand_over_equals_free_and_allocate_with_tenants_quotas_aborts_demotions_and_every_policy(
    policy: str,
    ops: list[tuple[str, int, int, list[int], bool]],
    segments: bool,
    watermarks: tuple[float, float],
    quota_bytes: int,
) -> None:
    if segments:
        watermarks = (1.0, 1.0)  # per-tenant segments evict on demand only
    fast = TenantRun(policy, segments, watermarks, quota_bytes, hand_over=True)
    reference = TenantRun(policy, segments, watermarks, quota_bytes, hand_over=False)
    for tenant in (0, 1):  # room taken by two tenants before the random steps
        for run in (fast, reference):
            run.step("put", tenant, 200, list(range(100, 112)), False)
    for op in ops:
        fast.step(*op)
        reference.step(*op)
        assert fast.log == reference.log
        assert fast.state() == reference.state()
        assert not fast.wrong_demotions
        fast.store.check_invariants()
