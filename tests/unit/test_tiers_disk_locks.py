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


def test_close_joins_background_recovery_before_closing_the_index(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recovery sets ``recovered`` and only then deletes the entries it dropped: ``close``
    must wait for that too (the thread, not the event), or it deletes from a closed index."""
    import kvpool.storage.disk_tier as disk_tier

    t = tier(tmp_path)
    write(t, list(range(6)))
    t.close()
    real_recover, real_delete = disk_tier.recover, DiskTier._delete
    monkeypatch.setattr(disk_tier, "recover", lambda st, db, files: [*real_recover(st, db, files), key(3)])
    entered, release = threading.Event(), threading.Event()
    closed_at_delete: list[bool] = []

    def delete(self: DiskTier, keys: list[bytes]) -> object:
        if threading.current_thread().name == "kvpool-disk-recovery":
            entered.set()
            release.wait(10)
            closed_at_delete.append(self._st.closed)
        return real_delete(self, keys)

    monkeypatch.setattr(DiskTier, "_delete", delete)
    t2 = tier(tmp_path, background_recovery=True)
    assert entered.wait(10) and t2.wait_recovered(10)
    closer = threading.Thread(target=t2.close)
    closer.start()
    closer.join(0.5)  # (a close that does not wait gets this long to run ahead)
    release.set()
    closer.join(30)
    assert not closer.is_alive()
    assert closed_at_delete == [False]
    assert "kvpool-disk-recovery" not in {th.name for th in threading.enumerate()}


def test_close_with_a_writer_stuck_in_a_write_leaves_its_files_open(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A disk stuck in a write outlasts close's wait: close returns (bounded), says so, and
    leaves the slab files and the index open under the writer, so its late write cannot land
    in a descriptor the process reused; released, the writer finishes and the block is indexed."""
    t = tier(tmp_path)
    entered, release = threading.Event(), threading.Event()
    real = os.pwritev

    def stuck(fd: int, buffers: list[memoryview], offset: int) -> int:
        if threading.current_thread().name != "MainThread":
            entered.set()
            release.wait(30)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", stuck)
    assert t.enqueue(key(1), b"ns", data(1), checksum64(data(1)))
    assert entered.wait(10)
    queued = [i for i in range(2, 200) if t.enqueue(key(i), b"ns", data(i), checksum64(data(i)))]
    assert len(queued) < 198  # the queue filled up behind the stuck write: no room for the stop marker
    open_fds = dict(t._files.fds)
    assert open_fds
    t.close(flush_timeout_s=0.2)
    assert "the writer is still inside a write" in caplog.text
    assert t._files.fds == open_fds and all(os.fstat(fd) for fd in open_fds.values())
    release.set()
    t._writer._thread.join(30)  # type: ignore[union-attr]
    assert not t._writer._thread.is_alive()  # type: ignore[union-attr]  # it ends though its marker never fit
    assert key(1) in t._st.index
    t._files.close()
    t._db.close()


def test_close_joins_an_idle_writer_and_closes_its_files(tmp_path: pathlib.Path) -> None:
    t = tier(tmp_path)
    assert t.enqueue(key(2), b"ns", data(2), checksum64(data(2)))
    t.close()
    assert t._files.fds == {} and not t._writer._thread.is_alive()  # type: ignore[union-attr]
