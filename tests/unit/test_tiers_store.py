"""TieredStore: demotion, promotion, admission, events, faults, device tier on cpu."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import DaemonConfig, StoreConfig, TierConfig
from kvpool.core.events import EventKind
from kvpool.storage.host_store import HostStore
from kvpool.storage.node_store import build_node_store
from kvpool.storage.tiered_store import TieredStore

BLOCK = 8000
NS = bytes(range(16))
HOST = StoreConfig(capacity_bytes=1 << 20, slab_bytes=1 << 18)  # 4 slabs of 32 slots: 128 blocks


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)


class Harness:
    def __init__(self, disk_dir: pathlib.Path | None, **tier_kw: object) -> None:
        self.buffer = np.zeros(HOST.capacity_bytes, np.uint8)
        self.events: list[tuple[EventKind, list[bytes]]] = []
        self.tiers: list[tuple[EventKind, bytes, str]] = []  # (kind, key, tier) per key, in order
        tiers = TierConfig(
            disk_dir=str(disk_dir) if disk_dir else "",
            disk_capacity_bytes=8 << 20,
            disk_slab_file_bytes=1 << 20,
            disk_io_threads=2,
            **tier_kw,  # type: ignore[arg-type]
        )
        self.store = TieredStore(self.buffer, HOST, tiers, FakeClock(), on_event=self._event, device_allow_cpu=True)

    def _event(self, kind: EventKind, keys: list[bytes], namespace: bytes, tier: str = "host", cause: str = "") -> None:
        self.events.append((kind, list(keys)))
        self.tiers.extend((kind, k, tier) for k in keys)

    def put(self, ids: list[int]) -> None:
        for start in range(0, len(ids), 16):
            self._put(ids[start : start + 16])

    def _put(self, ids: list[int]) -> None:
        grant = self.store.put_start(NS, [key(i) for i in ids], BLOCK)
        sums = []
        for index, offset in grant.slots:
            self.buffer[offset : offset + BLOCK] = data(ids[index])
            sums.append(checksum64(data(ids[index])))
        if grant.put_id:
            assert self.store.put_commit(grant.put_id, sums).committed == len(sums)

    def get(self, ids: list[int]) -> int:
        """Lease, verify every served block's bytes, release; returns blocks served."""
        grant = self.store.lease([key(i) for i in ids])
        for i, loc in zip(ids, grant.locations):
            np.testing.assert_array_equal(self.buffer[loc.offset : loc.offset + loc.size], data(i))
        if grant.lease_id:
            self.store.release(grant.lease_id)
        return len(grant.locations)

    def removed(self) -> set[bytes]:
        return {k for kind, keys in self.events if kind is EventKind.REMOVED for k in keys}


def test_host_evictions_demote_to_disk_and_hits_promote_back(tmp_path: pathlib.Path) -> None:
    h = Harness(tmp_path)
    try:
        h.put(list(range(400)))
        assert h.store.flush()
        s = h.store.summary()
        assert s["tiers"]["host"]["demotions"] > 250
        assert s["tiers"]["disk"]["blocks"] == s["tiers"]["host"]["demotions"]
        assert h.store.host.entry(key(0)) is None and h.store.lookup([key(0), key(1)]) == 2
        assert h.get([0, 1, 2, 3]) == 4  # promoted disk -> host, bytes verified in get()
        s = h.store.summary()
        assert s["tiers"]["host"]["promotions"] == 4
        assert s["tiers"]["disk"]["hits"] == 4 and s["tiers"]["disk"]["bytes_out"] == 4 * BLOCK
        assert s["hits"] == 4 and s["misses"] == 0
        assert h.store.host.entry(key(0)) is not None
        assert h.removed() == set()  # nothing left the node, so no REMOVED event
        stored = [(k, tier) for kind, k, tier in h.tiers if kind is EventKind.STORED]
        demoted = s["tiers"]["host"]["demotions"]
        assert [t for k, t in stored].count("disk") == demoted  # each demotion: STORED on "disk"
        assert [t for k, t in stored].count("host") == 400 + 4  # the puts, then the 4 promotions
        assert stored[-4:] == [(key(i), "host") for i in range(4)]  # promoted back: STORED on "host"
    finally:
        h.store.close()


