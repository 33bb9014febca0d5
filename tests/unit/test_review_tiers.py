"""Regression tests for review findings on TieredStore (storage/tiered_store.py,
storage/device_tier.py): removals racing a device demotion or a disk promotion, and
device-only blocks seen through ``entry()`` / the data plane."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig, TierConfig
from kvpool.core.events import EventKind
from kvpool.storage.tiered_store import TieredStore

BLOCK = 8000
NS = bytes(range(16))
HOST = StoreConfig(capacity_bytes=1 << 20, slab_bytes=1 << 18)


def key(i: int) -> bytes:
    """A block key as the daemon builds it: namespace digest || hash."""
    return NS + i.to_bytes(16, "little")


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)


class Store:
    def __init__(self, tiers: TierConfig) -> None:
        self.buffer = np.zeros(HOST.capacity_bytes, np.uint8)
        self.events: list[tuple[EventKind, bytes, str]] = []
        self.store = TieredStore(self.buffer, HOST, tiers, FakeClock(), on_event=self._event, device_allow_cpu=True)

    def _event(self, kind: EventKind, keys: list[bytes], namespace: bytes, tier: str = "host", cause: str = "") -> None:
        self.events.extend((kind, k, tier) for k in keys)

    def put(self, ids: list[int]) -> None:
        grant = self.store.put_start(NS, [key(i) for i in ids], BLOCK)
        sums = []
        for index, offset in grant.slots:
            self.buffer[offset : offset + BLOCK] = data(ids[index])
            sums.append(checksum64(data(ids[index])))
        if grant.put_id:
            self.store.put_commit(grant.put_id, sums)

    def hit(self, ids: list[int]) -> int:
        grant = self.store.lease([key(i) for i in ids])
        if grant.lease_id:
            self.store.release(grant.lease_id)
        return len(grant.locations)


@pytest.fixture
def device_store() -> Iterator[Store]:
    # a device tier of one 256 KiB slab: 32 blocks of 8000 bytes (8 KiB slots)
    s = Store(TierConfig(device_capacity_bytes=1 << 18, device="cpu"))
    yield s
    s.store.close()


def test_remove_sticks_for_a_block_whose_device_demotion_is_pending(device_store: Store) -> None:
    s = device_store
    victim = 0
    s.put([victim])
    assert s.hit([victim]) == 1 and s.hit([victim]) == 1  # second hit copies it to the device tier
    assert s.store.tier_of(key(victim)) == "host" and s.store.device is not None
    assert s.store.device.contains(key(victim))
    # push the victim out of host (it stays on the node, in the device tier)
    s.put(list(range(1000, 1128)))
    s.put(list(range(2000, 2128)))
    assert s.store.tier_of(key(victim)) == "device"

    # Another thread removes the victim right after a device eviction queued its demotion
    # and before the lease that evicted it drains the queue (the lease releases the device
    # lock in between). Reproduced deterministically by running remove() at that point.
    removed: list[int] = []
    original = s.store._drain_device_demotions

    def remove_then_drain() -> None:
        pending = s.store.records.queued_keys()
        if key(victim) in pending and not removed:
            removed.append(s.store.remove([key(victim)]))
        original()

    s.store._drain_device_demotions = remove_then_drain  # type: ignore[method-assign]
    hot = list(range(3000, 3040))  # 40 hot blocks overflow the 32-block device tier
    for start in range(0, len(hot), 8):
        batch = hot[start : start + 8]
        s.put(batch)
        s.hit(batch)
        s.hit(batch)
    assert removed, "the victim was never evicted from the device tier (test setup)"
    assert s.store.lookup([key(victim)]) == 0, "a removed block came back"
    assert removed[0] == 1, "remove() must count the block it dropped"


@pytest.fixture
def disk_store(tmp_path) -> Iterator[Store]:  # type: ignore[no-untyped-def]
    s = Store(
        TierConfig(
            disk_dir=str(tmp_path),
            disk_capacity_bytes=8 << 20,
            disk_slab_file_bytes=1 << 20,
            disk_io_threads=2,
        )
    )
    yield s
    s.store.close()


def test_remove_during_promotion_from_disk_sticks(disk_store: Store) -> None:
    s = disk_store
    victim = 0
    s.put([victim])
    s.put(list(range(1000, 1128)))  # host holds 128 blocks: the victim is demoted to disk
    assert s.store.flush()
    assert s.store.tier_of(key(victim)) == "disk"
    assert s.store.disk is not None

    # A second thread removes the victim after the lease has read (and verified) it from
    # disk, before it commits the copy into host: run remove() at exactly that point.
    removed: list[int] = []
    original = s.store.disk.read_many

    def read_then_remove(keys):  # type: ignore[no-untyped-def]
        got = original(keys)
        if key(victim) in keys and not removed:
            removed.append(s.store.remove([key(victim)]))
        return got

    s.store.disk.read_many = read_then_remove  # type: ignore[method-assign]
    s.hit([victim])  # serving it is fine (the lease may order before the remove) ...
    assert removed == [1]
    assert (EventKind.REMOVED, key(victim), "host") in s.events
    # ... but once both calls returned, the block must be gone and the last event say so
    assert s.store.lookup([key(victim)]) == 0, "a removed block came back"
    last = [kind for kind, k, _ in s.events if k == key(victim)][-1]
    assert last is EventKind.REMOVED, "subscribers were told the removed block is stored again"


def test_entry_of_a_device_only_block(device_store: Store) -> None:
    s = device_store
    victim = 0
    s.put([victim])
    assert s.hit([victim]) == 1 and s.hit([victim]) == 1  # now copied to the device tier
    s.put(list(range(1000, 1128)))
    s.put(list(range(2000, 2128)))  # and evicted from host
    assert s.store.tier_of(key(victim)) == "device"
    assert s.store.lookup([key(victim)]) == 1
    assert (EventKind.STORED, key(victim), "device") in s.events
    # the detached entry: no arena slot, but namespace, size and checksum of the HBM copy
    entry = s.store.entry(key(victim))
    assert entry is not None, "lookup() counts the block but entry() does not know it"
    assert entry.offset == -1 and entry.namespace == NS and entry.size == BLOCK
    assert entry.checksum == checksum64(data(victim))
    assert s.store.entry(key(99999)) is None
    assert key(victim) in s.store.snapshot_keys(), "snapshots must list what the events announced"
    # the data plane's view of the node (what a remote peer's READ goes through): the lease
    # promotes the block from HBM (verified) into host and serves the right bytes
    from types import SimpleNamespace

    from kvpool.daemon.cluster_node import NodeBlockStore

    assert s.store.device is not None
    device_hits = s.store.device.stats.hits
    remote = NodeBlockStore(SimpleNamespace(store=s.store, count_read=lambda *_: None))  # type: ignore[arg-type]
    block_hash = key(victim)[16:]
    assert remote.lease(bytes(16), [block_hash]).locations == [], "another namespace must not read it"
    leased = remote.lease(NS, [block_hash])
    assert len(leased.locations) == 1, "a remote read of a block the node advertises is a miss"
    offset, size, checksum = leased.locations[0]
    assert size == BLOCK and checksum == checksum64(data(victim))
    assert np.array_equal(s.buffer[offset : offset + size], data(victim))
    assert s.store.device.stats.hits == device_hits + 1, "the bytes came from the device tier"
    assert leased.lease_id
    s.store.release(leased.lease_id)
    assert s.store.tier_of(key(victim)) == "host"


def _leave_only_in_device(s: Store, victim: int) -> None:
    s.put([victim])
    assert s.hit([victim]) == 1 and s.hit([victim]) == 1  # second hit copies it to the device
    s.put(list(range(1000, 1128)))
    s.put(list(range(2000, 2128)))  # and it leaves host
    assert s.store.tier_of(key(victim)) == "device"


def _cycle_device(s: Store) -> None:
    """40 hot blocks overflow the 32-block device tier: its evictions demote through
    ``_drain_device_demotions``."""
    hot = list(range(3000, 3040))
    for start in range(0, len(hot), 8):
        batch = hot[start : start + 8]
        s.put(batch)
        s.hit(batch)
        s.hit(batch)


@pytest.mark.parametrize("hook", ["put_start", "put_commit"])
def test_remove_while_the_drain_moves_the_block_into_host(device_store: Store, hook: str) -> None:
    """The drain has taken the victim off the demotion queue and is putting it into host
    (before the commit check, or between the check and the commit): remove() counts it,
    and the drain either does not commit or removes it again, so REMOVED is last."""
    s = device_store
    victim = 0
    removed: list[int] = []
    host = s.store.host
    original = getattr(host, hook)
    keys_of_put: dict[int, list[bytes]] = {}
    start = host.put_start

    def tracking_start(namespace, keys, block_bytes):  # type: ignore[no-untyped-def]
        grant = start(namespace, keys, block_bytes)
        keys_of_put[grant.put_id] = list(keys)
        if hook == "put_start" and list(keys) == [key(victim)] and not removed:
            removed.append(s.store.remove([key(victim)]))
        return grant

    def racing_commit(put_id, checksums, verify_one_in=1):  # type: ignore[no-untyped-def]
        if keys_of_put.get(put_id) == [key(victim)] and not removed:
            removed.append(s.store.remove([key(victim)]))
        return original(put_id, checksums, verify_one_in)

    _leave_only_in_device(s, victim)
    host.put_start = tracking_start  # type: ignore[method-assign]
    if hook == "put_commit":
        host.put_commit = racing_commit  # type: ignore[method-assign]
    _cycle_device(s)
    assert removed == [1], "remove() must count the block the drain holds"
    assert s.store.lookup([key(victim)]) == 0 and s.store.tier_of(key(victim)) == ""
    last = [kind for kind, k, _ in s.events if k == key(victim)][-1]
    assert last is EventKind.REMOVED
    assert not s.store.records.busy_keys() and s.store.records.get(key(victim)) is None


def test_remove_between_the_check_and_the_commit_of_a_promotion(disk_store: Store) -> None:
    """A remove() that lands after the promotion's last check, right before its commit: the
    promotion removes the block again after committing, so it is gone and REMOVED is last."""
    s = disk_store
    victim = 0
    s.put([victim])
    s.put(list(range(1000, 1128)))
    assert s.store.flush() and s.store.tier_of(key(victim)) == "disk"
    removed: list[int] = []
    original = s.store.host.put_commit

    def remove_then_commit(put_id, checksums, verify_one_in=1):  # type: ignore[no-untyped-def]
        if not removed:
            removed.append(s.store.remove([key(victim)]))
        return original(put_id, checksums, verify_one_in)

    s.store.host.put_commit = remove_then_commit  # type: ignore[method-assign]
    s.hit([victim])
    assert removed == [1]
    assert s.store.lookup([key(victim)]) == 0 and s.store.tier_of(key(victim)) == ""
    kinds = [(kind, tier) for kind, k, tier in s.events if k == key(victim)]
    assert kinds[-2:] == [(EventKind.STORED, "host"), (EventKind.REMOVED, "host")], kinds
    assert not s.store.records.busy_keys() and s.store.records.get(key(victim)) is None
