"""Disk and device tiers: once a write would cross the high watermark, each write evicts,
in policy order, its own room and as much again until usage is at the low watermark
(storage/watermarks.py); below high, drained, nothing is evicted; 1.0 / 1.0 keeps
evict-on-demand; bad watermarks refused."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from kvpool.core.checksum import checksum64
from kvpool.core.clock import FakeClock
from kvpool.core.config import StoreConfig, TierConfig
from kvpool.core.errors import InvalidArgument
from kvpool.storage.disk_tier import DiskTier, file_layout
from kvpool.storage.tiered_store import TieredStore

DISK_SLAB = 1 << 20
DISK_BLOCK = 64 << 10  # 64 KiB = one 64 KiB slot, 15 per 1 MiB slab file
DEVICE_BLOCK = 8 << 10  # 8 KiB slots, 32 per 256 KiB slab


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def data(i: int, size: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def disk(path: pathlib.Path, high: float, low: float, gone: list[bytes]) -> DiskTier:
    return DiskTier(
        str(path), 4 * DISK_SLAB, DISK_SLAB, io_threads=2, queue_blocks=64,
        start_writer=False, high_watermark=high, low_watermark=low, on_evict=gone.extend,
    )  # fmt: skip


def disk_write(t: DiskTier, i: int) -> None:
    block = data(i, DISK_BLOCK)
    assert t.write_now([(key(i), b"ns", block, checksum64(block))]) == 1


def test_disk_slot_layout_assumed_by_these_tests() -> None:
    assert file_layout(DISK_SLAB, DISK_BLOCK)[0] == 15  # 60 slots in 4 files: 3.75 MiB of 4 MiB


def test_disk_drains_to_low_a_bounded_share_per_write_once_a_write_crosses_high(tmp_path: pathlib.Path) -> None:
    gone: list[bytes] = []
    t = disk(tmp_path, high=0.5, low=0.25, gone=gone)  # high = 2 MiB = 32 slots, low = 1 MiB = 16
    try:
        for i in range(32):
            disk_write(t, i)
        assert t.stats.evictions == 0 and len(t) == 32 and t.used_bytes == 2 << 20  # exactly at high
        got = t.read_many([key(0)])  # a hit: block 0 becomes the most recently used
        assert got[0] is not None
        per_write = []
        i = 32
        while True:  # from the crossing on, each write evicts its room and as much again
            before = t.stats.evictions
            disk_write(t, i)
            per_write.append(t.stats.evictions - before)
            i += 1
            if t.used_bytes == 1 << 20:
                break
            assert len(per_write) < 32, "never drained down to low"
        assert per_write == [2] * 16  # no write paid for more than twice what it wrote
        assert gone == [key(k) for k in range(1, 32)] + [key(0)]  # LRU order: 0 was read, so last
        kept = {key(k) for k in range(32, 48)}
        assert set(t.keys()) == kept
        for k in range(48, 64):  # 16 more writes reach high again without evicting
            disk_write(t, k)
        assert t.stats.evictions == 32 and t.used_bytes == 2 << 20
        disk_write(t, 64)  # the next crossing starts the next drain
        assert t.stats.evictions == 34
        kept = set(t.keys())
        summary = t.summary()
        assert summary["high_watermark"] == 0.5 and summary["low_watermark"] == 0.25
    finally:
        t.close()
    # the evictions were durable: a restart finds exactly the blocks kept
    t2 = disk(tmp_path, high=0.5, low=0.25, gone=[])
    try:
        assert set(t2.keys()) == kept
    finally:
        t2.close()


def test_disk_never_evicts_a_block_being_read(tmp_path: pathlib.Path) -> None:
    gone: list[bytes] = []
    t = disk(tmp_path, high=0.5, low=0.25, gone=gone)
    try:
        for i in range(32):
            disk_write(t, i)
        with t._lock:  # a reader in flight on blocks 0..3 (what read_many holds while it reads)
            for i in range(4):
                t._index[key(i)].readers += 1
        for i in range(32, 48):  # the whole drain
            disk_write(t, i)
        assert t.stats.evictions == 32 and gone == [key(i) for i in range(4, 36)]
        with t._lock:
            for i in range(4):
                t._index[key(i)].readers -= 1
        assert all(b is not None for b in t.read_many([key(i) for i in range(4)]))
    finally:
        t.close()


def test_disk_at_one_evicts_only_when_no_slot_is_free(tmp_path: pathlib.Path) -> None:
    gone: list[bytes] = []
    t = disk(tmp_path, high=1.0, low=1.0, gone=gone)
    try:
        for i in range(60):  # every slot of the 4 files
            disk_write(t, i)
        assert t.stats.evictions == 0
        disk_write(t, 60)
        assert t.stats.evictions == 1 and gone == [key(0)]
    finally:
        t.close()


def device_store(high: float, low: float) -> TieredStore:
    pytest.importorskip("torch")
    host = StoreConfig(capacity_bytes=1 << 20, slab_bytes=1 << 18)
    tiers = TierConfig(
        device_capacity_bytes=1 << 20, device="cpu", device_high_watermark=high, device_low_watermark=low
    )  # 4 slabs of 32 slots of 8 KiB: 128 slots
    return TieredStore(np.zeros(host.capacity_bytes, np.uint8), host, tiers, FakeClock(), device_allow_cpu=True)


def device_put(store: TieredStore, i: int) -> None:
    assert store.device is not None
    block = data(i, DEVICE_BLOCK)
    assert store.device.put(key(i), b"ns", block, checksum64(block))


def test_device_drains_to_low_a_bounded_share_per_copy_once_a_copy_crosses_high() -> None:
    store = device_store(high=0.5, low=0.25)  # high = 64 slots, low = 32
    device = store.device
    assert device is not None
    try:
        assert device.summary()["high_watermark"] == 0.5
        for i in range(64):
            device_put(store, i)
        assert device.stats.evictions == 0 and device.used_bytes == 512 << 10
        assert device.get(key(0)) is not None  # most recently used now
        per_copy = []
        for i in range(64, 96):  # crosses high, then each copy evicts (demotes) two until low
            before = device.stats.evictions
            device_put(store, i)
            per_copy.append(device.stats.evictions - before)
        assert per_copy == [2] * 32 and device.stats.demotions == 64
        assert device.used_bytes == 256 << 10 and len(device) == 32
        assert not any(device.contains(key(i)) for i in range(64))  # 1..63, then 0: LRU order
        assert store.records.queued_keys() == [key(i) for i in range(1, 64)] + [key(0)]
        device_put(store, 96)  # below high, drained: nothing evicted
        assert device.stats.evictions == 64
        store._drain_device_demotions()  # no other tier held them: demoted into host, bytes intact
        for i in range(1, 34):
            entry = store.host.entry(key(i))
            assert entry is not None
            np.testing.assert_array_equal(
                store._buffer[entry.offset : entry.offset + entry.size], data(i, DEVICE_BLOCK)
            )
    finally:
        store.close()


def test_device_at_one_evicts_only_when_full() -> None:
    store = device_store(high=1.0, low=1.0)
    device = store.device
    assert device is not None
    try:
        for i in range(128):
            device_put(store, i)
        assert device.stats.evictions == 0
        device_put(store, 128)
        assert device.stats.evictions == 1 and not device.contains(key(0))
    finally:
        store.close()


@pytest.mark.parametrize(
    "kw",
    [
        {"disk_high_watermark": 0.5, "disk_low_watermark": 0.6},
        {"disk_low_watermark": 0.0},
        {"disk_high_watermark": 1.5},
        {"device_high_watermark": 0.7, "device_low_watermark": 0.8},
        {"device_low_watermark": -0.1},
    ],
)
def test_bad_tier_watermarks_are_invalid_argument(kw: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument, match="watermarks"):
        TierConfig(**kw)  # type: ignore[arg-type]


def test_tier_watermark_defaults() -> None:
    t = TierConfig()
    assert (t.disk_high_watermark, t.disk_low_watermark) == (0.95, 0.85)
    assert (t.device_high_watermark, t.device_low_watermark) == (0.95, 0.85)
