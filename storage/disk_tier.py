"""The disk (NVMe) tier of one node: preallocated slab files written with aligned direct
I/O, a per-block header, and a local LMDB index committed only after the data is durable.

This module is the facade ``TieredStore`` and the daemon use; each job lives in its own
module, small enough to hold in mind:

- ``disk_layout``: the file format (slab file = header page, block header table, payload
  slots aligned for direct I/O), header encoding, aligned buffers;
- ``disk_slots``: slot allocation over the slab files;
- ``disk_index``: the LMDB index (one record per committed block) and its meta stamp;
- ``disk_state``: what the tier knows under its one lock, and the placement / eviction rule
  (watermarks, policy order, never a block being read);
- ``disk_files``: opening and preallocating slab files (never under the state lock);
- ``disk_writer``: the bounded write-behind queue and the durable, pipelined group commit
  (delete victims' records, write, ``fdatasync``, commit records);
- ``disk_reader``: verified parallel reads; a block failing its checksum is dropped,
  counted and served as a miss (wrong KV is never returned);
- ``disk_recovery``: reload the index on restart (in the background if asked), rebuild a
  corrupted one from the slab headers;
- ``disk_full``: a full filesystem reported as ``DiskFull`` with the path and free space.

The durability promise (``docs/tiers.md``, "What survives"): a block whose index record is
committed survives SIGTERM, SIGKILL and power loss; blocks still in the write-behind queue
are written on a clean close (bounded wait), lost on SIGKILL or power loss.
"""

from __future__ import annotations

import logging
import os
import pathlib
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lmdb
import numpy as np

from kvpool.core.errors import InvalidArgument, StorageFault
from kvpool.core.hashing import HASH_SCHEME
from kvpool.core.invariants import checked_after
from kvpool.storage.disk_files import SlabFiles
from kvpool.storage.disk_full import DiskFull
from kvpool.storage.disk_index import LMDB_MAP_BYTES, DiskEntry, delete_durably
from kvpool.storage.disk_layout import (
    FILE_HEADER_BYTES,
    IO_ALIGN_BYTES,
    BufferPool,
    aligned_buffer,
    file_layout,
    header_offset,
    probe_direct_io,
    scheme_bytes,
    slot_bytes_for,
)
from kvpool.storage.disk_reader import DiskReader
from kvpool.storage.disk_recovery import early_entry, open_index, recover
from kvpool.storage.disk_slots import DiskSlots
from kvpool.storage.disk_state import DiskBlock, DiskParts, DiskState, DiskStats, EvictSink, FailSink, QueuedBlock
from kvpool.storage.disk_writer import WRITER_LINGER_S, WRITER_MAX_BATCH, DiskWriter

log = logging.getLogger(__name__)

__all__ = [
    "DiskBlock",
    "DiskEntry",
    "DiskFull",
    "DiskSlots",
    "DiskStats",
    "DiskTier",
    "QueuedBlock",
    "aligned_buffer",
    "file_layout",
    "header_offset",
    "probe_direct_io",
    "slot_bytes_for",
]


