"""The disk tier's write path: a bounded write-behind queue drained by one writer thread,
in durable group-commit batches.

Durability order of a batch: (1) durably delete the index entries of the blocks evicted to
make room, (2) write payloads and header-table pages, (3) ``fdatasync`` the touched files,
(4) commit the new index entries. A crash at any point leaves an index whose every entry
points at durable bytes. Batches are pipelined: while one batch syncs and commits (on the
finisher thread), the next one's writes run.

Backpressure: ``enqueue`` never blocks (the host tier calls it under its lock); a full queue
refuses the block and counts it exactly in ``stats.queue_full_drops``. ``write_now`` is the
blocking path (the shutdown flush uses it). Nothing here does I/O under the state lock: a
slab file that must be preallocated is preallocated between two lock sections (issue 16).
"""

from __future__ import annotations

import logging
import mmap
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import lmdb
import numpy as np

from kvpool.core.errors import InvalidArgument
from kvpool.storage.disk_files import pwrite_full
from kvpool.storage.disk_full import DiskFull, FaultLog, disk_fault
from kvpool.storage.disk_index import DiskEntry
from kvpool.storage.disk_layout import (
    FILE_HEADER_BYTES,
    HEADER_BYTES,
    HEADERS_PER_PAGE,
    IO_ALIGN_BYTES,
    MAX_KEY_BYTES,
    NAMESPACE_BYTES,
    pack_block_header,
    slot_bytes_for,
)
from kvpool.storage.disk_state import DiskParts, QueuedBlock

log = logging.getLogger("kvpool.storage.disk_tier")
#: how often an idle writer looks whether it was asked to stop (the marker may not fit the queue)
STOP_POLL_S = 0.1

WRITER_MAX_BATCH = 64  # blocks per write-behind batch (one fdatasync + one index commit)
WRITER_LINGER_S = 0.002  # how long the writer waits for a batch to fill


@dataclass
class BatchInFlight:
    """A write-behind batch between its two stages."""

    placed: list[tuple[QueuedBlock, DiskEntry]] = field(default_factory=list)
    victims: list[DiskEntry] = field(default_factory=list)
    dropped: list[bytes] = field(default_factory=list)  # refused: no slot could be freed
    new_files: list[tuple[int, int]] = field(default_factory=list)  # (file, slot bytes) given a class
    pages: list[tuple[int, int, mmap.mmap]] = field(default_factory=list)  # header-table page images
    futures: list[Future[None]] = field(default_factory=list)
    error: BaseException | None = None


