"""The disk tier's committed index: one LMDB record per block (file, offset, size,
checksum, slot bytes, write sequence, namespace), committed only after the block's data is
durable (``fdatasync``), with ``sync`` and ``metasync`` on, so after a crash every record
points at durable bytes. The meta table pins the hash scheme, format and slab file size the
directory was created with. ``DiskEntry`` is the in-memory form of one record.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable, Iterable, Iterator

import lmdb

from kvpool.core.errors import StorageFault, VersionMismatch
from kvpool.storage.disk_layout import FORMAT_VERSION, INDEX_VALUE, MAX_KEY_BYTES

log = logging.getLogger(__name__)

LMDB_MAP_BYTES = 1 << 34  # virtual reservation; the file grows only as entries are added


class DiskEntry:
    """One block on disk. Slotted: the index may hold millions."""

    __slots__ = ("checksum", "doomed", "file", "key", "namespace", "offset", "readers", "seq", "size", "slot_bytes")

    def __init__(
        self, key: bytes, file: int, offset: int, size: int, checksum: int, slot_bytes: int, seq: int, namespace: bytes
    ) -> None:
        self.key = key
        self.file = file
        self.offset = offset
        self.size = size
        self.checksum = checksum
        self.slot_bytes = slot_bytes
        self.seq = seq
        self.namespace = namespace
        self.readers = 0
        self.doomed = False  # removed while being read: the slot is freed by the last reader

    def pack(self) -> bytes:
        return INDEX_VALUE.pack(
            self.file, self.offset, self.size, self.checksum, self.slot_bytes, self.seq, self.namespace
        )

    @classmethod
    def unpack(cls, key: bytes, value: bytes) -> DiskEntry:
        f, offset, size, checksum, slot_bytes, seq, namespace = INDEX_VALUE.unpack(value)
        return cls(key, f, offset, size, checksum, slot_bytes, seq, namespace)


class DiskIndexDB:
    """The LMDB environment of one disk tier directory. Opening raises ``lmdb.Error`` when
    the files are unreadable (the caller moves them aside and rebuilds); every other method
    raises ``lmdb.Error`` on an I/O failure for the caller to report."""

    def __init__(self, path: pathlib.Path) -> None:
        env = lmdb.open(str(path), map_size=LMDB_MAP_BYTES, max_dbs=2, sync=True, metasync=True, lock=True)
        try:
            self.blocks = env.open_db(b"blocks")
            self.meta = env.open_db(b"meta")
            with env.begin(db=self.blocks) as txn:
                txn.stat(self.blocks)
        except lmdb.Error:
            env.close()
            raise
        self.env = env

    def check_meta(self, directory: pathlib.Path, scheme: str, slab_file_bytes: int) -> None:
        """Stamp a new index with its scheme, format and slab size, or refuse one made with
        others (its blocks cannot be matched or found); closes the index when refusing."""
        with self.env.begin(db=self.meta, write=True) as txn:
            found = txn.get(b"scheme")
            fmt = txn.get(b"format")
            slab = txn.get(b"slab_file_bytes")
            if found is None:
                txn.put(b"scheme", scheme.encode())
                txn.put(b"format", str(FORMAT_VERSION).encode())
                txn.put(b"slab_file_bytes", str(slab_file_bytes).encode())
                return
        if found.decode() != scheme or fmt is None or int(fmt) != FORMAT_VERSION:
            self.close()
            raise StorageFault(
                f"the disk tier at {directory} holds blocks of hash scheme {found.decode()!r} format "
                f"{(fmt or b'?').decode()}; this build uses {scheme!r} format {FORMAT_VERSION}",
                hint="use an empty --disk-dir, or delete the old one's contents (its blocks cannot be matched)",
                code=VersionMismatch.code,
            )
        if slab is None or int(slab) != slab_file_bytes:
            self.close()
            raise StorageFault(
                f"the disk tier at {directory} was created with slab files of {(slab or b'?').decode()} bytes, "
                f"not {slab_file_bytes}",
                hint="restart with the original --disk-slab-file-bytes, or use an empty --disk-dir",
            )

    def records(self) -> Iterator[tuple[bytes, DiskEntry | None]]:
        """Every committed record: (key, entry), or (key, None) for a malformed one."""
        unpack = INDEX_VALUE.unpack
        with self.env.begin(db=self.blocks, buffers=False) as txn:
            for key, value in txn.cursor():
                if not 0 < len(key) <= MAX_KEY_BYTES or len(value) != INDEX_VALUE.size:
                    yield bytes(key), None
                    continue
                f, offset, size, checksum, slot_bytes, seq, namespace = unpack(value)
                yield key, DiskEntry(key, f, offset, size, checksum, slot_bytes, seq, namespace)

    def reader(self) -> lmdb.Transaction:
        """A read transaction (abort it when done)."""
        return self.env.begin(db=self.blocks)

    def get(self, txn: lmdb.Transaction, key: bytes) -> DiskEntry | None:
        value = txn.get(key, db=self.blocks)
        if value is None or len(value) != INDEX_VALUE.size:
            return None
        return DiskEntry.unpack(key, bytes(value))

    def put(self, entries: Iterable[DiskEntry]) -> None:
        """Commit records (one durable transaction)."""
        with self.env.begin(db=self.blocks, write=True) as txn:
            for entry in entries:
                txn.put(entry.key, entry.pack(), db=self.blocks)

    def delete(self, keys: Iterable[bytes]) -> None:
        """Delete records (one durable transaction)."""
        with self.env.begin(db=self.blocks, write=True) as txn:
            for key in keys:
                txn.delete(key, db=self.blocks)

    def close(self) -> None:
        self.env.close()


def delete_durably(db: DiskIndexDB, keys: list[bytes], on_fault: Callable[[StorageFault], None]) -> None:
    """Delete records; a failure is logged and handed to ``on_fault`` (the tier counts it
    and keeps serving: a stale record only costs a failed read check later)."""
    try:
        db.delete(keys)
    except lmdb.Error as exc:
        fault = StorageFault(f"disk index delete failed: {exc}", hint="check the disk and --disk-dir")
        log.error("%s", fault)
        on_fault(fault)
