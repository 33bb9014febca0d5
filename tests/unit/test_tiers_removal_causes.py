"""A REMOVED event names the tier a block left and, where the store knows better than
"evicted", why: a disk payload that fails its checksum, a disk read that fails (I/O error),
an HBM copy that fails its checksum (device tier on CPU torch, standing in for a GPU), a
host block whose bytes rot before its demotion. ``kvpool inspect lookup`` records these
causes (tests/integration/test_inspect_lookup_reasons.py drives the disk case through a
real daemon); a plain disk eviction is REMOVED at tier "disk" with no cause."""

from __future__ import annotations

import os
import pathlib
import threading

import pytest
from test_tiers_store import Harness, key

from kvpool.core.events import EventKind

Removed = tuple[bytes, str, str]  # (key, tier, cause)


class CauseHarness(Harness):
    def __init__(self, disk_dir: pathlib.Path | None, **tier_kw: object) -> None:
        self.causes: list[Removed] = []
        super().__init__(disk_dir, **tier_kw)

    def _event(self, kind: EventKind, keys: list[bytes], namespace: bytes, tier: str = "host", cause: str = "") -> None:
        super()._event(kind, keys, namespace, tier, cause)
        if kind is EventKind.REMOVED:
            self.causes.extend((k, tier, cause) for k in keys)


def on_disk(h: Harness, ids: list[int]) -> None:
    h.put(ids)
    assert h.store.flush()
    assert h.store.tier_of(key(ids[0])) == "disk"


def test_a_disk_block_failing_its_checksum_is_removed_from_disk_as_a_checksum_failure(tmp_path: pathlib.Path) -> None:
    h = CauseHarness(tmp_path)
    try:
        on_disk(h, list(range(300)))
        disk = h.store.disk
        assert disk is not None
        entry = disk._index[key(5)]
        with open(disk._file_path(entry.file), "r+b") as fh:
            fh.seek(entry.offset + 77)
            fh.write(b"\x13\x37")
        h.causes.clear()
        assert h.get([5]) == 0
        assert h.causes == [(key(5), "disk", "checksum_failure")]
    finally:
        h.store.close()


def test_a_disk_read_that_fails_is_an_io_error(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = CauseHarness(tmp_path)
    try:
        on_disk(h, list(range(300)))

        def broken(fd: int, buffers: list[memoryview], offset: int) -> int:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "preadv", broken)
        h.causes.clear()
        assert h.get([6]) == 0
        assert h.causes == [(key(6), "disk", "io_error")]
    finally:
        monkeypatch.undo()
        h.store.close()


def test_a_disk_eviction_is_removed_from_disk_with_no_cause(tmp_path: pathlib.Path) -> None:
    h = CauseHarness(tmp_path)  # 8 MiB of disk: 1,000 blocks of 8,000 bytes cannot all stay
    try:
        h.put(list(range(1300)))
        assert h.store.flush()
        gone = [c for c in h.causes if c[1] == "disk"]
        assert gone and all(cause == "" for _, _, cause in gone)
        assert not [c for c in h.causes if c[2]]
    finally:
        h.store.close()


def test_an_hbm_copy_failing_its_checksum_is_a_checksum_failure_at_tier_device() -> None:
    pytest.importorskip("torch")  # the device tier on CPU torch: a mock of HBM (no GPU here)
    h = CauseHarness(
        None, device_capacity_bytes=1 << 18, device="cpu", device_high_watermark=1.0, device_low_watermark=1.0
    )
    device = h.store.device
    assert device is not None
    h.put([1, 2])
    for _ in range(2):
        assert h.get([1, 2]) == 2  # the second hit copies them to the device tier
    h.store.host.remove([key(2)])
    offset = device._index[key(2)].offset
    device.arena[offset + 9] = int(device.arena[offset + 9]) ^ 0x11
    h.causes.clear()
    assert h.get([2]) == 0
    assert h.causes == [(key(2), "device", "checksum_failure")]


def test_a_host_block_rotten_before_its_demotion_is_a_checksum_failure_at_tier_host(tmp_path: pathlib.Path) -> None:
    h = CauseHarness(tmp_path)
    try:
        h.put([0])
        entry = h.store.host.entry(key(0))
        assert entry is not None
        h.buffer[entry.offset + 3] ^= 0x5A  # rots in the arena; the next eviction finds it
        h.causes.clear()
        h.put(list(range(1, 200)))  # 128 host blocks: key 0 is evicted first
        assert (key(0), "host", "checksum_failure") in h.causes
        assert h.store.tier_of(key(0)) == ""  # not demoted
    finally:
        h.store.close()


def test_a_disk_drop_racing_a_put_of_the_same_block_never_ends_on_removed(tmp_path: pathlib.Path) -> None:
    """The disk drops block K (eviction or failure) while a client puts K into host: the
    REMOVED from disk and the put's STORED are ordered (the absence is checked and reported
    under the host lock), so the last event the directory sees for K says it is held.
    The put is started just before the REMOVED goes out, the worst moment, and gets half a
    second to commit there (it must not manage: it waits for the host lock)."""
    h = CauseHarness(tmp_path)
    racer: list[threading.Thread] = []
    real_emit = h.store._emit
    try:

        def put_first(kind: EventKind, keys: list[bytes], ns: bytes, tier: str = "host", cause: str = "") -> None:
            if kind is EventKind.REMOVED and tier == "disk" and not racer:
                racer.append(threading.Thread(target=h.put, args=([7],)))
                racer[0].start()
                racer[0].join(0.5)
            real_emit(kind, keys, ns, tier, cause)

        h.store._emit = put_first  # type: ignore[method-assign]
        h.store._on_lower_tier_dropped([key(7)])
        racer[0].join(10)
        assert not racer[0].is_alive()
        last = [(kind, tier) for kind, k, tier in h.tiers if k == key(7)][-1]
        assert last == (EventKind.STORED, "host") and h.store.host.entry(key(7)) is not None
    finally:
        h.store.close()
