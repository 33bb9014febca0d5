"""SlabAllocator edge cases and the eviction policies' order."""

from __future__ import annotations

import pytest

from kvpool.core.errors import InvalidArgument
from kvpool.storage.allocator import SlabAllocator, slot_size_for
from kvpool.storage.eviction import LRUPolicy, S3FIFOPolicy, make_policy


def test_slot_size_rounds_up_to_64() -> None:
    assert [slot_size_for(n) for n in (1, 64, 65, 128, 1000)] == [64, 64, 128, 128, 1024]


def test_constructor_and_block_size_limits() -> None:
    with pytest.raises(InvalidArgument):
        SlabAllocator(100, 4096)
    with pytest.raises(InvalidArgument):
        SlabAllocator(4096, 0)
    alloc = SlabAllocator(8192, 4096)
    with pytest.raises(InvalidArgument, match="slab"):
        alloc.alloc(4097)
    with pytest.raises(InvalidArgument):
        alloc.alloc(0)


def test_double_free_and_bad_offsets_are_refused_without_corrupting_state() -> None:
    alloc = SlabAllocator(8192, 4096)
    a = alloc.alloc(1024)
    b = alloc.alloc(1024)
    assert a is not None and b is not None and a != b
    alloc.free(a)
    used = alloc.used_bytes
    with pytest.raises(InvalidArgument):
        alloc.free(8192)  # outside
    with pytest.raises(InvalidArgument):
        alloc.free(b + 1)  # not a slot start
    with pytest.raises(InvalidArgument):
        alloc.free(4096)  # a free slab
    assert alloc.used_bytes == used == 1024
    c = alloc.alloc(1024)
    assert c == a  # the freed slot comes back
    assert c != b


def test_full_slab_returns_to_shared_pool() -> None:
    alloc = SlabAllocator(4096, 4096)
    offs = [alloc.alloc(1024) for _ in range(4)]
    assert None not in offs and alloc.alloc(1024) is None and alloc.alloc(2048) is None
    for off in offs:
        assert off is not None
        alloc.free(off)
    assert alloc.free_slabs() == 1 and alloc.used_bytes == 0
    assert alloc.alloc(2048) == 0


def test_lru_evicts_least_recently_used_first() -> None:
    lru = LRUPolicy()
    for key in (b"a", b"b", b"c", b"d"):
        lru.on_insert(key)
    lru.on_access(b"a")  # order now b, c, d, a
    lru.on_remove(b"c")  # order now b, d, a
    lru.on_access(b"zz")  # unknown keys are ignored
    assert len(lru) == 3
    assert lru.pop_victim(lambda k: True) == b"b"
    assert lru.pop_victim(lambda k: k != b"d") == b"a"  # d is protected: skipped, stays
    assert len(lru) == 1
    assert lru.pop_victim(lambda k: False) is None
    assert lru.pop_victim(lambda k: True) == b"d"
    assert lru.pop_victim(lambda k: True) is None


def test_lru_reinsert_moves_to_the_back() -> None:
    lru = LRUPolicy()
    for key in (b"a", b"b"):
        lru.on_insert(key)
    lru.on_insert(b"a")
    assert [lru.pop_victim(lambda k: True) for _ in range(2)] == [b"b", b"a"]


def test_make_policy() -> None:
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("s3fifo"), S3FIFOPolicy)
    with pytest.raises(InvalidArgument, match="lru"):
        make_policy("mru")


def test_s3fifo_never_returns_a_protected_key_and_terminates() -> None:
    policy = S3FIFOPolicy()
    keys = [bytes([i]) for i in range(20)]
    for key in keys:
        policy.on_insert(key)
    for key in keys[::3]:
        policy.on_access(key)
    protected = set(keys[:5])
    evicted = []
    while (victim := policy.pop_victim(lambda k: k not in protected)) is not None:
        evicted.append(victim)
    assert set(evicted) == set(keys) - protected and len(evicted) == len(set(evicted))
    assert len(policy) == 5
