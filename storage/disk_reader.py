"""The disk tier's read path: serve a batch of keys from the write-behind queue or with one
aligned direct read each (in parallel, on the tier's I/O pool), verifying every payload's
xxh3 checksum against the committed index. A block that fails (torn write, flipped bit, a
slot reused after a crash) is dropped from the tier durably, counted and served as a miss:
wrong KV is never returned.

A read pins its entries (``readers``) so eviction and removal cannot reuse their slots
while the bytes are in flight; a removal during the read marks the entry ``doomed`` and the
last reader frees the slot. No I/O runs under the state lock.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import lmdb
import numpy as np

from kvpool.core.checksum import checksum64
from kvpool.storage.disk_index import DiskEntry
from kvpool.storage.disk_recovery import early_entry
from kvpool.storage.disk_state import DiskBlock, DiskParts

log = logging.getLogger("kvpool.storage.disk_tier")


class DiskReader:
    def __init__(self, parts: DiskParts) -> None:
        self._st, self._db, self._files, self._pool = parts.state, parts.db, parts.files, parts.pool
        self._delete, self._report_failed = parts.delete, parts.report_failed

    def read_many(self, keys: Sequence[bytes]) -> list[DiskBlock | None]:
        """Read and verify blocks in parallel; None for a miss or a block that failed its
        checks (which is dropped from the tier and counted)."""
        st = self._st
        results: list[DiskBlock | None] = [None] * len(keys)
        jobs: list[tuple[int, DiskEntry]] = []
        early_txn: lmdb.Transaction | None = None
        with st.lock:
            for i, key in enumerate(keys):
                q = st.queued.get(key)
                if q is not None and not q.cancelled:
                    results[i] = DiskBlock(key, q.namespace, q.checksum, q.payload().copy())
                    st.stats.queue_hits += 1
                    st.stats.hits += 1
                    st.stats.bytes_out += q.size
                    continue
                entry = st.index.get(key)
                if entry is None and not st.recovered.is_set():
                    if early_txn is None:
                        early_txn = self._db.reader()
                    entry = early_entry(st, self._db, early_txn, key)
                if entry is None:
                    st.stats.misses += 1
                    continue
                entry.readers += 1
                jobs.append((i, entry))
            if early_txn is not None:
                early_txn.abort()
        futures = [(i, entry, self._pool.submit(self._read_one, entry)) for i, entry in jobs]
        failed: list[DiskEntry] = []
        io_failed: set[bytes] = set()  # the others failed their checksum
        for i, entry, fut in futures:
            try:
                block = fut.result()
            except OSError as exc:
                log.error("disk tier: read of block %s failed: %s", entry.key.hex(), exc)
                with st.lock:
                    st.stats.io_errors += 1
                io_failed.add(entry.key)
                block = None
            if block is None:
                failed.append(entry)
            results[i] = block
        dropped: list[bytes] = []
        with st.lock:
            for _, entry in jobs:
                entry.readers -= 1
                if entry.doomed and entry.readers == 0:
                    entry.doomed = False
                    st.slots.free(entry.file, entry.offset)
            for entry in failed:
                st.stats.misses += 1
                if not st.recovered.is_set() and entry.key not in st.index:
                    st.failed_early.add(entry.key)  # read straight from LMDB: dropped at install
                elif st.index.get(entry.key) is entry:
                    st.forget(entry)
                    dropped.append(entry.key)
            for i, _ in jobs:
                got = results[i]
                if got is not None:
                    st.stats.hits += 1
                    st.stats.bytes_out += int(got.data.size)
                    st.policy.on_access(got.key)
        if dropped:
            self._delete(dropped)
            corrupt = [k for k in dropped if k not in io_failed]
            self._report_failed(corrupt, "checksum_failure")
            self._report_failed([k for k in dropped if k in io_failed], "io_error")
        return results

    def _read_one(self, entry: DiskEntry) -> DiskBlock | None:
        """One aligned direct read of the payload, verified against the committed checksum."""
        buf = self._st.buffers.acquire(entry.slot_bytes)
        view = memoryview(buf)
        try:
            done = 0
            fd = self._files.fd(entry.file)
            while done < entry.slot_bytes:
                n = os.preadv(fd, [view[done:]], entry.offset + done)
                if n <= 0:
                    break
                done += n
            if done < entry.size or checksum64(view[: entry.size]) != entry.checksum:
                with self._st.lock:
                    self._st.stats.checksum_failures += 1
                log.warning("disk tier: block %s failed its checksum check; dropped", entry.key.hex())
                return None
            data = np.frombuffer(buf, dtype=np.uint8, count=entry.size).copy()
            return DiskBlock(entry.key, entry.namespace, entry.checksum, data)
        finally:
            view.release()
            self._st.buffers.release(buf)
