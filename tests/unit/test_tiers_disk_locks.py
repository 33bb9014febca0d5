"""No I/O under the disk tier's state lock (issue 16): the host tier calls ``present`` and
``enqueue`` while it holds its own lock, so a slow disk must never be waited for there.
Each test wraps the I/O call and records whether the calling thread held the state lock."""

from __future__ import annotations

import os
import pathlib
import threading

import pytest
from test_tiers_disk import BLOCK, SLAB, data, key, tier, write

from kvpool.core.checksum import checksum64
from kvpool.storage.disk_index import DiskIndexDB
from kvpool.storage.disk_tier import DiskTier, file_layout, slot_bytes_for


def test_slab_files_are_preallocated_outside_the_state_lock(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = tier(tmp_path, capacity=4 * SLAB)
    held: list[bool] = []
    real = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        held.append(t._lock._is_owned())  # type: ignore[attr-defined]
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    try:
        per_file = file_layout(SLAB, slot_bytes_for(BLOCK))[0]
        assert write(t, list(range(2 * per_file + 1))) == 2 * per_file + 1  # synchronous path: 3 files
        ids = list(range(2 * per_file + 1, 3 * per_file + 2))  # and through the writer thread: a 4th
        for start in range(0, len(ids), 32):  # the queue holds 64
            for i in ids[start : start + 32]:
                assert t.enqueue(key(i), b"ns", data(i), checksum64(data(i)))
            assert t.flush(30)
        assert len(held) == 4 and not any(held), held
        assert len(t) == 3 * per_file + 2
    finally:
        t.close()


def test_present_during_background_recovery_reads_lmdb_outside_the_lock(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = tier(tmp_path)
    write(t, list(range(10)))
    t.close()
    gate = threading.Event()
    real_recover = DiskTier._recover

    def gated(self: DiskTier) -> None:
        gate.wait(10)
        real_recover(self)

    monkeypatch.setattr(DiskTier, "_recover", gated)
    t2 = tier(tmp_path, background_recovery=True)
    held: list[bool] = []
    real_get = DiskIndexDB.get

    def get(db: DiskIndexDB, txn: object, k: bytes) -> object:
        held.append(t2._lock._is_owned())  # type: ignore[attr-defined]
        return real_get(db, txn, k)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskIndexDB, "get", get)
    try:
        assert t2.recovering
        assert t2.present([key(1), key(2), key(42)]) == [True, True, False]
        assert t2.remove([key(2)]) == [key(2)]
        assert t2.present([key(1), key(2)]) == [True, False]  # a removal during the load sticks
        # present's LMDB reads (3, then 2) ran without the lock; held[3] is remove's (not on
        # the host's path; docs/tiers.md "Limits")
        assert len(held) == 6 and not any(held[:3] + held[4:]), held
        gate.set()
        assert t2.wait_recovered(10)
        assert t2.present([key(1), key(2)]) == [True, False]
    finally:
        gate.set()
        t2.close()