def test_blocks_on_disk_are_reported_present_to_writers(tmp_path: pathlib.Path) -> None:
    h = Harness(tmp_path)
    try:
        h.put(list(range(300)))
        h.store.flush()
        grant = h.store.put_start(NS, [key(0), key(10_000), key(299)], BLOCK)
        assert grant.already_present == [0, 2]
        assert [i for i, _ in grant.slots] == [1]
        h.store.put_abort(grant.put_id)
    finally:
        h.store.close()


def test_restart_serves_blocks_from_disk(tmp_path: pathlib.Path) -> None:
    h = Harness(tmp_path)
    h.put(list(range(300)))
    h.store.flush()
    on_disk = [i for i in range(300) if h.store.disk is not None and key(i) in h.store.disk._index]
    h.store.close()
    h2 = Harness(tmp_path)
    try:
        assert h2.store.disk is not None and h2.store.disk.wait_recovered(30)
        assert h2.store.summary()["tiers"]["disk"]["recovered_blocks"] == len(on_disk)
        for i in on_disk[:50]:
            assert h2.get([i]) == 1
        entry = h2.store.entry(key(on_disk[-1]))
        assert entry is not None and entry.offset == -1 and entry.namespace == NS
        assert set(h2.store.snapshot_keys()) >= {key(i) for i in on_disk}
    finally:
        h2.store.close()


def test_remove_reaches_every_tier_and_says_so(tmp_path: pathlib.Path) -> None:
    h = Harness(tmp_path)
    try:
        h.put(list(range(300)))
        h.store.flush()
        assert h.store.remove([key(0), key(299), key(12345)]) == 2
        assert h.store.lookup([key(0)]) == 0 and h.store.lookup([key(299)]) == 0
        assert {key(0), key(299)} <= h.removed()
    finally:
        h.store.close()


def test_pinning_a_demoted_block_promotes_it_back_to_host(tmp_path: pathlib.Path) -> None:
    h = Harness(tmp_path)
    try:
        h.put(list(range(300)))
        h.store.flush()
        assert h.store.host.entry(key(0)) is None and h.store.lookup([key(0)]) == 1
        assert h.store.pin([key(0), key(1), key(99_999)], None) == 2
        for i in (0, 1):
            entry = h.store.host.entry(key(i))
            assert entry is not None and entry.hard_pin
            np.testing.assert_array_equal(h.buffer[entry.offset : entry.offset + BLOCK], data(i))
        h.put(list(range(1000, 1300)))  # churn: the pinned blocks stay in host
        assert h.store.host.entry(key(0)) is not None and h.store.host.entry(key(1)) is not None
    finally:
        h.store.close()


def test_second_hit_admission_keeps_one_hit_blocks_off_disk(tmp_path: pathlib.Path) -> None:
    h = Harness(tmp_path, disk_admission="second-hit")
    try:
        h.put(list(range(60)))
        assert h.get(list(range(30))) == 30  # blocks 0..29 get a read hit on host
        h.put(list(range(1000, 1300)))  # pushes the first 60 out of host
        h.store.flush()
        disk = h.store.disk
        assert disk is not None
        assert all(disk.contains(key(i)) for i in range(30))
        assert not any(disk.contains(key(i)) for i in range(30, 60))
        assert h.store.summary()["tiers"]["host"]["admission_skips"] >= 30
        assert {key(i) for i in range(30, 60)} <= h.removed()  # they left the node
    finally:
        h.store.close()


