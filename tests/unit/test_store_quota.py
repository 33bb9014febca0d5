"""Per-namespace quotas of the host tier (``StoreConfig.namespace_quota_bytes``): a put past
a namespace's quota evicts that namespace's own blocks first, never another's; a put that
cannot make room fails whole with nothing evicted; every way bytes leave (commit failure,
abort, reclaim, remove, eviction) gives them back to the namespace."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig
from kvpool.core.errors import CapacityExhausted, InvalidArgument
from kvpool.storage.host_store import HostStore

BLOCK = 1024
SLAB = 4096
A = b"a" * 16
B = b"b" * 16


def key(ns: bytes, i: int) -> bytes:
    return ns + i.to_bytes(16, "big")


def payload(i: int) -> np.ndarray:
    return np.full(BLOCK, i % 251, dtype=np.uint8)


class Quota:
    def __init__(self, quota_blocks: int = 4, slots: int = 16) -> None:
        config = StoreConfig(
            capacity_bytes=slots * BLOCK,
            slab_bytes=SLAB,
            high_watermark=1.0,
            low_watermark=1.0,
            namespace_quota_bytes=quota_blocks * BLOCK,
            put_ttl_ms=100,
        )
        self.clock = FakeClock()
        self.buffer = np.zeros(config.capacity_bytes, dtype=np.uint8)
        self.store = HostStore(self.buffer, config, self.clock)

    def put(self, ns: bytes, ids: Sequence[int], corrupt: bool = False) -> int:
        grant = self.store.put_start(ns, [key(ns, i) for i in ids], BLOCK)
        sums = []
        for index, offset in grant.slots:
            self.buffer[offset : offset + BLOCK] = payload(ids[index])
            sums.append(checksum64(payload(ids[index])) ^ int(corrupt))
        return self.store.put_commit(grant.put_id, sums).committed if grant.put_id else 0

    def held(self, ns: bytes, ids: Sequence[int]) -> list[int]:
        return [i for i in ids if self.store.entry(key(ns, i)) is not None]


def test_a_put_past_the_quota_evicts_only_the_namespaces_own_oldest_blocks() -> None:
    q = Quota()
    assert q.put(B, [0, 1, 2, 3]) == 4  # B's blocks are the least recently used of all
    assert q.put(A, [0, 1, 2, 3]) == 4
    assert q.put(A, [4, 5]) == 2
    assert q.held(A, range(6)) == [2, 3, 4, 5]  # A's two oldest made room
    assert q.held(B, range(4)) == [0, 1, 2, 3]  # B was not touched
    assert q.store.namespace_bytes(A) == q.store.namespace_bytes(B) == 4 * BLOCK


def test_a_put_that_cannot_make_room_in_its_quota_fails_whole_and_evicts_nothing() -> None:
    q = Quota()
    assert q.put(A, [0, 1, 2, 3]) == 4
    lease = q.store.lease([key(A, i) for i in range(3)])
    assert q.store.pin([key(A, 3)], None) == 1
    with pytest.raises(CapacityExhausted) as info:
        q.put(A, [4])
    assert "quota" in info.value.message and "nothing was evicted" in info.value.message
    assert q.held(A, range(4)) == [0, 1, 2, 3]
    with pytest.raises(CapacityExhausted):
        q.put(B, list(range(10, 15)))  # larger than the quota itself
    q.store.release(lease.lease_id)
    assert q.put(A, [4]) == 1 and q.held(A, range(5)) == [1, 2, 3, 4]


def test_failed_aborted_reclaimed_and_removed_bytes_are_given_back() -> None:
    q = Quota()
    assert q.put(A, [0, 1], corrupt=True) == 0
    assert q.store.namespace_bytes(A) == 0
    grant = q.store.put_start(A, [key(A, 2)], BLOCK)
    assert q.store.namespace_bytes(A) == BLOCK  # being written counts
    q.store.put_abort(grant.put_id)
    q.store.put_start(A, [key(A, 3)], BLOCK)
    q.clock.advance(200)
    assert q.store.sweep() == (0, 1)
    assert q.store.namespace_bytes(A) == 0
    assert q.put(A, [4, 5]) == 2
    assert q.store.remove([key(A, 4)]) == 1
    assert q.store.namespace_bytes(A) == BLOCK


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([A, B]), st.lists(st.integers(0, 12), min_size=1, max_size=5)), max_size=30))
def test_no_namespace_ever_holds_more_than_its_quota(puts: list[tuple[bytes, list[int]]]) -> None:
    q = Quota(quota_blocks=5, slots=12)
    for ns, ids in puts:
        try:
            q.put(ns, ids)
        except CapacityExhausted:
            pass
        for name in (A, B):
            held = q.held(name, range(13))
            assert q.store.namespace_bytes(name) == len(held) * BLOCK <= 5 * BLOCK


A2 = b"c" * 16  # a second namespace of tenant "t" (with A)


def tenant_quota(tenant_blocks: int, uniform_blocks: int = 0, slots: int = 16) -> Quota:
    """A store where namespaces A and A2 belong to tenant "t" with its own quota of
    ``tenant_blocks``; B has the uniform per-namespace one (``uniform_blocks``)."""
    q = Quota(quota_blocks=uniform_blocks, slots=slots)
    q.store.set_tenant_quotas({A: ("t", tenant_blocks * BLOCK), A2: ("t", tenant_blocks * BLOCK)})
    return q


def test_a_tenant_quota_counts_all_its_namespaces_and_evicts_only_its_own() -> None:
    q = tenant_quota(tenant_blocks=4)
    assert q.put(B, [0, 1, 2, 3, 4, 5]) == 6  # no uniform quota: B is not capped
    assert q.put(A, [0, 1, 2]) == 3
    assert q.put(A2, [0, 1, 2]) == 3  # 6 > 4: the tenant's oldest blocks (A's) go first
    assert q.store.tenant_bytes("t") == 4 * BLOCK
    assert q.held(A, range(3)) == [2] and q.held(A2, range(3)) == [0, 1, 2]
    assert q.held(B, range(6)) == list(range(6))  # nothing of another tenant was evicted
    with pytest.raises(CapacityExhausted, match="tenant 't'"):
        q.put(A, list(range(10, 15)))  # 5 blocks can never fit a 4-block quota
    assert q.store.tenant_bytes("t") == 4 * BLOCK


def test_tenant_quotas_are_set_before_the_store_holds_anything() -> None:
    q = Quota(quota_blocks=0)
    q.put(A, [0])
    with pytest.raises(InvalidArgument):
        q.store.set_tenant_quotas({A: ("t", BLOCK)})


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([A, A2, B]), st.lists(st.integers(0, 12), min_size=1, max_size=5)), max_size=30)
)
def test_no_tenant_ever_holds_more_than_its_quota(puts: list[tuple[bytes, list[int]]]) -> None:
    q = tenant_quota(tenant_blocks=6, uniform_blocks=3, slots=16)
    for ns, ids in puts:
        before_b = q.held(B, range(13))
        try:
            q.put(ns, ids)
        except CapacityExhausted:
            pass
        if ns != B:
            assert q.held(B, range(13)) == before_b  # the tenant's puts never evict B
        tenant_held = len(q.held(A, range(13))) + len(q.held(A2, range(13)))
        assert q.store.tenant_bytes("t") == tenant_held * BLOCK <= 6 * BLOCK
        assert q.store.namespace_bytes(B) == len(q.held(B, range(13))) * BLOCK <= 3 * BLOCK


@settings(max_examples=40, deadline=None)
@given(run=st.integers(0, 1500), extra=st.sets(st.integers(0, 1500), max_size=50), asked=st.integers(0, 1500))
def test_a_long_lookup_walked_in_chunks_counts_the_leading_run(run: int, extra: set[int], asked: int) -> None:
    """``HostStore.lookup`` takes the lock ``LOOKUP_LOCK_KEYS`` keys at a time: the count is
    still the leading run of present keys, across chunk boundaries."""
    present = set(range(run)) | {i for i in extra if i != run}  # a leading run, then holes and islands
    q = Quota(quota_blocks=0, slots=1600)
    for start in range(0, 1501, 400):
        q.put(A, [i for i in range(start, min(start + 400, 1501)) if i in present])
    expected = next((i for i in range(asked) if i not in present), asked)
    assert q.store.lookup([key(A, i) for i in range(asked)]) == expected
