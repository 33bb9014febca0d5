"""A put's verification at commit runs outside the store lock (issue 13, item 5): while one
client's commit checksums its bytes, other clients' lookups, leases and commits go on, and
the committing put's keys stay "in flight" until its blocks are indexed."""

from __future__ import annotations

import threading

import numpy as np

import kvpool.storage.host_store as host_store_module
from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig
from kvpool.storage.host_store import HostStore

NS = b"\x01" * 16
BLOCK = 4096


def key(i: int) -> bytes:
    return NS + i.to_bytes(16, "little")


def test_lookups_and_puts_proceed_while_a_commit_verifies(monkeypatch: object) -> None:
    config = StoreConfig(capacity_bytes=64 * BLOCK, slab_bytes=16 * BLOCK)
    buffer = np.zeros(config.capacity_bytes, dtype=np.uint8)
    store = HostStore(buffer, config, FakeClock())

    def put(ids: list[int]) -> tuple[int, list[int]]:
        grant = store.put_start(NS, [key(i) for i in ids], BLOCK)
        sums = []
        for index, offset in grant.slots:
            buffer[offset : offset + BLOCK] = ids[index]
            sums.append(checksum64(buffer[offset : offset + BLOCK]))
        return grant.put_id, sums

    first_id, first_sums = put([1])
    assert store.put_commit(first_id, first_sums).committed == 1
    slow_id, slow_sums = put([2, 3])
    verifying, may_finish = threading.Event(), threading.Event()
    real = host_store_module.checksum_at

    def held_checksum(*args: object) -> list[int]:
        if threading.current_thread().name == "slow-commit":
            verifying.set()
            assert may_finish.wait(30)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(host_store_module, "checksum_at", held_checksum)  # type: ignore[attr-defined]
    results: list[int] = []
    slow = threading.Thread(
        target=lambda: results.append(store.put_commit(slow_id, slow_sums).committed), name="slow-commit"
    )
    slow.start()
    try:
        assert verifying.wait(30)
        # the lock is free: a lookup, a lease and another client's whole put all complete now
        assert store.lookup([key(1)]) == 1
        store.release(store.lease([key(1)]).lease_id)
        other_id, other_sums = put([4])
        assert store.put_commit(other_id, other_sums).committed == 1
        # the verifying put's blocks are not visible yet, and a second writer of them is told "in flight"
        assert store.lookup([key(2)]) == 0
        assert store.put_start(NS, [key(2)], BLOCK).in_flight == [0]
    finally:
        may_finish.set()
        slow.join(30)
    assert results == [2] and store.lookup([key(2), key(3)]) == 2