def test_unusable_disk_dir_keeps_serving_from_host(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"x")
    h = Harness(blocker)
    h.put(list(range(10)))
    assert h.get(list(range(10))) == 10
    tiers = h.store.summary()["tiers"]
    assert tiers["disk"]["enabled"] is False and "--disk-dir" in tiers["disk"]["fault"]
    h.store.close()


def test_corrupt_block_on_disk_is_a_miss_not_wrong_bytes(tmp_path: pathlib.Path) -> None:
    h = Harness(tmp_path)
    try:
        h.put(list(range(300)))
        h.store.flush()
        disk = h.store.disk
        assert disk is not None
        entry = disk._index[key(5)]
        fd = disk._fds[entry.file]
        with open(disk._file_path(entry.file), "r+b") as fh:
            fh.seek(entry.offset + 500)
            fh.write(b"\x00\x01\x02\x03")
        del fd
        assert h.get([4, 5, 6]) == 1  # 4 promoted; 5 fails its checksum: the prefix stops
        s = h.store.summary()
        assert s["tiers"]["disk"]["checksum_failures"] == 1
        assert h.store.lookup([key(5)]) == 0
        assert key(5) in h.removed()
    finally:
        h.store.close()


def test_corrupt_disk_block_heals_on_the_next_put_and_is_counted_node_wide(tmp_path: pathlib.Path) -> None:
    h = Harness(tmp_path)
    try:
        h.put(list(range(300)))
        assert h.store.flush()
        disk = h.store.disk
        assert disk is not None and h.store.tier_of(key(5)) == "disk"
        assert h.store.lookup_by_tier([key(4), key(5), key(6)]) == {"host": 0, "disk": 3}
        entry = disk._index[key(5)]
        with open(disk._file_path(entry.file), "r+b") as fh:
            fh.seek(entry.offset + 123)
            fh.write(b"\xff\x00\xff")
        assert h.get([5]) == 0  # the promotion's read fails the check: a miss, never wrong bytes
        s = h.store.summary()
        assert s["checksum_failures"] == 1 and s["tiers"]["disk"]["checksum_failures"] == 1
        assert h.store.lookup([key(5)]) == 0 and key(5) in h.removed()
        grant = h.store.put_start(NS, [key(5)], BLOCK)  # the engine's re-put: fresh bytes, not already_present
        assert grant.already_present == [] and len(grant.slots) == 1
        h.buffer[grant.slots[0][1] : grant.slots[0][1] + BLOCK] = data(5)
        assert h.store.put_commit(grant.put_id, [checksum64(data(5))]).committed == 1
        assert h.get([5]) == 1  # verified against data(5) by the harness
    finally:
        h.store.close()


def test_reported_host_block_is_reverified_and_dropped_from_every_tier(tmp_path: pathlib.Path) -> None:
    h = Harness(tmp_path)
    try:
        h.put([1, 2, 3])
        assert h.store.drop_corrupt([key(1), key(2), key(3)]) == []  # all verify: a report drops nothing
        entry = h.store.entry(key(2))
        assert entry is not None and entry.offset >= 0
        h.buffer[entry.offset + 10] ^= 0x20
        assert h.store.drop_corrupt([key(1), key(2), key(9)]) == [key(2)]
        assert h.store.lookup([key(1), key(2)]) == 1 and h.store.tier_of(key(2)) == ""
        assert h.removed() == {key(2)}
        s = h.store.summary()
        assert s["checksum_failures"] == 1 and s["tiers"]["host"]["checksum_failures"] == 1
        assert h.get([1, 2, 3]) == 1
    finally:
        h.store.close()


def test_summary_keeps_host_keys_and_adds_tiers(tmp_path: pathlib.Path) -> None:
    plain = HostStore(np.zeros(HOST.capacity_bytes, np.uint8), HOST, FakeClock())
    h = Harness(tmp_path)
    try:
        s = h.store.summary()
        assert set(plain.summary()) <= set(s)
        for tier in ("host", "disk"):
            for field in ("hits", "misses", "bytes_in", "bytes_out", "evictions", "checksum_failures"):
                assert field in s["tiers"][tier]
        assert {"promotions", "demotions"} <= set(s["tiers"]["host"])
    finally:
        h.store.close()


