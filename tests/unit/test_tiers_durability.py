"""Durability of the disk tier you can state (issue 11, item 5), at the store level:

- the write-behind queue's drops are counted exactly (the queue never blocks the host);
- a full disk is a ``DiskFull`` naming the path and the free space, not "check dmesg", and
  the tier (and the host tier above it) keeps serving;
- the shutdown flush writes every host-only block to disk, durably, and says what it could
  not write and why (deadline, by a fake clock, so the count is exact).

The daemon-level cases (SIGTERM / SIGKILL / a real full filesystem) are in
``tests/integration/test_tiers_durability_daemon.py``.
"""

from __future__ import annotations

import errno
import os
import pathlib

import numpy as np
import pytest
from test_tiers_store import BLOCK, NS, Harness, data, key

from kvpool.core.checksum import checksum64
from kvpool.storage import disk_full
from kvpool.storage.disk_tier import DiskFull, DiskTier
from kvpool.storage.shutdown_flush import flush_host_to_disk

SLAB = 1 << 20


def tier(path: pathlib.Path, **kw: object) -> DiskTier:
    return DiskTier(str(path), 4 * SLAB, SLAB, io_threads=2, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("queue_blocks", [1, 4, 17])
def test_write_behind_drops_are_counted_exactly(tmp_path: pathlib.Path, queue_blocks: int) -> None:
    t = tier(tmp_path, queue_blocks=queue_blocks, start_writer=False)
    try:
        taken = [t.enqueue(key(i), NS, data(i), checksum64(data(i))) for i in range(40)]
        assert taken == [True] * queue_blocks + [False] * (40 - queue_blocks)
        assert not t.enqueue(key(0), NS, data(0), checksum64(data(0)))  # already queued: not a drop
        assert t.stats.queue_full_drops == 40 - queue_blocks
        assert t.summary()["queue_full_drops"] == 40 - queue_blocks
    finally:
        t.close()


def test_store_demotion_accounting_is_exact_while_the_writer_is_held(tmp_path: pathlib.Path) -> None:
    """Every host eviction is either demoted (queued) or a counted drop, nothing in between;
    what was demoted is on disk after the flush."""
    h = Harness(tmp_path, write_behind_queue_blocks=8)
    disk = h.store.disk
    assert disk is not None
    try:
        with disk._writer._write_mutex:  # the writer can take one batch, then waits here
            h.put(list(range(300)))  # the host holds at most 128 of them
            s = h.store.summary()
            host, d = s["tiers"]["host"], s["tiers"]["disk"]
            assert host["evictions"] == 300 - s["blocks"] >= 172
            assert host["demotions"] + host["demotion_drops"] == host["evictions"]
            assert host["demotion_drops"] == d["queue_full_drops"] > 0
        assert h.store.flush(30)
        assert len(disk) == h.store.summary()["tiers"]["host"]["demotions"]
    finally:
        h.store.close()


def fail_payload_writes(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    real = os.pwritev

    def pwritev(fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset and len(buffers[0]) >= BLOCK:  # payloads, not header pages
            raise OSError(code, os.strerror(code))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)


def test_enospc_on_a_data_write_is_disk_full_with_path_and_free_space(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC injected at the write call (the daemon test fills a real tmpfs)."""
    t = tier(tmp_path)
    try:
        fail_payload_writes(monkeypatch, errno.ENOSPC)
        assert t.write_now([(key(1), NS, data(1), checksum64(data(1)))]) == 0
        monkeypatch.undo()
        fault = t.summary()["faults"][-1]
        assert "disk full" in fault and str(tmp_path) in fault and "bytes free" in fault, fault
        assert "dmesg" not in fault and "free space on the filesystem" in fault
        assert t.stats.disk_full == 1 and t.stats.io_errors == 1
        assert t.write_now([(key(2), NS, data(2), checksum64(data(2)))]) == 1  # serving again
    finally:
        t.close()


def test_eio_with_room_left_stays_an_io_error(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = tier(tmp_path)
    try:
        fail_payload_writes(monkeypatch, errno.EIO)
        assert t.write_now([(key(1), NS, data(1), checksum64(data(1)))]) == 0
        fault = t.summary()["faults"][-1]
        assert "disk full" not in fault and "dmesg" in fault and t.stats.disk_full == 0
    finally:
        monkeypatch.undo()
        t.close()


def test_an_index_commit_failing_on_a_full_filesystem_is_disk_full(tmp_path: pathlib.Path) -> None:
    """LMDB reports a full filesystem as EIO: the free space decides (``disk_full.is_full``)."""
    eio = OSError(errno.EIO, "Input/output error")
    assert not disk_full.is_full(eio, tmp_path)  # this filesystem has room
    fault = disk_full.disk_fault(eio, tmp_path, "disk tier write failed", "dropped", otherwise_hint="dmesg")
    assert not isinstance(fault, DiskFull)
    enospc = OSError(errno.ENOSPC, "No space left on device")
    fault = disk_full.disk_fault(enospc, tmp_path, "disk tier write failed", "dropped", otherwise_hint="dmesg")
    assert isinstance(fault, DiskFull) and fault.code.name == "STORAGE_FAULT"


def test_shutdown_flush_writes_every_host_only_block_durably(tmp_path: pathlib.Path) -> None:
    h = Harness(tmp_path)
    try:
        h.put(list(range(100)))  # all in host, none evicted: nothing on disk yet
        assert h.store.flush() and h.store.disk is not None and len(h.store.disk) == 0
        report = h.store.shutdown_flush(10_000)
        assert report is not None
        assert (report.host_blocks, report.already_on_disk, report.flushed, report.lost) == (100, 0, 100, 0)
        again = h.store.shutdown_flush(10_000)  # idempotent: everything is on disk now
        assert again is not None and (again.already_on_disk, again.flushed) == (100, 0)
    finally:
        h.store.close()
    t = tier(tmp_path)  # what a restarted daemon finds
    try:
        got = t.read_many([key(i) for i in range(100)])
        assert all(b is not None and np.array_equal(b.data, data(i)) for i, b in enumerate(got))
    finally:
        t.close()


def test_shutdown_flush_deadline_counts_what_it_did_not_write(tmp_path: pathlib.Path) -> None:
    h = Harness(tmp_path)
    disk = h.store.disk
    assert disk is not None
    try:
        h.put(list(range(100)))
        ticks = iter([0.0, 0.0, 0.0] + [99.0] * 100)  # start, drain, first batch check; then late
        report = flush_host_to_disk(h.store.host, h.buffer, disk, 1_000, now_s=lambda: next(ticks), batch_blocks=64)
        # one batch of 64 (newest first) went before the deadline passed; 36 did not
        assert report.flushed == 64 and report.not_flushed == {"deadline": 36}
        assert {key(i) for i in range(36, 100)} == set(disk.keys())
    finally:
        h.store.close()


def test_shutdown_flush_reports_a_full_disk(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path)
    try:
        h.put(list(range(10)))
        fail_payload_writes(monkeypatch, errno.ENOSPC)
        report = h.store.shutdown_flush(10_000)
        assert report is not None and report.flushed == 0 and report.not_flushed == {"disk_full": 10}
        monkeypatch.undo()
        assert h.get(list(range(10))) == 10  # the host tier still has every block
    finally:
        h.store.close()