class DiskTier:
    """Blocks on local disk with a crash-safe index. Thread-safe."""

    LMDB_MAP_BYTES = LMDB_MAP_BYTES
    WRITER_MAX_BATCH = WRITER_MAX_BATCH
    WRITER_LINGER_S = WRITER_LINGER_S

    def __init__(
        self,
        directory: str,
        capacity_bytes: int,
        slab_file_bytes: int,
        *,
        policy: str = "lru",
        io_threads: int = 4,
        queue_blocks: int = 1024,
        scheme: str = HASH_SCHEME,
        direct_io: bool | None = None,
        on_evict: EvictSink | None = None,
        on_failed: FailSink | None = None,
        start_writer: bool = True,
        background_recovery: bool = False,
        high_watermark: float = 1.0,
        low_watermark: float = 1.0,
    ) -> None:
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise InvalidArgument(
                f"disk watermarks must satisfy 0 < low ({low_watermark}) <= high ({high_watermark}) <= 1"
            )
        if slab_file_bytes % IO_ALIGN_BYTES or slab_file_bytes <= FILE_HEADER_BYTES:
            raise InvalidArgument(
                f"disk slab_file_bytes {slab_file_bytes} must be a multiple of {IO_ALIGN_BYTES} above one page",
                hint="use e.g. --disk-slab-file-bytes 1073741824",
            )
        num_files = capacity_bytes // slab_file_bytes
        if num_files < 1:
            raise InvalidArgument(
                f"disk capacity {capacity_bytes} is smaller than one slab file ({slab_file_bytes})",
                hint="raise --disk-capacity-bytes or lower --disk-slab-file-bytes",
            )
        self.directory = pathlib.Path(directory)
        self.slab_file_bytes = slab_file_bytes
        self.capacity_bytes = num_files * slab_file_bytes
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.scheme = scheme
        self._scheme_raw = scheme_bytes(scheme)
        self._on_evict = on_evict
        self._on_failed = on_failed  # None: failures are reported through on_evict
        # blocks in flight = the queue + the batch being written (taken off the queue)
        buffers = BufferPool(max_per_size=2 * queue_blocks + io_threads * 2)
        self._st = DiskState(num_files, slab_file_bytes, policy, high_watermark, low_watermark, buffers)
        self._prepare_directory()
        self.direct_io = probe_direct_io(str(self.slab_dir)) if direct_io is None else direct_io
        if not self.direct_io:
            log.warning(
                "disk tier: %s does not accept O_DIRECT; using buffered I/O + fdatasync "
                "(durability kept, page cache used)",
                self.slab_dir,
            )
        self._files = SlabFiles(self.slab_dir, slab_file_bytes, self.direct_io, self._scheme_raw, buffers)
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvpool-disk-io")
        try:
            self._db = open_index(self._st, self.directory, self._files, scheme, self._scheme_raw)
        except BaseException:
            self._pool.shutdown(wait=False)
            self._files.close()
            raise
        parts = DiskParts(
            self._st, self._db, self._files, self._pool, self._delete, self._report_gone, self._report_failed
        )
        self._writer = DiskWriter(parts, self._scheme_raw, queue_blocks)
        self._reader = DiskReader(parts)
        self._recovery: threading.Thread | None = None  # joined by close: it writes the index
        if not background_recovery:
            try:
                self._recover()
            except BaseException:
                self._pool.shutdown(wait=False)
                self._writer.stop(0)
                self._files.close()
                self._db.close()
                raise
        else:
            self._recovery = threading.Thread(
                target=self._recover_in_background, name="kvpool-disk-recovery", daemon=True
            )
            self._recovery.start()
        if start_writer:
            self._writer.start()

    # -- the parts, as the tests and tools knew them ---------------------------------------
    @property
    def stats(self) -> DiskStats:
        return self._st.stats

    @property
    def _lock(self) -> threading.RLock:
        return self._st.lock

    @property
    def _index(self) -> dict[bytes, DiskEntry]:
        return self._st.index

    @property
    def _slots(self) -> DiskSlots:
        return self._st.slots

    @property
    def _fds(self) -> dict[int, int]:
        return self._files.fds

    @property
    def _env(self) -> lmdb.Environment:
        return self._db.env

    @property
    def _db_blocks(self) -> Any:
        return self._db.blocks

    def _file_path(self, f: int) -> pathlib.Path:
        return self._files.path(f)

    @property
    def slab_dir(self) -> pathlib.Path:
        return self.directory / "slabs"

    @property
    def index_dir(self) -> pathlib.Path:
        return self.directory / "index.lmdb"

    # -- setup and recovery ---------------------------------------------------------------
    def _prepare_directory(self) -> None:
        try:
            self.slab_dir.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".write-probe-{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise StorageFault(
                f"disk tier directory {self.directory} is not usable: {exc}",
                hint="point --disk-dir at a writable directory on a local disk (or omit it to run without a disk tier)",
            ) from exc

    def _recover(self) -> None:
        bad = recover(self._st, self._db, self._files)
        if bad:
            self._delete(bad)

    def _recover_in_background(self) -> None:
        try:
            self._recover()
        except Exception as exc:  # loud, and the tier goes on empty (reads verify every block)
            fault = StorageFault(f"disk tier recovery failed: {exc}", hint="check the disk and --disk-dir")
            log.exception("%s", fault)
            with self._st.lock:
                self._st.note_fault(fault)
                self._st.recovered.set()
                self._st.idle.notify_all()

    def wait_recovered(self, timeout_s: float | None = None) -> bool:
        """Block until the committed index is loaded (immediately true without background
        recovery)."""
        return self._st.recovered.wait(timeout_s)

    @property
    def recovering(self) -> bool:
        return not self._st.recovered.is_set()

    def _delete(self, keys: list[bytes]) -> None:
        delete_durably(self._db, keys, self._st.io_fault)

    def _report_gone(self, keys: list[bytes]) -> None:
        if keys and self._on_evict is not None:
            self._on_evict(keys)

    def _report_failed(self, keys: list[bytes], cause: str) -> None:
        if keys and self._on_failed is not None:
            self._on_failed(keys, cause)
        else:
            self._report_gone(keys)

    # -- queries --------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return self.present([key])[0]

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """``contains`` for a batch. The host tier asks this under its own lock (on
        eviction), so no I/O runs under the state lock: during background recovery LMDB is
        read outside it, then checked against the removals and failed reads that landed
        meanwhile (those sets only grow until the loaded index is installed)."""
        st = self._st
        with st.lock:
            found = [k in st.index or k in st.queued for k in keys]
            if st.recovered.is_set() or all(found):
                return found
        with self._db.reader() as txn:
            committed = [hit or self._db.get(txn, k) is not None for k, hit in zip(keys, found)]
        with st.lock:
            if st.recovered.is_set():  # installed meanwhile: the index is the answer
                return [k in st.index or k in st.queued for k in keys]
            gone = st.removed_early | st.failed_early
            return [(k in st.index or k in st.queued) or (c and k not in gone) for k, c in zip(keys, committed)]

    def meta(self, key: bytes) -> tuple[bytes, int, int] | None:
        """(namespace, size, checksum) of a block on disk or queued for it."""
        st = self._st
        with st.lock:
            q = st.queued.get(key)
            if q is not None:
                return q.namespace, q.size, q.checksum
            e = st.index.get(key)
            if e is None and not st.recovered.is_set():
                with self._db.reader() as txn:
                    e = early_entry(st, self._db, txn, key)
            return None if e is None else (e.namespace, e.size, e.checksum)

    def keys(self) -> list[bytes]:
        """Every block (waits for background recovery: a snapshot must be complete)."""
        self._st.recovered.wait()
        with self._st.lock:
            return list(self._st.index) + [k for k in self._st.queued if k not in self._st.index]

    def __len__(self) -> int:
        with self._st.lock:
            return len(self._st.index)

    @property
    def used_bytes(self) -> int:
        return self._st.slots.used_bytes

    @property
    def queued_blocks(self) -> int:
        with self._st.lock:
            return len(self._st.queued)

    # -- reads and writes -------------------------------------------------------------------
    @checked_after
    def enqueue(self, key: bytes, namespace: bytes, data: np.ndarray, checksum: int) -> bool:
        """Copy a block into the write-behind queue; False when not taken (already there,
        queue full: counted in ``stats.queue_full_drops``, tier closed). Never blocks."""
        return self._writer.enqueue(key, namespace, data, checksum)

    @checked_after
    def write_now(self, blocks: Sequence[tuple[bytes, bytes, np.ndarray, int]]) -> int:
        """Write blocks synchronously (bypassing the queue); returns how many were committed."""
        return self._writer.write_now(blocks)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block is written (or dropped). True if drained in time."""
        return self._writer.flush(timeout_s)

    @checked_after
    def read_many(self, keys: Sequence[bytes]) -> list[DiskBlock | None]:
        """Read and verify blocks in parallel; None for a miss or a block that failed its
        checks (which is dropped from the tier and counted)."""
        return self._reader.read_many(keys)

    # -- removal and shutdown ------------------------------------------------------------
    @checked_after
    def remove(self, keys: Sequence[bytes]) -> list[bytes]:
        """Forget blocks (durably); returns the keys that were here. A block being read is
        forgotten now; its slot is only reused once the read is done (readers hold it)."""
        st = self._st
        gone: list[bytes] = []
        with st.lock:
            for key in keys:
                q = st.queued.get(key)
                if q is not None:
                    q.cancelled = True
                    del st.queued[key]
                    gone.append(key)
                entry = st.index.get(key)
                if entry is None:
                    if not st.recovered.is_set() and key not in gone and key not in st.removed_early:
                        with self._db.reader() as txn:
                            if early_entry(st, self._db, txn, key) is not None:
                                st.removed_early.add(key)
                                gone.append(key)
                    continue
                st.forget(entry)
                if key not in gone:
                    gone.append(key)
            st.stats.removed += len(gone)
        if gone:
            self._delete(gone)
        return gone

    def check_invariants(self) -> None:
        """The tier's state rules (``DiskState.check_invariants``; debug mode)."""
        self._st.check_invariants()

    def summary(self) -> dict[str, object]:
        st = self._st
        with st.lock:
            s = st.stats
            return {
                "directory": str(self.directory),
                "direct_io": self.direct_io,
                "policy": st.policy_name,
                "capacity_bytes": self.capacity_bytes,
                "usable_capacity_bytes": st.file_limit * self.slab_file_bytes,
                "high_watermark": self.high_watermark,
                "low_watermark": self.low_watermark,
                "used_bytes": st.slots.used_bytes,
                "blocks": len(st.index),
                "queued_blocks": len(st.queued),
                "hits": s.hits,
                "misses": s.misses,
                "bytes_in": s.bytes_in,
                "bytes_out": s.bytes_out,
                "writes": s.writes,
                "evictions": s.evictions,
                "removed": s.removed,
                "checksum_failures": s.checksum_failures,
                "io_errors": s.io_errors,
                "disk_full": s.disk_full,
                "queue_full_drops": s.queue_full_drops,
                "unplaced_drops": s.unplaced_drops,
                "queue_hits": s.queue_hits,
                "recovered_blocks": s.recovered_blocks,
                "recovery_dropped": s.recovery_dropped,
                "recovery_ms": round(s.recovery_ms, 3),
                "index_rebuilt": s.index_rebuilt,
                "recovering": not st.recovered.is_set(),
                "faults": list(s.faults),
            }

    def close(self, flush_timeout_s: float = 10.0) -> None:
        """Drain the write-behind queue (bounded wait), stop the writer, close files and index."""
        st = self._st
        if st.closed:
            return
        # the loader reads the index and, after ``recovered`` is set, deletes the entries it
        # dropped: join it (not only wait for the event) before closing what it uses
        st.recovered.wait()
        if self._recovery is not None:
            self._recovery.join()
        if self._writer.running:
            self.flush(flush_timeout_s)
        with st.lock:
            st.closed = True
        if not self._writer.stop(flush_timeout_s):
            log.error(
                "disk tier: the writer is still inside a write %.1f s after close began (a stuck disk?); "
                "its slab files and index are left open, for the process exit to close, so that no late "
                "write lands in a reused file descriptor",
                flush_timeout_s,
            )
            return
        self._pool.shutdown(wait=True)
        self._files.close()
        with st.lock:
            self._db.close()
