"""A same-host put re-checked at commit in one block of N (``HostStore.put_commit``,
``--client-put-verify-one-in``): whatever blocks of a put are bad, a commit either finds
none of them (all were outside the sample: committed, and every reader's verification
drops them on first read) or reports exactly the bad ones (a sampled block failed, so the
whole put was checked); good blocks are never refused, and at least one block of every put
is checked. N = 1 checks every block."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig
from kvpool.core.errors import InvalidArgument
from kvpool.storage.host_store import HostStore

NS = b"\x02" * 16
BLOCK = 4096


def key(i: int) -> bytes:
    return NS + i.to_bytes(16, "little")


def fresh_store(blocks: int) -> tuple[HostStore, np.ndarray]:
    config = StoreConfig(capacity_bytes=-(-blocks // 16) * 16 * BLOCK + 16 * BLOCK, slab_bytes=16 * BLOCK)
    buffer = np.zeros(config.capacity_bytes, dtype=np.uint8)
    return HostStore(buffer, config, FakeClock()), buffer


def written_put(store: HostStore, buffer: np.ndarray, count: int, bad: set[int]) -> tuple[int, list[int]]:
    """Start a put of ``count`` blocks, write them, and return its id with the checksums a
    client would send: right for every block but those in ``bad``."""
    grant = store.put_start(NS, [key(i) for i in range(count)], BLOCK)
    sums = [0] * count
    for index, offset in grant.slots:
        buffer[offset : offset + BLOCK] = index % 251 + 1
        digest = checksum64(buffer[offset : offset + BLOCK])
        sums[index] = digest ^ 1 if index in bad else digest
    return grant.put_id, sums


@settings(max_examples=150, deadline=None)
@given(
    count=st.integers(min_value=1, max_value=48),
    one_in=st.integers(min_value=1, max_value=20),
    data=st.data(),
)
def test_a_sampled_commit_finds_no_bad_block_or_exactly_the_bad_ones(
    count: int, one_in: int, data: st.DataObject
) -> None:
    bad = data.draw(st.sets(st.integers(min_value=0, max_value=count - 1)))
    store, buffer = fresh_store(count)
    put_id, sums = written_put(store, buffer, count, bad)
    result = store.put_commit(put_id, sums, verify_one_in=one_in)
    failed = set(result.checksum_failed)
    assert failed in (set(), bad)  # never a good block refused, never part of the bad ones
    if one_in == 1 or len(bad) == count:  # every block checked, or every sample hits a bad one
        assert failed == bad
    assert result.committed == count - len(failed)
    sample = -(-count // one_in)  # blocks checked first: one in each group of N, at least one
    if one_in == 1:
        assert store.stats.commit_checked_blocks == count
    else:
        assert store.stats.commit_checked_blocks == sample + (count if failed else 0)
    kept = [key(i) for i in range(count) if i not in failed]
    assert store.lookup(kept) == len(kept)


def test_every_put_checks_at_least_one_block() -> None:
    store, buffer = fresh_store(4)
    for _ in range(20):  # a one-block put is always its own sample: a bad block never commits
        put_id, sums = written_put(store, buffer, 1, {0})
        assert store.put_commit(put_id, sums, verify_one_in=16).checksum_failed == [0]
    assert store.stats.commit_checked_blocks == 40  # the sample, then the whole put
    assert store.summary()["commit_checked_blocks"] == 40


def test_verify_one_in_below_one_is_refused_and_the_put_stays_pending() -> None:
    store, buffer = fresh_store(4)
    put_id, sums = written_put(store, buffer, 2, set())
    with pytest.raises(InvalidArgument):
        store.put_commit(put_id, sums, verify_one_in=0)
    assert store.put_commit(put_id, sums).committed == 2