def test_build_node_store_picks_the_store_by_config(tmp_path: pathlib.Path) -> None:
    buffer = np.zeros(HOST.capacity_bytes, np.uint8)
    plain = build_node_store(DaemonConfig(store=HOST), buffer, FakeClock(), None)
    assert isinstance(plain, HostStore)
    tiered = build_node_store(
        DaemonConfig(store=HOST, tiers=TierConfig(disk_dir=str(tmp_path), disk_capacity_bytes=1 << 22,
                                                  disk_slab_file_bytes=1 << 20)),
        buffer, FakeClock(), None,
    )  # fmt: skip
    try:
        assert isinstance(tiered, TieredStore) and tiered.disk is not None
    finally:
        tiered.close()


def test_device_tier_on_cpu_takes_hot_blocks_and_demotes_back(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("torch")
    # one slab: 32 blocks; watermarks 1.0 = evict only when full (tests/unit/test_tiers_watermarks.py)
    h = Harness(None, device_capacity_bytes=1 << 18, device="cpu", device_high_watermark=1.0, device_low_watermark=1.0)
    device = h.store.device
    assert device is not None
    h.put(list(range(40)))
    for _ in range(2):
        assert h.get(list(range(40))) == 40
    assert len(device) == 32 and device.stats.evictions == 8
    # a block only the device holds comes back through promotion, bytes verified
    h.store.host.remove([key(39)])
    assert device.contains(key(39))
    assert h.get([39]) == 1
    assert h.store.summary()["tiers"]["device"]["hits"] >= 1


def test_a_corrupt_device_only_block_is_a_miss_counted_and_removed(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("torch")
    h = Harness(None, device_capacity_bytes=1 << 18, device="cpu", device_high_watermark=1.0, device_low_watermark=1.0)
    device = h.store.device
    assert device is not None
    h.put([1, 2])
    for _ in range(2):
        assert h.get([1, 2]) == 2  # second hit: copied to the device tier
    h.store.host.remove([key(2)])
    assert h.store.tier_of(key(2)) == "device" and h.store.lookup_by_tier([key(1), key(2)]) == {"host": 1, "device": 1}
    offset = device._index[key(2)].offset
    device.arena[offset + 9] = int(device.arena[offset + 9]) ^ 0x11
    h.events.clear()
    assert h.get([2]) == 0
    assert h.store.lookup([key(2)]) == 0 and h.removed() == {key(2)}
    s = h.store.summary()
    assert s["tiers"]["device"]["checksum_failures"] == 1 and s["checksum_failures"] == 1


def test_device_tier_on_cpu_needs_the_test_switch() -> None:
    pytest.importorskip("torch")
    buffer = np.zeros(HOST.capacity_bytes, np.uint8)
    store = TieredStore(buffer, HOST, TierConfig(device_capacity_bytes=1 << 18, device="cpu"), FakeClock())
    assert store.device is None and "only for tests" in store.summary()["tiers"]["device"]["fault"]


def test_tier_of_names_the_fastest_tier_holding_a_block(tmp_path: pathlib.Path) -> None:
    """The cluster agent reports each block's tier to the directory from tier_of at registration."""
    h = Harness(tmp_path)
    try:
        h.put(list(range(400)))
        assert h.store.flush()
        assert h.store.host.entry(key(0)) is None and h.store.tier_of(key(0)) == "disk"
        assert h.store.tier_of(key(399)) == "host"
        assert h.store.tier_of(key(10_000)) == ""
        h.get([0])  # promoted back
        assert h.store.tier_of(key(0)) == "host"
        assert h.store.host.tier_of(key(399)) == "host" and h.store.host.tier_of(key(10_000)) == ""
    finally:
        h.store.close()
