"""Bringing a disk tier back after a restart or a crash.

- ``open_index``: open the LMDB index; a corrupted one is moved aside and rebuilt from the
  slab files' header tables (every payload's checksum verified), so a lost index costs a
  scan, not the cache.
- ``recover``: load the committed index (with each block's write sequence, so the eviction
  order survives) into fresh structures, drop entries no slab file can back, then install
  them at once. With background recovery the tier serves meanwhile straight from LMDB
  (``early_entry``); removals and failed checks seen meanwhile are applied at install.
"""

from __future__ import annotations

import logging
import os
import pathlib
import time

import lmdb

from kvpool.core.checksum import checksum64
from kvpool.core.errors import StorageFault
from kvpool.storage.disk_files import SlabFiles
from kvpool.storage.disk_index import DiskEntry, DiskIndexDB
from kvpool.storage.disk_layout import (
    FILE_HEADER_BYTES,
    HEADER_BYTES,
    IO_ALIGN_BYTES,
    parse_block_header,
    parse_file_header,
    slot_bytes_for,
)
from kvpool.storage.disk_slots import DiskSlots
from kvpool.storage.disk_state import DiskState
from kvpool.storage.eviction import make_policy

log = logging.getLogger("kvpool.storage.disk_tier")


def open_index(st: DiskState, directory: pathlib.Path, files: SlabFiles, scheme: str, scheme_raw: bytes) -> DiskIndexDB:
    """The tier's index, rebuilt from the slab headers if the LMDB files are corrupted."""
    path = directory / "index.lmdb"
    try:
        db = DiskIndexDB(path)
    except lmdb.Error as exc:
        if not path.exists():
            raise StorageFault(
                f"cannot create the disk index at {path}: {exc}", hint="check free space and permissions of --disk-dir"
            ) from exc
        aside = path.with_name(f"index.lmdb.corrupt-{int(time.time())}")
        fault = StorageFault(
            f"the disk index {path} is corrupted ({exc}); moved it to {aside.name} and rebuilding "
            "from the slab files' block headers",
            hint="nothing to do unless this repeats; then check the disk (a failing device corrupts files)",
        )
        log.warning("%s", fault)
        st.note_fault(fault)
        os.replace(path, aside)
        db = DiskIndexDB(path)
        st.stats.index_rebuilt = True
        rebuild_from_slabs(db, st.slots, files, scheme_raw)
    db.check_meta(directory, scheme, st.slab_file_bytes)
    return db


def rebuild_from_slabs(db: DiskIndexDB, slots: DiskSlots, files: SlabFiles, scheme_raw: bytes) -> None:
    """Rebuild a lost index from the slab files' header tables (verifying every payload's
    checksum); of two headers naming one key, the later write wins."""
    best: dict[bytes, DiskEntry] = {}
    for f in range(slots.num_files):
        path = files.path(f)
        if not path.exists():
            continue
        with path.open("rb") as fh:
            slot_bytes = parse_file_header(fh.read(FILE_HEADER_BYTES), scheme_raw, files.slab_file_bytes)
            if slot_bytes == 0:
                continue
            count, _ = slots.layout(slot_bytes)
            table = fh.read(count * HEADER_BYTES)
            for slot in range(min(count, len(table) // HEADER_BYTES)):
                parsed = parse_block_header(
                    memoryview(table)[slot * HEADER_BYTES : (slot + 1) * HEADER_BYTES], scheme_raw
                )
                if parsed is None:
                    continue
                key, namespace, size, checksum, seq = parsed
                if slot_bytes_for(size) != slot_bytes:
                    continue
                offset = slots.offset_of(slot_bytes, slot)
                fh.seek(offset)
                if checksum64(fh.read(size)) != checksum:
                    continue
                old = best.get(key)
                if old is None or old.seq < seq:
                    best[key] = DiskEntry(key, f, offset, size, checksum, slot_bytes, seq, namespace)
    db.put(best.values())
    log.warning("disk tier: rebuilt the index from slab headers: %d blocks recovered", len(best))


def recover(st: DiskState, db: DiskIndexDB, files: SlabFiles) -> list[bytes]:
    """Load the committed index and install it (see the module docstring). Returns the keys
    to delete from the index: records no slab file backs, or found corrupt meanwhile (the
    caller deletes them outside the lock)."""
    started = time.perf_counter()
    entries: list[DiskEntry] = []
    bad: list[bytes] = []
    for key, record in db.records():
        if record is None:
            bad.append(key)
        else:
            entries.append(record)
    entries.sort(key=lambda e: e.seq)
    sizes: dict[int, int] = {}
    index: dict[bytes, DiskEntry] = {}
    owner: dict[tuple[int, int], DiskEntry] = {}
    slots = DiskSlots(st.slots.num_files, st.slab_file_bytes)
    policy = make_policy(st.policy_name)
    on_insert = policy.on_insert
    mark_used = slots.mark_used
    align = IO_ALIGN_BYTES
    for entry in entries:
        f = entry.file
        file_size = sizes.get(f)
        if file_size is None:
            file_size = sizes[f] = files.existing_size(f)
        slot = -1
        if file_size >= entry.offset + entry.slot_bytes and entry.slot_bytes == -(-entry.size // align) * align:
            slot = mark_used(f, entry.offset, entry.slot_bytes)
        if slot < 0:
            bad.append(entry.key)
            continue
        index[entry.key] = entry
        owner[(f, slot)] = entry
        on_insert(entry.key)
    slots.finish_recovery()
    for f, size in sizes.items():  # opened before the lock: opening a file is I/O
        if size > 0 and f < slots.num_files:
            files.adopt(f, size)
    with st.lock:
        for key in st.removed_early | st.failed_early:
            dropped = index.pop(key, None)
            if dropped is None:
                continue
            policy.on_remove(key)
            slots.free(dropped.file, dropped.offset)
            dropped_slot = slots.slot_of(dropped.slot_bytes, dropped.offset)
            if dropped_slot is not None:
                owner.pop((dropped.file, dropped_slot), None)
        bad.extend(k for k in st.failed_early if k not in bad)
        st.removed_early.clear()
        st.failed_early.clear()
        st.index, st.slot_owner, st.slots, st.policy = index, owner, slots, policy
        if entries:
            st.seq = max(st.seq, entries[-1].seq)
        st.stats.recovered_blocks = len(index)
        st.stats.recovery_dropped = len(bad)
        st.stats.recovery_ms = (time.perf_counter() - started) * 1000.0
        st.recovered.set()
        st.idle.notify_all()
    if bad:
        log.warning("disk tier: dropped %d index entries that no slab file backs or that failed a check", len(bad))
    return bad


def early_entry(st: DiskState, db: DiskIndexDB, txn: lmdb.Transaction, key: bytes) -> DiskEntry | None:
    """During background recovery: a committed entry straight from LMDB (called under the
    state lock, so the removal/failure sets are consistent with it)."""
    if key in st.removed_early or key in st.failed_early:
        return None
    return db.get(txn, key)
