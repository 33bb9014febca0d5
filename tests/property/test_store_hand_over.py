"""A full pool's put takes over its victims' slots (``SlabAllocator.can_hand_over``,
``HostStore._evict_for_slots``) instead of freeing each and allocating again: under any
sequence of puts, leases, pins, removes and aborted puts, with on-demand eviction or a
watermark drain, a store that hands slots over grants exactly the slots, evicts exactly the
blocks, reports exactly the events and ends in exactly the allocator, index, counter and
eviction-policy state of a store that frees and allocates one block at a time (the code
before, kept as the reference by refusing every hand-over). Two set-ups: one tenant with two
block sizes, and three tenants (per-tenant segments, quotas, sizes sharing a slot class and
one taking a whole slab, every eviction policy)."""

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

SLAB = 1024
SEGMENT = 2 * SLAB
TENANTS = [b"\x01" * 16, b"\x02" * 16, b"\x03" * 16]
# slots of 256 bytes (200 and 250: one class, a victim of either size may hand its slot to
# the other), 512 bytes, and a whole slab (600: a slot that must not be handed over, since
# freeing it gives its slab back to the segment)
SMALL, SHARED_CLASS, LARGE, WHOLE_SLAB = 200, 250, 500, 600

Op = tuple[str, int, int, list[int], bool]  # (op, tenant, block bytes, ids, abort the put)


def ops(tenants: int, sizes: list[int], ids: int, most_put: int, most_steps: int) -> st.SearchStrategy[list[Op]]:
    def op(name: str, most: int) -> st.SearchStrategy[Op]:
        return st.tuples(
            st.just(name),
            st.integers(0, tenants - 1),
            st.sampled_from(sizes),
            st.lists(st.integers(0, ids), min_size=1, max_size=most),
            st.booleans() if name == "put" and tenants > 1 else st.just(False),
        )

    steps = st.one_of(
        op("put", most_put),
        op("put", most_put),
        op("put", most_put),
        op("lease", 3),
        op("release", 1),
        op("pin", 2),
        op("remove", 3),
    )
    return st.lists(steps, min_size=1, max_size=most_steps)


def key(tenant: int, size: int, i: int) -> bytes:
    """Keys of two sizes never collide (a key names one block size, as a namespace does)."""
    return bytes([tenant, size % 251]) + i.to_bytes(14, "big")


class Run:
    """One store and what it did, step by step. Its demotion hook checks that it was handed
    each victim's committed bytes (a slot handed over must not be written before its victim
    was demoted)."""

    def __init__(
        self,
        hand_over: bool,
        slabs: int,
        watermarks: tuple[float, float] = (1.0, 1.0),
        policy: str = "lru",
        segments: bool = False,
        quota_bytes: int = 0,
    ) -> None:
        high, low = watermarks
        config = StoreConfig(
            capacity_bytes=slabs * SLAB,
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
        if not hand_over:  # the reference: every victim's slot is freed and allocated again
            self.store._alloc.can_hand_over = lambda offset, block_bytes, owner: False  # type: ignore[method-assign]
        self.leases: list[int] = []

    def step(self, op: str, tenant: int, size: int, ids: list[int], abort: bool) -> None:
        store, keys = self.store, [key(tenant, size, i) for i in ids]
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


def same_steps(fast: Run, reference: Run, steps: list[Op]) -> None:
    for step in steps:
        fast.step(*step)
        reference.step(*step)
        assert fast.log == reference.log
        assert fast.state() == reference.state()
        assert not fast.wrong_demotions
        fast.store.check_invariants()


@settings(max_examples=150, deadline=None)
@given(
    steps=ops(tenants=1, sizes=[SMALL, LARGE], ids=40, most_put=9, most_steps=40),
    watermarks=st.sampled_from([(1.0, 1.0), (0.9, 0.6), (0.75, 0.5)]),
)
def test_handing_victims_slots_over_is_exactly_freeing_and_allocating_them(
    steps: list[Op], watermarks: tuple[float, float]
) -> None:
    same_steps(Run(True, 6, watermarks), Run(False, 6, watermarks), steps)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=60, deadline=None)
@given(
    steps=ops(tenants=3, sizes=[SMALL, SHARED_CLASS, LARGE, WHOLE_SLAB], ids=60, most_put=12, most_steps=50),
    segments=st.booleans(),
    watermarks=st.sampled_from([(1.0, 1.0), (0.9, 0.6)]),
    quota_bytes=st.sampled_from([0, 2048]),
)
def test_hand_over_equals_free_and_allocate_with_tenants_quotas_aborts_demotions_and_every_policy(
    policy: str, steps: list[Op], segments: bool, watermarks: tuple[float, float], quota_bytes: int
) -> None:
    if segments:
        watermarks = (1.0, 1.0)  # per-tenant segments evict on demand only
    fast = Run(True, 8, watermarks, policy, segments, quota_bytes)
    reference = Run(False, 8, watermarks, policy, segments, quota_bytes)
    room_taken = [("put", tenant, SMALL, list(range(100, 112)), False) for tenant in (0, 1)]
    same_steps(fast, reference, room_taken + steps)


def test_a_full_pool_of_one_size_hands_every_victims_slot_over() -> None:
    """The case it is for: a pool full of one block size, a put of new blocks of that size;
    each slot granted is a slot an evicted block held, and nothing was freed and allocated."""
    slabs = 6
    run = Run(True, slabs)
    per_slab = SLAB // 256
    run.step("put", 0, SMALL, list(range(slabs * per_slab)), False)  # full
    held = {e.offset for e in run.store._index.values()}
    frees: list[int] = []
    free = run.store._alloc.free
    run.store._alloc.free = lambda offset: frees.append(offset) or free(offset)  # type: ignore[method-assign]
    run.step("put", 0, SMALL, [100, 101, 102], False)
    grant = next(entry for entry in reversed(run.log) if entry[0] == "grant")
    assert set(grant[2]) <= held and len(grant[2]) == 3
    assert frees == []
    assert run.store.summary()["evictions"] == 3