class DiskWriter:
    """Owns the write-behind queue, the writer thread and the batch pipeline."""

    def __init__(self, parts: DiskParts, scheme_raw: bytes, queue_blocks: int) -> None:
        self._st, self._db, self._files, self._pool = parts.state, parts.db, parts.files, parts.pool
        self._delete, self._report_gone, self._report_failed = parts.delete, parts.report_gone, parts.report_failed
        self._scheme_raw = scheme_raw
        self.queue: queue.Queue[QueuedBlock | None] = queue.Queue(maxsize=queue_blocks)
        self._write_mutex = threading.Lock()  # one batch is placed at a time
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-disk-commit")
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()  # set by stop(): the writer ends once the queue is empty
        self._faults = FaultLog(log)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvpool-disk-writer", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def stop(self, timeout_s: float) -> bool:
        """Ask the writer to end and wait up to ``timeout_s``. True when it ended (or never
        started) and its commit thread is done; False when it is still inside a batch (a
        disk stuck in an I/O): then the caller must not close the files and the index it
        writes to, or a late write could land in a descriptor number the process reused."""
        thread = self._thread
        self._stopping.set()
        if thread is not None:
            deadline_s = time.monotonic() + timeout_s
            try:  # a full queue behind a stuck writer must not block the stop itself
                self.queue.put(None, timeout=max(timeout_s, 0.0))
            except queue.Full:
                pass
            thread.join(timeout=max(deadline_s - time.monotonic(), 0.0))
            if thread.is_alive():
                return False  # its batch may still need the commit thread: leave that running too
        self._finisher.shutdown(wait=True)
        return True

    # -- taking blocks -------------------------------------------------------------------
    def enqueue(self, key: bytes, namespace: bytes, data: np.ndarray, checksum: int) -> bool:
        """Copy a block into the write-behind queue. False when it was not taken (already
        there, queue full (counted), tier closed); never blocks, because the caller holds
        the host lock."""
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise InvalidArgument(f"block keys are 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
        st = self._st
        with st.lock:
            if st.closed or key in st.index or key in st.queued:
                return False
            if self.queue.full():
                st.stats.queue_full_drops += 1
                return False
            block = self._queue_copy(key, namespace, data, checksum)
            self.queue.put_nowait(block)
            return True

    def write_now(self, blocks: Sequence[tuple[bytes, bytes, np.ndarray, int]]) -> int:
        """Write blocks synchronously (bypassing the queue); returns how many were committed."""
        st = self._st
        batch: list[QueuedBlock] = []
        with st.lock:
            for key, namespace, data, checksum in blocks:
                if key in st.index or key in st.queued:
                    continue
                batch.append(self._queue_copy(key, namespace, data, checksum))
            st.inflight_batches += 1
        try:
            started = self._start_batch(batch)
        except Exception:
            self._abandon_batch(batch)
            raise
        return self._finish_batch(started)  # ends the in-flight accounting

    def _queue_copy(self, key: bytes, namespace: bytes, data: np.ndarray, checksum: int) -> QueuedBlock:
        """Copy a block into an aligned buffer and register it as queued (under the lock):
        the caller's bytes may be reused as soon as this returns."""
        size = int(data.size)
        buf = self._st.buffers.acquire(slot_bytes_for(size))
        block = QueuedBlock(key, namespace.ljust(NAMESPACE_BYTES, b"\0")[:NAMESPACE_BYTES], size, checksum, buf)
        block.payload()[:] = data
        self._st.queued[key] = block
        return block

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block is written (or dropped). True if drained in time."""
        deadline = time.monotonic() + timeout_s
        st = self._st
        with st.lock:
            while st.queued or st.inflight_batches:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                st.idle.wait(min(left, 0.05))
            return True

    # -- the writer thread ---------------------------------------------------------------
    def _loop(self) -> None:
        """Group commit, pipelined: take what is queued (lingering up to ``WRITER_LINGER_S``
        for more, so one fdatasync + one index commit covers many blocks), place it and start
        its writes, then finish the *previous* batch (wait, fdatasync, commit) while these
        writes run, so the disk is not idle during syncs and index commits."""
        finishing: Future[int] | None = None
        stop = False
        while not stop:
            try:  # the stop marker may not fit in a full queue: stop() also sets _stopping
                first = self.queue.get(timeout=STOP_POLL_S)
            except queue.Empty:
                if self._stopping.is_set():
                    break
                continue
            if first is None:
                break
            batch = [first]
            linger_until = time.monotonic() + WRITER_LINGER_S
            while len(batch) < WRITER_MAX_BATCH:
                try:
                    left = linger_until - time.monotonic()
                    nxt = self.queue.get(timeout=left) if left > 0 else self.queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            with self._st.lock:
                self._st.inflight_batches += 1
            try:
                started = self._start_batch(batch)
            except Exception:  # the writer must not die silently: log loudly, count, keep going
                log.exception("disk tier: write-behind batch failed")
                self._abandon_batch(batch)
                continue
            if finishing is not None:
                self._wait_finish(finishing)
            finishing = self._finisher.submit(self._finish_batch, started)
        if finishing is not None:
            self._wait_finish(finishing)

    def _wait_finish(self, finishing: Future[int]) -> None:
        try:
            finishing.result()
        except Exception:
            log.exception("disk tier: finishing a write-behind batch failed")

    def _abandon_batch(self, batch: list[QueuedBlock]) -> None:
        st = self._st
        with st.lock:
            st.stats.io_errors += 1
            for block in batch:
                if st.queued.get(block.key) is block:
                    del st.queued[block.key]
            st.inflight_batches -= 1
            st.idle.notify_all()

    # -- a batch: place, write ------------------------------------------------------------
    def _start_batch(self, batch: list[QueuedBlock]) -> BatchInFlight:
        """Stage 1 (one batch at a time): choose slots (evicting by policy), do step (1) of
        the durability order and start (2); ``_finish_batch`` does the rest."""
        st = self._st
        st.recovered.wait()  # slots are only known once the index is loaded
        with self._write_mutex:
            job = BatchInFlight()
            self._place(batch, job)
            if job.victims:
                self._delete([v.key for v in job.victims])
            if not job.placed:
                return job
            try:
                for f, slot_bytes in job.new_files:
                    self._files.write_file_header(f, slot_bytes)
                job.futures = [
                    self._pool.submit(pwrite_full, self._files.fd(entry.file), block.buf, entry.offset)
                    for block, entry in job.placed
                ]
                job.futures += [
                    self._pool.submit(pwrite_full, self._files.fd(f), image, FILE_HEADER_BYTES + page * IO_ALIGN_BYTES)
                    for f, page, image in job.pages
                ]
            except OSError as exc:
                job.error = exc
            return job

    def _place(self, batch: list[QueuedBlock], job: BatchInFlight) -> None:
        """Give each block a slot under the state lock. When a block needs a slab file that
        is not preallocated yet, leave the lock, preallocate it, and go on where it stopped."""
        st = self._st
        todo = list(reversed(batch))
        retry = False
        need: list[int] = []  # the slab file the allocator asked for that is not preallocated

        def may_open(f: int) -> bool:
            if f >= st.file_limit:
                return False
            if self._files.is_prepared(f):
                return True
            need.append(f)
            return False

        def needs_file() -> bool:
            return bool(need)

        while True:
            need.clear()
            with st.lock:
                while todo:
                    block = todo[-1]
                    if block.cancelled or st.queued.get(block.key) is not block or block.key in st.index:
                        todo.pop()
                        st.finish_queued(block)
                        continue
                    slot_bytes = slot_bytes_for(block.size)
                    where = st.alloc_slot(
                        slot_bytes, job.victims, job.new_files, may_open, needs_file, watermark=not retry
                    )
                    if where is None and need:
                        break  # preallocate outside the lock, then place this block again
                    retry = False
                    todo.pop()
                    if where is None:
                        st.stats.unplaced_drops += 1
                        st.finish_queued(block)
                        job.dropped.append(block.key)
                        continue
                    st.seq += 1
                    f, offset = where
                    entry = DiskEntry(
                        block.key, f, offset, block.size, block.checksum, slot_bytes, st.seq, block.namespace
                    )
                    job.placed.append((block, entry))
                    st.slot_pending[st.slot_key(entry)] = entry
                if not todo:
                    job.pages = self._header_pages(job.placed)
                    return
            retry = True
            self._prepare_file(need[0])

    def _prepare_file(self, f: int) -> None:
        """Preallocate slab file ``f`` (no lock held but the write mutex); on failure the
        tier stays at the files it has."""
        error = self._files.prepare(f)
        if error is None:
            return
        st = self._st
        fault = disk_fault(
            error,
            self._files.slab_dir,
            f"cannot preallocate disk slab file {self._files.path(f)}",
            f"the disk tier stays at {f} slab files ({f * st.slab_file_bytes} bytes)",
            otherwise_hint="check the disk and --disk-dir permissions",
        )
        self._faults.log(fault)
        with st.lock:
            st.file_limit = min(st.file_limit, f)
            st.note_fault(fault)
            if isinstance(fault, DiskFull):
                st.stats.disk_full += 1

    def _header_pages(self, placed: list[tuple[QueuedBlock, DiskEntry]]) -> list[tuple[int, int, mmap.mmap]]:
        """Images of the header-table pages the batch touches: every live block's header in
        the page plus the batch's new ones (called under the lock)."""
        st = self._st
        new: dict[tuple[int, int], DiskEntry] = {st.slot_key(e): e for _, e in placed}
        out: list[tuple[int, int, mmap.mmap]] = []
        for f, page in sorted({(f, slot // HEADERS_PER_PAGE) for f, slot in new}):
            image = st.buffers.acquire(IO_ALIGN_BYTES)
            image[:] = bytes(IO_ALIGN_BYTES)
            first = page * HEADERS_PER_PAGE
            for slot in range(first, first + HEADERS_PER_PAGE):
                entry = new.get((f, slot)) or st.slot_pending.get((f, slot)) or st.slot_owner.get((f, slot))
                if entry is not None:
                    image[(slot - first) * HEADER_BYTES : (slot - first + 1) * HEADER_BYTES] = pack_block_header(
                        self._scheme_raw, entry.key, entry.namespace, entry.size, entry.checksum, entry.seq
                    )
            out.append((f, page, image))
        return out

    # -- a batch: sync, commit --------------------------------------------------------------
    def _finish_batch(self, job: BatchInFlight) -> int:
        """Stage 2: wait for the writes, fdatasync the files, commit the index entries, make
        the blocks visible. Ends the batch's in-flight accounting."""
        st = self._st
        try:
            return self._finish_batch_io(job)
        finally:
            for _, _, image in job.pages:
                st.buffers.release(image)
            with st.lock:
                for _, entry in job.placed:
                    slot_key = st.slot_key(entry)
                    if st.slot_pending.get(slot_key) is entry:
                        del st.slot_pending[slot_key]
                st.inflight_batches -= 1
                st.idle.notify_all()

    def _finish_batch_io(self, job: BatchInFlight) -> int:
        st = self._st
        if not job.placed:
            self._report_gone([v.key for v in job.victims] + job.dropped)
            return 0
        error: BaseException | None = job.error
        for fut in job.futures:
            try:
                fut.result()
            except OSError as exc:
                error = error or exc
        try:
            if error is not None:
                raise error
            touched = sorted({entry.file for _, entry in job.placed} | {f for f, _ in job.new_files})
            for fut in [self._pool.submit(self._files.sync, f) for f in touched]:
                fut.result()
            self._db.put(entry for _, entry in job.placed)
        except (OSError, lmdb.Error) as exc:
            fault = disk_fault(
                exc,
                self._files.slab_dir.parent,
                "disk tier write failed",
                f"{len(job.placed)} demoted blocks dropped (the host tier keeps serving)",
                otherwise_hint="check the disk (dmesg) and --disk-dir",
            )
            self._faults.log(fault)
            with st.lock:
                st.note_fault(fault)
                st.stats.io_errors += 1
                if isinstance(fault, DiskFull):
                    st.stats.disk_full += 1
                for block, entry in job.placed:
                    st.slots.free(entry.file, entry.offset)
                    st.finish_queued(block)
            self._report_gone([v.key for v in job.victims] + job.dropped)
            self._report_failed([b.key for b, _ in job.placed], "io_error")
            return 0
        committed = 0
        cancelled: list[bytes] = []
        with st.lock:
            for block, entry in job.placed:
                if block.cancelled:
                    cancelled.append(entry.key)
                    st.slots.free(entry.file, entry.offset)
                else:
                    st.index[entry.key] = entry
                    st.slot_owner[st.slot_key(entry)] = entry
                    st.policy.on_insert(entry.key)
                    st.stats.writes += 1
                    st.stats.bytes_in += entry.size
                    committed += 1
                st.finish_queued(block)
        if cancelled:
            self._delete(cancelled)
        self._report_gone([v.key for v in job.victims] + job.dropped)
        return committed
