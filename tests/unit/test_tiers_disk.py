"""Disk tier: round trip, restart recovery, corruption and torn writes, faults."""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.core.checksum import checksum64
from kvpool.core.errors import ErrorCode, StorageFault
from kvpool.storage import disk_tier
from kvpool.storage.disk_tier import DiskSlots, DiskTier, header_offset, slot_bytes_for

BLOCK = 5000
SLAB = 1 << 20


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def data(i: int, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


REPO = pathlib.Path(__file__).resolve().parents[2]


def tier(path: pathlib.Path, capacity: int = 4 * SLAB, **kw: object) -> DiskTier:
    return DiskTier(str(path), capacity, SLAB, io_threads=2, queue_blocks=64, **kw)  # type: ignore[arg-type]


def write(t: DiskTier, ids: list[int], ns: bytes = b"ns") -> int:
    return t.write_now([(key(i), ns, data(i), checksum64(data(i))) for i in ids])


def test_round_trip_and_restart_recovers_every_committed_block(tmp_path: pathlib.Path) -> None:
    t = tier(tmp_path)
    assert write(t, list(range(50))) == 50
    got = t.read_many([key(i) for i in range(50)])
    assert all(b is not None and np.array_equal(b.data, data(i)) for i, b in enumerate(got))
    t.close()
    t2 = tier(tmp_path)
    try:
        assert t2.stats.recovered_blocks == 50
        got = t2.read_many([key(i) for i in range(50)])
        assert all(b is not None and b.namespace.rstrip(b"\0") == b"ns" for b in got)
        assert all(b is not None and np.array_equal(b.data, data(i)) for i, b in enumerate(got))
        assert t2.summary()["checksum_failures"] == 0
    finally:
        t2.close()


def test_write_behind_queue_serves_reads_before_the_write_lands(tmp_path: pathlib.Path) -> None:
    t = tier(tmp_path, start_writer=False)
    try:
        assert t.enqueue(key(1), b"ns", data(1), checksum64(data(1)))
        assert not t.enqueue(key(1), b"ns", data(1), checksum64(data(1)))  # already queued
        assert t.contains(key(1))
        (block,) = t.read_many([key(1)])
        assert block is not None and np.array_equal(block.data, data(1))
        assert t.stats.queue_hits == 1
    finally:
        t.close(flush_timeout_s=0.1)


def test_full_queue_drops_instead_of_blocking(tmp_path: pathlib.Path) -> None:
    t = DiskTier(str(tmp_path), 4 * SLAB, SLAB, io_threads=1, queue_blocks=2, start_writer=False)
    try:
        taken = [t.enqueue(key(i), b"", data(i), checksum64(data(i))) for i in range(4)]
        assert taken == [True, True, False, False]
        assert t.stats.queue_full_drops == 2
    finally:
        t.close(flush_timeout_s=0.1)


def test_full_tier_evicts_by_policy_and_never_exceeds_capacity(tmp_path: pathlib.Path) -> None:
    evicted: list[bytes] = []
    t = DiskTier(str(tmp_path), 2 * SLAB, SLAB, io_threads=2, on_evict=evicted.extend)
    per_file = disk_tier.file_layout(SLAB, slot_bytes_for(BLOCK))[0]
    try:
        write(t, list(range(2 * per_file)))
        t.read_many([key(0)])  # touch 0: LRU keeps it
        write(t, [10_000, 10_001])
        assert t.used_bytes <= t.capacity_bytes
        assert evicted == [key(1), key(2)]
        assert t.contains(key(0)) and not t.contains(key(1))
        assert t.stats.evictions == 2
    finally:
        t.close()
    t2 = DiskTier(str(tmp_path), 2 * SLAB, SLAB)
    try:  # evictions are durable: the evicted keys do not come back
        assert not t2.contains(key(1)) and t2.contains(key(10_001))
    finally:
        t2.close()


def _slot_of(t: DiskTier, i: int) -> tuple[pathlib.Path, int]:
    entry = t._index[key(i)]
    return t._file_path(entry.file), entry.offset


@pytest.mark.parametrize("where", ["payload", "reused", "torn"])
def test_corrupted_block_is_dropped_counted_and_a_miss(tmp_path: pathlib.Path, where: str) -> None:
    t = tier(tmp_path)
    write(t, [1, 2, 3])
    path, offset = _slot_of(t, 2)
    t.close()
    with path.open("r+b") as fh:
        if where == "payload":
            fh.seek(offset + 777)
            byte = fh.read(1)
            fh.seek(offset + 777)
            fh.write(bytes([byte[0] ^ 0x40]))
        elif where == "reused":  # another block's bytes in the slot (reuse racing a crash)
            fh.seek(offset)
            fh.write(data(99).tobytes())
        else:  # a torn write: the second half of the slot never reached the disk
            fh.seek(offset + BLOCK // 2)
            fh.write(b"\0" * (BLOCK // 2))
    t2 = tier(tmp_path)
    try:
        got = t2.read_many([key(1), key(2), key(3)])
        assert got[0] is not None and np.array_equal(got[0].data, data(1))
        assert got[1] is None
        assert got[2] is not None and np.array_equal(got[2].data, data(3))
        assert t2.stats.checksum_failures == 1
        assert not t2.contains(key(2))
    finally:
        t2.close()
    t3 = tier(tmp_path)
    try:  # the drop is durable
        assert not t3.contains(key(2)) and t3.contains(key(3))
    finally:
        t3.close()


def test_other_hash_scheme_is_a_storage_fault_with_a_hint(tmp_path: pathlib.Path) -> None:
    tier(tmp_path).close()
    with pytest.raises(StorageFault) as info:
        tier(tmp_path, scheme="kvpool-h0")
    assert info.value.code is ErrorCode.VERSION_MISMATCH
    assert "empty --disk-dir" in info.value.hint


def test_other_slab_file_size_is_refused(tmp_path: pathlib.Path) -> None:
    tier(tmp_path).close()
    with pytest.raises(StorageFault, match="slab files"):
        DiskTier(str(tmp_path), 4 * SLAB, SLAB // 2)


@contextlib.contextmanager
def unwritable(folder: pathlib.Path) -> Iterator[None]:
    """``folder`` made unwritable for this process: by its mode bits, or, for root (which
    writes through mode bits: CI runs as root), by a read-only bind mount of it onto itself
    (``CantBindMount`` where root lacks CAP_SYS_ADMIN, as in most containers)."""
    if os.geteuid() != 0:
        folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
        try:
            yield
        finally:
            folder.chmod(stat.S_IRWXU)
        return
    bind = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True, text=True)
    if bind.returncode != 0:
        raise CantBindMount(bind.stderr.strip())
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True, capture_output=True)
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True, capture_output=True)


class CantBindMount(Exception):
    pass


# the same check run as an unprivileged user: what root without CAP_SYS_ADMIN does instead
AS_NOBODY = """
import sys
from kvpool.core.errors import StorageFault
from kvpool.storage.disk_tier import DiskTier
try:
    DiskTier(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
except StorageFault as exc:
    print(exc.message)
"""


def test_unwritable_directory_is_a_storage_fault(tmp_path: pathlib.Path) -> None:
    try:
        with unwritable(tmp_path), pytest.raises(StorageFault, match="not usable"):
            tier(tmp_path / "d")
    except CantBindMount:
        check_as_nobody()  # root without CAP_SYS_ADMIN (a container): drop privileges instead


def test_an_unwritable_directory_as_an_unprivileged_user(tmp_path: pathlib.Path) -> None:
    """The fallback above, run wherever it can be (root with setpriv), so it is known to work."""
    if os.geteuid() != 0:
        pytest.skip("not root: the mode bits already make a folder unwritable (the test above)")
    check_as_nobody()


def check_as_nobody() -> None:
    """As user nobody (``setpriv``), a disk tier under a root-owned read-only folder is refused."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root without CAP_SYS_ADMIN and without setpriv: no way to make a folder unwritable")
    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-unwritable-", dir="/tmp"))
    try:
        folder.chmod(0o555)
        nobody = ["--reuid=65534", "--regid=65534", "--clear-groups"]
        argv = [setpriv, *nobody, sys.executable, "-c", AS_NOBODY, str(folder / "d"), str(4 * SLAB), str(SLAB)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert "is not usable" in done.stdout, done.stdout + done.stderr
    finally:
        shutil.rmtree(folder)


def test_path_that_is_a_file_is_a_storage_fault(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    with pytest.raises(StorageFault) as info:
        tier(blocker)
    assert "--disk-dir" in info.value.hint


def test_corrupted_lmdb_is_rebuilt_from_slab_headers(tmp_path: pathlib.Path) -> None:
    t = tier(tmp_path)
    write(t, list(range(20)))
    path, offset = _slot_of(t, 7)
    slot = t._slots.slot_of(slot_bytes_for(BLOCK), offset)
    t.close()
    assert slot is not None
    with path.open("r+b") as fh:  # block 7's header is damaged: the rebuild must skip it
        fh.seek(header_offset(slot) + 20)
        fh.write(b"\xff\xff\xff")
    data_file = tmp_path / "index.lmdb" / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    raw[:4096] = b"\xa5" * 4096  # smash both meta pages' first page
    raw[4096:8192] = b"\x5a" * 4096
    data_file.write_bytes(bytes(raw))
    t2 = tier(tmp_path)
    try:
        assert t2.stats.index_rebuilt
        assert any("corrupted" in f for f in t2.stats.faults)
        assert not t2.contains(key(7))
        rest = [i for i in range(20) if i != 7]
        got = t2.read_many([key(i) for i in rest])
        assert all(b is not None and np.array_equal(b.data, data(i)) for i, b in zip(rest, got))
    finally:
        t2.close()
    assert list(tmp_path.glob("index.lmdb.corrupt-*"))


def test_enospc_on_a_new_slab_file_keeps_the_tier_serving(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = tier(tmp_path, capacity=4 * SLAB)
    per_file = disk_tier.file_layout(SLAB, slot_bytes_for(BLOCK))[0]
    try:
        write(t, list(range(per_file)))  # fills file 0

        def no_space(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", no_space)
        write(t, [5000, 5001])  # needs file 1: ENOSPC -> evict within file 0 instead
        summary = t.summary()
        assert summary["usable_capacity_bytes"] == SLAB
        assert any("free space" in f for f in summary["faults"])
        assert t.contains(key(5001))
        got = t.read_many([key(per_file - 1), key(5001)])
        assert all(b is not None for b in got)
    finally:
        t.close()


def test_index_entry_without_backing_file_is_dropped_at_recovery(tmp_path: pathlib.Path) -> None:
    t = tier(tmp_path)
    write(t, [1, 2])
    path, _ = _slot_of(t, 1)
    t.close()
    path.unlink()
    t2 = tier(tmp_path)
    try:
        assert t2.stats.recovery_dropped == 2 and len(t2) == 0
    finally:
        t2.close()


def test_remove_is_durable(tmp_path: pathlib.Path) -> None:
    t = tier(tmp_path)
    write(t, [1, 2])
    assert t.remove([key(1), key(9)]) == [key(1)]
    t.close()
    t2 = tier(tmp_path)
    try:
        assert not t2.contains(key(1)) and t2.contains(key(2))
    finally:
        t2.close()


def test_slots_recovery_matches_fresh_allocation() -> None:
    fresh = DiskSlots(2, SLAB)
    taken = [fresh.alloc(8192, lambda f: True) for _ in range(5)]
    restored = DiskSlots(2, SLAB)
    for where in taken:
        assert where is not None
        assert restored.mark_used(where[0], where[1], 8192) == fresh.slot_of(8192, where[1])
    assert restored.mark_used(taken[0][0], taken[0][1], 8192) == -1  # type: ignore[index]  # overlap
    restored.finish_recovery()
    assert restored.used_bytes == fresh.used_bytes
    assert restored.alloc(8192, lambda f: True) == fresh.alloc(8192, lambda f: True)


def test_index_is_not_committed_when_the_data_sync_fails(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The durability order: a block's index entry commits only after its data is synced."""
    t = tier(tmp_path)
    gone: list[bytes] = []
    t._on_evict = gone.extend

    def failing_sync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing_sync)
    try:
        assert write(t, [1]) == 0
        assert not t.contains(key(1)) and gone == [key(1)]
        assert t.stats.io_errors == 1 and t.used_bytes == 0
        with t._env.begin(db=t._db_blocks) as txn:
            assert txn.get(key(1)) is None
        monkeypatch.undo()
        assert write(t, [2]) == 1  # the tier keeps working once the disk does
    finally:
        t.close()


def test_background_recovery_serves_reads_and_removals_before_the_index_is_loaded(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = tier(tmp_path)
    write(t, list(range(10)))
    path, offset = _slot_of(t, 3)
    t.close()
    with path.open("r+b") as fh:  # block 3 is corrupt on disk
        fh.seek(offset + 10)
        fh.write(b"\x00\xff\x00\xff")
    gate = threading.Event()
    real_recover = DiskTier._recover

    def gated(self: DiskTier) -> None:
        gate.wait(10)
        real_recover(self)

    monkeypatch.setattr(DiskTier, "_recover", gated)
    t2 = tier(tmp_path, background_recovery=True)
    try:
        assert t2.recovering and t2.summary()["recovering"] is True
        assert t2.present([key(1), key(42)]) == [True, False]
        (one,) = t2.read_many([key(1)])
        assert one is not None and np.array_equal(one.data, data(1))
        assert t2.read_many([key(3)]) == [None] and t2.stats.checksum_failures == 1
        assert t2.remove([key(2)]) == [key(2)]
        assert t2.enqueue(key(100), b"ns", data(100), checksum64(data(100)))  # waits for the index to place it
        gate.set()
        assert t2.wait_recovered(10) and t2.flush(10)
        assert not t2.contains(key(2)) and not t2.contains(key(3)) and t2.contains(key(100))
        assert t2.stats.recovered_blocks == 8
    finally:
        gate.set()
        t2.close()
    monkeypatch.undo()
    t3 = tier(tmp_path)
    try:  # the removal and the drop were durable, the new block too
        assert not t3.contains(key(2)) and not t3.contains(key(3))
        assert t3.contains(key(100)) and len(t3) == 9
    finally:
        t3.close()
