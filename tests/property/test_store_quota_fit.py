"""A put into a store with namespace quotas (and per-tenant segments) either fits or fails
before it evicts anything, and every eviction is reported once: random puts of mixed sizes
across three namespaces, beside leases, pins and releases."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig
from kvpool.core.errors import CapacityExhausted
from kvpool.core.events import EventKind
from kvpool.storage.host_store import HostStore

SLAB = 4096
NAMESPACES = [bytes([65 + i]) * 16 for i in range(3)]


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), segmented=st.booleans())
def test_a_failed_put_evicted_nothing_and_every_eviction_is_reported(seed: int, segmented: bool) -> None:
    rng = random.Random(seed)
    capacity = 8 * SLAB
    config = StoreConfig(
        capacity_bytes=capacity,
        slab_bytes=SLAB,
        high_watermark=1.0,
        low_watermark=1.0,
        namespace_quota_bytes=4 * SLAB,
    )
    buffer = np.zeros(capacity, dtype=np.uint8)
    removed: list[bytes] = []

    def sink(kind: EventKind, keys: list[bytes], namespace: bytes) -> None:
        if kind is EventKind.REMOVED:
            removed.extend(keys)

    store = HostStore(buffer, config, FakeClock(), on_event=sink, segment_bytes=2 * SLAB if segmented else 0)
    if segmented:
        store.set_segment_owners({NAMESPACES[0]: 1, NAMESPACES[1]: 2}, None)
    leases: list[int] = []
    serial = 0
    for _ in range(40):
        op = rng.random()
        if op < 0.7:
            ns, size, count = rng.choice(NAMESPACES), rng.choice([512, 1024, 2048]), rng.randint(1, 12)
            keys = [ns + (serial + i).to_bytes(16, "big") for i in range(count)]
            serial += count
            evictions = store.stats.evictions
            try:
                grant = store.put_start(ns, keys, size)
            except CapacityExhausted:
                assert store.stats.evictions == evictions, "a put that failed evicted blocks"
                continue
            data = np.full(size, 7, np.uint8)
            for offset in grant.offsets:
                buffer[offset : offset + size] = data
            if grant.put_id:
                store.put_commit(grant.put_id, [checksum64(data)] * len(grant.offsets))
        elif op < 0.85 and (keys := store.snapshot_keys()):
            grant = store.lease([rng.choice(keys)])
            if grant.lease_id:
                leases.append(grant.lease_id)
        elif op < 0.92 and (keys := store.snapshot_keys()):
            store.pin([rng.choice(keys)], None)
        elif leases:
            store.release(leases.pop(rng.randrange(len(leases))))
        store.check_invariants()
    assert len(removed) == len(set(removed)) == store.stats.evictions
