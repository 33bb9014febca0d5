"""The disk (NVMe) tier of one node: preallocated slab files written with aligned direct
I/O, a per-block header, and a local LMDB index committed only after the data is durable.

Why this shape:
- Slab files are preallocated (``posix_fallocate``) one at a time as the tier fills, so a
  full disk shows up as ENOSPC when a new file is created, never half-way through a block,
  and the tier keeps serving with the files it already has.
- A slab file is ``[file header page][block header table][payload slots]``. Each payload
  slot is the block rounded up to ``IO_ALIGN_BYTES`` and the slot area starts on a boundary
  aligned to the slot size (up to 4 MiB), so a 4 MiB block is one aligned 4 MiB direct
  write (a header in front of each payload would misalign every large write and cost about
  a third of the throughput). Payloads are written and read with ``O_DIRECT`` from
  page-aligned anonymous-mmap buffers through a bounded thread pool (``os.pwritev`` /
  ``os.preadv``), so KV bytes do not churn the page cache.
- Each block's 128-byte header (magic, format and hash-scheme versions, block key with its
  length (up to 32 bytes: the daemon's keys are namespace digest || hash), namespace,
  length, checksum, write sequence, header checksum) sits in the file's header table,
  written with the payload in the same durable batch. Reads verify the payload's xxh3
  checksum against the committed index, so a torn write, a flipped bit or a slot
  reused after a crash is detected, dropped, counted and served as a miss; the headers make
  the files self-describing, so a lost index can be rebuilt. Wrong KV is never returned.
- Durability order of a batch: delete the evicted victims' index entries (LMDB commit),
  write the new blocks, ``fdatasync`` the touched files, and only then commit their index
  entries. A crash at any point leaves an index whose every entry points at durable bytes.
- On restart the LMDB index is read back (with each block's write sequence, so the eviction
  order survives); a corrupted LMDB is moved aside and rebuilt from the slab files' headers.

The tier is used by ``TieredStore``: host evictions arrive through ``enqueue`` (a bounded
write-behind queue drained by one writer thread), host misses are served by ``read_many``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import pathlib
import queue
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import lmdb
import numpy as np

from kvpool.core.checksum import checksum64
from kvpool.core.errors import InvalidArgument, StorageFault, VersionMismatch
from kvpool.core.hashing import HASH_SCHEME
from kvpool.storage.eviction import EvictionPolicy, make_policy

log = logging.getLogger(__name__)

IO_ALIGN_BYTES = 4096
HUGE_PAGE_BYTES = 2 << 20
HEADER_BYTES = 128  # one block header in a file's header table
HEADERS_PER_PAGE = IO_ALIGN_BYTES // HEADER_BYTES
FILE_HEADER_BYTES = IO_ALIGN_BYTES  # each slab file starts with its own header page
MAX_PAYLOAD_ALIGN_BYTES = 4 << 20
# format 2: keys are up to 32 bytes with their length in the header (the daemon's block key
# is namespace digest || hash, so two namespaces' blocks of one hash are two disk blocks)
FORMAT_VERSION = 2
BLOCK_MAGIC = b"KVPB"
FILE_MAGIC = b"KVPSLAB1"
MAX_KEY_BYTES = 32
NAMESPACE_BYTES = 16

# block header: magic, format, key length, scheme, key, namespace, size, checksum, seq, header checksum
_BLOCK_HEADER = struct.Struct("<4sHBx16s32s16sQQQ")
_BLOCK_HEADER_CRC = struct.Struct("<Q")
# slab file header: magic, format, scheme, slab_file_bytes, slot_bytes (0 = unassigned)
_FILE_HEADER = struct.Struct("<8sH6x16sQQ")
# LMDB value: file, offset in file, size, checksum, slot bytes, seq, namespace
_INDEX_VALUE = struct.Struct("<IQQQIQ16s")


def _scheme_bytes(scheme: str) -> bytes:
    raw = scheme.encode()
    if len(raw) > 16:
        raise InvalidArgument(f"hash scheme name {scheme!r} is longer than 16 bytes")
    return raw.ljust(16, b"\0")


def slot_bytes_for(block_bytes: int) -> int:
    """Bytes one block's payload slot takes on disk: the block rounded up to the I/O alignment
    (its header lives in the file's header table)."""
    return -(-block_bytes // IO_ALIGN_BYTES) * IO_ALIGN_BYTES


def payload_align_for(slot_bytes: int) -> int:
    """Largest power of two (<= 4 MiB) dividing the slot size: where the slot area starts."""
    align = IO_ALIGN_BYTES
    while align < MAX_PAYLOAD_ALIGN_BYTES and slot_bytes % (align * 2) == 0:
        align *= 2
    return align


def file_layout(slab_file_bytes: int, slot_bytes: int) -> tuple[int, int]:
    """(slots, payload area offset) of a slab file serving ``slot_bytes`` slots."""
    align = payload_align_for(slot_bytes)

    def payload_off(n: int) -> int:
        table = -(-n // HEADERS_PER_PAGE) * IO_ALIGN_BYTES
        return -(-(FILE_HEADER_BYTES + table) // align) * align

    n = max(0, (slab_file_bytes - FILE_HEADER_BYTES) // slot_bytes)
    while n > 0 and payload_off(n) + n * slot_bytes > slab_file_bytes:
        n -= 1
    return n, payload_off(n)


def header_offset(slot: int) -> int:
    """Where slot ``slot``'s header sits in its file."""
    return FILE_HEADER_BYTES + slot * HEADER_BYTES


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory, as ``O_DIRECT`` needs (mmap returns page-aligned maps),
    populated up front so the first copy into it does not fault page by page."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    buf = mmap.mmap(-1, max(nbytes, IO_ALIGN_BYTES), flags=flags)
    if nbytes >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        # fewer pages for the kernel to pin per direct I/O; a hint, harmless if refused
        with contextlib.suppress(OSError):
            buf.madvise(mmap.MADV_HUGEPAGE)
    if hasattr(mmap, "MADV_WILLNEED"):
        with contextlib.suppress(OSError):
            buf.madvise(mmap.MADV_WILLNEED)
    buf.write(bytes(IO_ALIGN_BYTES))  # touch: the mapping is live before the first DMA
    buf.seek(0)
    return buf


def probe_direct_io(directory: str) -> bool:
    """True if files in ``directory`` can be opened with O_DIRECT and written aligned."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, f".odirect-probe-{os.getpid()}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buf = aligned_buffer(IO_ALIGN_BYTES)
        try:
            os.pwritev(fd, [buf], 0)
            return True
        except OSError:
            return False
        finally:
            buf.close()
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


class _BufferPool:
    """A bounded pool of aligned buffers per size, so hot reads and writes do not map and
    fault fresh pages each time. Keeps at most ``max_per_size`` buffers and at most
    ``max_bytes_per_size`` bytes of each size."""

    def __init__(self, max_per_size: int, max_bytes_per_size: int = 512 << 20) -> None:
        self._free: dict[int, list[mmap.mmap]] = {}
        self._max = max_per_size
        self._max_bytes = max_bytes_per_size
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> mmap.mmap:
        with self._lock:
            stack = self._free.get(nbytes)
            if stack:
                return stack.pop()
        return aligned_buffer(nbytes)

    def release(self, buf: mmap.mmap) -> None:
        with self._lock:
            stack = self._free.setdefault(len(buf), [])
            if len(stack) < self._max and (len(stack) + 1) * len(buf) <= max(self._max_bytes, len(buf)):
                stack.append(buf)
                return
        with contextlib.suppress(BufferError):
            buf.close()


class DiskSlots:
    """Slot allocation over numbered slab files: each file serves one slot size while it
    holds any block, and returns to the free pool when empty. ``mark_used`` rebuilds the
    state from a recovered index."""

    def __init__(self, num_files: int, slab_file_bytes: int) -> None:
        self.num_files = num_files
        self.slab_file_bytes = slab_file_bytes
        self.file_class = [0] * num_files
        self._used = [0] * num_files
        self._free: list[list[int]] = [[] for _ in range(num_files)]  # free slot numbers per file
        self._partial: dict[int, set[int]] = {}  # slot_bytes -> files with a free slot
        self._empty_files: list[int] = list(range(num_files - 1, -1, -1))
        self._recovering: dict[int, set[int]] = {}
        self._layouts: dict[int, tuple[int, int]] = {}
        self.used_bytes = 0

    def layout(self, slot_bytes: int) -> tuple[int, int]:
        """(slots per file, payload area offset) for a slot size."""
        found = self._layouts.get(slot_bytes)
        if found is None:
            found = self._layouts[slot_bytes] = file_layout(self.slab_file_bytes, slot_bytes)
        return found

    @property
    def empty_files(self) -> int:
        """Files holding no block (``alloc`` gives one a slot class when no partial file fits)."""
        return len(self._empty_files)

    def slots_per_file(self, slot_bytes: int) -> int:
        return self.layout(slot_bytes)[0]

    def offset_of(self, slot_bytes: int, slot: int) -> int:
        return self.layout(slot_bytes)[1] + slot * slot_bytes

    def slot_of(self, slot_bytes: int, offset: int) -> int | None:
        """The slot number at ``offset``, or None if no slot starts there."""
        count, base = self.layout(slot_bytes)
        if offset < base or (offset - base) % slot_bytes:
            return None
        slot = (offset - base) // slot_bytes
        return slot if slot < count else None

    def alloc(self, slot_bytes: int, may_open: Callable[[int], bool]) -> tuple[int, int] | None:
        """(file, offset in file) of a free slot, or None when the tier is full for this size.
        ``may_open(file)`` is asked before an empty file is given a class (it creates it)."""
        if self.slots_per_file(slot_bytes) == 0:
            return None
        partial = self._partial.setdefault(slot_bytes, set())
        if not partial:
            while self._empty_files:
                f = self._empty_files[-1]
                if not may_open(f):
                    return None
                self._empty_files.pop()
                self._assign(f, slot_bytes)
                break
            else:
                return None
        f = next(iter(partial))
        slot = self._free[f].pop()
        if not self._free[f]:
            partial.discard(f)
        self._used[f] += 1
        self.used_bytes += slot_bytes
        return f, self.offset_of(slot_bytes, slot)

    def _assign(self, f: int, slot_bytes: int) -> None:
        self.file_class[f] = slot_bytes
        self._free[f] = list(range(self.slots_per_file(slot_bytes) - 1, -1, -1))
        self._partial.setdefault(slot_bytes, set()).add(f)

    def free(self, f: int, offset: int) -> None:
        slot_bytes = self.file_class[f]
        slot = self.slot_of(slot_bytes, offset)
        if slot is None:
            raise InvalidArgument(f"offset {offset} of disk slab file {f} is not a slot")
        self._free[f].append(slot)
        self._partial.setdefault(slot_bytes, set()).add(f)
        self._used[f] -= 1
        self.used_bytes -= slot_bytes
        if self._used[f] == 0:
            self._partial[slot_bytes].discard(f)
            self.file_class[f] = 0
            self._free[f] = []
            self._empty_files.append(f)

    def mark_used(self, f: int, offset: int, slot_bytes: int) -> int:
        """Claim a recovered slot: its slot number, or -1 if it contradicts the state (wrong
        class, overlap, not a slot). Only before ``finish_recovery``; O(1) per block."""
        if not 0 <= f < self.num_files or slot_bytes <= 0 or slot_bytes % IO_ALIGN_BYTES:
            return -1
        slot = self.slot_of(slot_bytes, offset)
        if slot is None:
            return -1
        cls = self.file_class[f]
        if cls == 0:
            self.file_class[f] = slot_bytes
        elif cls != slot_bytes:
            return -1
        used = self._recovering.get(f)
        if used is None:
            used = self._recovering[f] = set()
        if slot in used:
            return -1
        used.add(slot)
        return slot

    def finish_recovery(self) -> None:
        """Build free lists and counters from the slots ``mark_used`` claimed."""
        for f, used in self._recovering.items():
            slot_bytes = self.file_class[f]
            self._free[f] = [s for s in range(self.slots_per_file(slot_bytes) - 1, -1, -1) if s not in used]
            self._used[f] = len(used)
            self.used_bytes += len(used) * slot_bytes
            if self._free[f]:
                self._partial.setdefault(slot_bytes, set()).add(f)
        self._empty_files = [f for f in range(self.num_files - 1, -1, -1) if self.file_class[f] == 0]
        self._recovering = {}


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
        return _INDEX_VALUE.pack(
            self.file, self.offset, self.size, self.checksum, self.slot_bytes, self.seq, self.namespace
        )

    @classmethod
    def unpack(cls, key: bytes, value: bytes) -> DiskEntry:
        f, offset, size, checksum, slot_bytes, seq, namespace = _INDEX_VALUE.unpack(value)
        return cls(key, f, offset, size, checksum, slot_bytes, seq, namespace)


@dataclass
class DiskStats:
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0  # payload bytes written to disk
    bytes_out: int = 0  # payload bytes read from disk (incl. served from the write queue)
    writes: int = 0
    evictions: int = 0
    removed: int = 0
    checksum_failures: int = 0
    io_errors: int = 0
    queue_full_drops: int = 0  # demotions refused because the write-behind queue was full
    unplaced_drops: int = 0  # demotions dropped: no slot could be freed
    queue_hits: int = 0  # reads served from the write-behind queue
    recovered_blocks: int = 0
    recovery_dropped: int = 0
    recovery_ms: float = 0.0
    index_rebuilt: bool = False
    faults: list[str] = field(default_factory=list)  # last few StorageFault messages


@dataclass
class QueuedBlock:
    """A block copied into an aligned buffer (header space + payload), waiting to be written."""

    key: bytes
    namespace: bytes
    size: int
    checksum: int
    buf: mmap.mmap
    cancelled: bool = False

    def payload(self) -> np.ndarray:
        return np.frombuffer(self.buf, dtype=np.uint8, count=self.size)


@dataclass
class _BatchInFlight:
    """A write-behind batch between its two stages."""

    placed: list[tuple[QueuedBlock, DiskEntry]] = field(default_factory=list)
    victims: list[DiskEntry] = field(default_factory=list)
    dropped: list[bytes] = field(default_factory=list)  # refused: no slot could be freed
    new_files: list[tuple[int, int]] = field(default_factory=list)  # (file, slot bytes) given a class
    pages: list[tuple[int, int, mmap.mmap]] = field(default_factory=list)  # header-table page images
    futures: list[Future[None]] = field(default_factory=list)
    error: BaseException | None = None


@dataclass(frozen=True)
class DiskBlock:
    """A block read back and verified: ``data`` is a private copy of its bytes."""

    key: bytes
    namespace: bytes
    checksum: int
    data: np.ndarray


EvictSink = Callable[[list[bytes]], None]


class DiskTier:
    """Blocks on local disk with a crash-safe index. Thread-safe."""

    LMDB_MAP_BYTES = 1 << 34  # virtual reservation; the file grows only as entries are added
    WRITER_MAX_BATCH = 64  # blocks per write-behind batch (one fdatasync + one index commit)
    WRITER_LINGER_S = 0.002  # how long the writer waits for a batch to fill

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
        self._scheme_raw = _scheme_bytes(scheme)
        self._policy_name = policy
        self._policy: EvictionPolicy = make_policy(policy)
        self._on_evict = on_evict
        self._lock = threading.RLock()
        self._index: dict[bytes, DiskEntry] = {}
        self._queued: dict[bytes, QueuedBlock] = {}
        self._slot_owner: dict[tuple[int, int], DiskEntry] = {}  # (file, slot) -> live entry
        self._slot_pending: dict[tuple[int, int], DiskEntry] = {}  # placed, index not yet committed
        self._write_mutex = threading.Lock()
        self._slots = DiskSlots(num_files, slab_file_bytes)
        self._fds: dict[int, int] = {}
        self._file_limit = num_files  # lowered when the disk runs out of space
        self._seq = 0
        self.stats = DiskStats()
        # blocks in flight = the queue + the batch being written (taken off the queue)
        self._buffers = _BufferPool(max_per_size=2 * queue_blocks + io_threads * 2)
        self._queue: queue.Queue[QueuedBlock | None] = queue.Queue(maxsize=queue_blocks)
        self._idle = threading.Condition(self._lock)
        self._inflight_batches = 0
        self._closed = False
        self._prepare_directory()
        self.direct_io = probe_direct_io(str(self.slab_dir)) if direct_io is None else direct_io
        if not self.direct_io:
            log.warning(
                "disk tier: %s does not accept O_DIRECT; using buffered I/O + fdatasync "
                "(durability kept, page cache used)",
                self.slab_dir,
            )
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvpool-disk-io")
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-disk-commit")
        self._recovered = threading.Event()
        self._removed_early: set[bytes] = set()  # removed while background recovery ran
        self._failed_early: set[bytes] = set()  # failed a check while background recovery ran
        try:
            self._env = self._open_index()
            if not background_recovery:
                self._recover()
        except BaseException:
            self._pool.shutdown(wait=False)
            self._finisher.shutdown(wait=False)
            self._close_fds()
            raise
        if background_recovery:
            threading.Thread(target=self._recover_in_background, name="kvpool-disk-recovery", daemon=True).start()
        self._writer: threading.Thread | None = None
        if start_writer:
            self._writer = threading.Thread(target=self._writer_loop, name="kvpool-disk-writer", daemon=True)
            self._writer.start()

    # -- setup and recovery ---------------------------------------------------------------
    @property
    def slab_dir(self) -> pathlib.Path:
        return self.directory / "slabs"

    @property
    def index_dir(self) -> pathlib.Path:
        return self.directory / "index.lmdb"

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

    def _open_index(self) -> lmdb.Environment:
        try:
            env = self._lmdb_open()
        except lmdb.Error as exc:
            if not self.index_dir.exists():
                raise StorageFault(
                    f"cannot create the disk index at {self.index_dir}: {exc}",
                    hint="check free space and permissions of --disk-dir",
                ) from exc
            aside = self.index_dir.with_name(f"index.lmdb.corrupt-{int(time.time())}")
            fault = StorageFault(
                f"the disk index {self.index_dir} is corrupted ({exc}); moved it to {aside.name} and rebuilding "
                "from the slab files' block headers",
                hint="nothing to do unless this repeats; then check the disk (a failing device corrupts files)",
            )
            log.warning("%s", fault)
            self._note_fault(fault)
            os.replace(self.index_dir, aside)
            env = self._lmdb_open()
            self.stats.index_rebuilt = True
            self._rebuild_from_slabs(env)
        self._check_meta(env)
        return env

    def _lmdb_open(self) -> lmdb.Environment:
        env = lmdb.open(
            str(self.index_dir), map_size=self.LMDB_MAP_BYTES, max_dbs=2, sync=True, metasync=True, lock=True
        )
        try:
            self._db_blocks = env.open_db(b"blocks")
            self._db_meta = env.open_db(b"meta")
            with env.begin(db=self._db_blocks) as txn:
                txn.stat(self._db_blocks)
        except lmdb.Error:
            env.close()
            raise
        return env

    def _check_meta(self, env: lmdb.Environment) -> None:
        with env.begin(db=self._db_meta, write=True) as txn:
            scheme = txn.get(b"scheme")
            fmt = txn.get(b"format")
            slab = txn.get(b"slab_file_bytes")
            if scheme is None:
                txn.put(b"scheme", self.scheme.encode())
                txn.put(b"format", str(FORMAT_VERSION).encode())
                txn.put(b"slab_file_bytes", str(self.slab_file_bytes).encode())
                return
        if scheme.decode() != self.scheme or fmt is None or int(fmt) != FORMAT_VERSION:
            env.close()
            raise StorageFault(
                f"the disk tier at {self.directory} holds blocks of hash scheme {scheme.decode()!r} format "
                f"{(fmt or b'?').decode()}; this build uses {self.scheme!r} format {FORMAT_VERSION}",
                hint="use an empty --disk-dir, or delete the old one's contents (its blocks cannot be matched)",
                code=VersionMismatch.code,
            )
        if slab is None or int(slab) != self.slab_file_bytes:
            env.close()
            raise StorageFault(
                f"the disk tier at {self.directory} was created with slab files of {(slab or b'?').decode()} bytes, "
                f"not {self.slab_file_bytes}",
                hint="restart with the original --disk-slab-file-bytes, or use an empty --disk-dir",
            )

    def _recover(self) -> None:
        """Load the committed index into fresh structures, then install them at once; drop
        entries the slab files cannot back, and anything removed or found corrupt while the
        load ran (background recovery serves reads straight from LMDB meanwhile)."""
        started = time.perf_counter()
        entries: list[DiskEntry] = []
        bad: list[bytes] = []
        unpack = _INDEX_VALUE.unpack
        with self._env.begin(db=self._db_blocks, buffers=False) as txn:
            for key, value in txn.cursor():
                if not 0 < len(key) <= MAX_KEY_BYTES or len(value) != _INDEX_VALUE.size:
                    bad.append(bytes(key))
                    continue
                f, offset, size, checksum, slot_bytes, seq, namespace = unpack(value)
                entries.append(DiskEntry(key, f, offset, size, checksum, slot_bytes, seq, namespace))
        entries.sort(key=lambda e: e.seq)
        sizes: dict[int, int] = {}
        index: dict[bytes, DiskEntry] = {}
        owner: dict[tuple[int, int], DiskEntry] = {}
        slots = DiskSlots(self._slots.num_files, self.slab_file_bytes)
        policy = make_policy(self._policy_name)
        on_insert = policy.on_insert
        mark_used = slots.mark_used
        align = IO_ALIGN_BYTES
        for entry in entries:
            f = entry.file
            file_size = sizes.get(f)
            if file_size is None:
                file_size = sizes[f] = self._existing_file_size(f)
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
        with self._lock:
            for f in sizes:
                if sizes[f] > 0 and f < slots.num_files:
                    self._open_fd(f, create=False)
            late = self._removed_early | self._failed_early
            for key in late:
                dropped = index.pop(key, None)
                if dropped is None:
                    continue
                policy.on_remove(key)
                slots.free(dropped.file, dropped.offset)
                dropped_slot = slots.slot_of(dropped.slot_bytes, dropped.offset)
                if dropped_slot is not None:
                    owner.pop((dropped.file, dropped_slot), None)
            bad.extend(k for k in self._failed_early if k not in bad)
            self._removed_early.clear()
            self._failed_early.clear()
            self._index, self._slot_owner, self._slots, self._policy = index, owner, slots, policy
            if entries:
                self._seq = max(self._seq, entries[-1].seq)
            self.stats.recovered_blocks = len(index)
            self.stats.recovery_dropped = len(bad)
            self.stats.recovery_ms = (time.perf_counter() - started) * 1000.0
            self._recovered.set()
            self._idle.notify_all()
        if bad:
            self._commit_deletes(bad)
            log.warning("disk tier: dropped %d index entries that no slab file backs or that failed a check", len(bad))

    def _recover_in_background(self) -> None:
        try:
            self._recover()
        except Exception as exc:  # loud, and the tier goes on empty (reads verify every block)
            fault = StorageFault(f"disk tier recovery failed: {exc}", hint="check the disk and --disk-dir")
            log.exception("%s", fault)
            with self._lock:
                self._note_fault(fault)
                self._recovered.set()
                self._idle.notify_all()

    def wait_recovered(self, timeout_s: float | None = None) -> bool:
        """Block until the committed index is loaded (immediately true without background
        recovery)."""
        return self._recovered.wait(timeout_s)

    @property
    def recovering(self) -> bool:
        return not self._recovered.is_set()

    def _early_entry(self, txn: lmdb.Transaction, key: bytes) -> DiskEntry | None:
        """During background recovery: a committed entry straight from LMDB (called under the
        lock, so the removal/failure sets are consistent with it)."""
        if key in self._removed_early or key in self._failed_early:
            return None
        value = txn.get(key, db=self._db_blocks)
        if value is None or len(value) != _INDEX_VALUE.size:
            return None
        return DiskEntry.unpack(key, bytes(value))

    def _rebuild_from_slabs(self, env: lmdb.Environment) -> None:
        """Rebuild a lost index from the slab files' header tables (verifying every payload's
        checksum), so a corrupted LMDB costs a scan, not the cache."""
        best: dict[bytes, DiskEntry] = {}
        for f in range(self._slots.num_files):
            path = self._file_path(f)
            if not path.exists():
                continue
            with path.open("rb") as fh:
                head = fh.read(FILE_HEADER_BYTES)
                if len(head) < _FILE_HEADER.size:
                    continue
                magic, fmt, scheme, slab_bytes, slot_bytes = _FILE_HEADER.unpack_from(head)
                if (
                    magic != FILE_MAGIC
                    or fmt != FORMAT_VERSION
                    or scheme != self._scheme_raw
                    or slab_bytes != self.slab_file_bytes
                    or slot_bytes == 0
                ):
                    continue
                count, _ = self._slots.layout(slot_bytes)
                table = fh.read(count * HEADER_BYTES)
                for slot in range(min(count, len(table) // HEADER_BYTES)):
                    parsed = self._parse_header(memoryview(table)[slot * HEADER_BYTES : (slot + 1) * HEADER_BYTES])
                    if parsed is None:
                        continue
                    key, namespace, size, checksum, seq = parsed
                    if slot_bytes_for(size) != slot_bytes:
                        continue
                    offset = self._slots.offset_of(slot_bytes, slot)
                    fh.seek(offset)
                    if checksum64(fh.read(size)) != checksum:
                        continue
                    old = best.get(key)
                    if old is None or old.seq < seq:
                        best[key] = DiskEntry(key, f, offset, size, checksum, slot_bytes, seq, namespace)
        with env.begin(db=self._db_blocks, write=True) as txn:
            for key, entry in best.items():
                txn.put(key, entry.pack(), db=self._db_blocks)
        log.warning("disk tier: rebuilt the index from slab headers: %d blocks recovered", len(best))

    # -- files ----------------------------------------------------------------------------
    def _file_path(self, f: int) -> pathlib.Path:
        return self.slab_dir / f"slab-{f:05d}.kvd"

    def _existing_file_size(self, f: int) -> int:
        try:
            return self._file_path(f).stat().st_size
        except OSError:
            return 0

    def _fd_for(self, f: int) -> int:
        with self._lock:
            return self._open_fd(f, create=False)

    def _open_fd(self, f: int, create: bool) -> int:
        fd = self._fds.get(f)
        if fd is not None:
            return fd
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        if self.direct_io:
            flags |= os.O_DIRECT
        fd = os.open(self._file_path(f), flags, 0o600)
        self._fds[f] = fd
        return fd

    def _may_open_file(self, f: int) -> bool:
        """Create and preallocate slab file ``f`` (called by the allocator under the lock)."""
        if f >= self._file_limit:
            return False
        if f in self._fds and self._existing_file_size(f) >= self.slab_file_bytes:
            return True
        try:
            fd = self._open_fd(f, create=True)
            os.posix_fallocate(fd, 0, self.slab_file_bytes)
        except OSError as exc:
            self._file_limit = f
            fault = StorageFault(
                f"cannot preallocate disk slab file {self._file_path(f)}: {exc}; the disk tier stays at "
                f"{f} slab files ({f * self.slab_file_bytes} bytes)",
                hint="free space on the disk or lower --disk-capacity-bytes"
                if exc.errno == errno.ENOSPC
                else "check the disk and --disk-dir permissions",
            )
            log.error("%s", fault)
            self._note_fault(fault)
            fd2 = self._fds.pop(f, None)
            if fd2 is not None:
                os.close(fd2)
            with contextlib.suppress(OSError):
                if self._existing_file_size(f) < self.slab_file_bytes:
                    self._file_path(f).unlink()
            return False
        return True

    def _write_file_header(self, f: int, slot_bytes: int) -> None:
        buf = self._buffers.acquire(FILE_HEADER_BYTES)
        try:
            buf[:] = b"\0" * FILE_HEADER_BYTES
            _FILE_HEADER.pack_into(
                buf, 0, FILE_MAGIC, FORMAT_VERSION, self._scheme_raw, self.slab_file_bytes, slot_bytes
            )
            os.pwritev(self._fds[f], [buf], 0)
        finally:
            self._buffers.release(buf)

    def _close_fds(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def _note_fault(self, fault: StorageFault) -> None:
        self.stats.faults = [*self.stats.faults[-4:], str(fault)]

    # -- queries --------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return self.present([key])[0]

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """``contains`` for a batch, under one lock acquisition."""
        with self._lock:
            found = [k in self._index or k in self._queued for k in keys]
            if self._recovered.is_set() or all(found):
                return found
            with self._env.begin(db=self._db_blocks) as txn:
                return [hit or self._early_entry(txn, k) is not None for k, hit in zip(keys, found)]

    def meta(self, key: bytes) -> tuple[bytes, int, int] | None:
        """(namespace, size, checksum) of a block on disk or queued for it."""
        with self._lock:
            q = self._queued.get(key)
            if q is not None:
                return q.namespace, q.size, q.checksum
            e = self._index.get(key)
            if e is None and not self._recovered.is_set():
                with self._env.begin(db=self._db_blocks) as txn:
                    e = self._early_entry(txn, key)
            return None if e is None else (e.namespace, e.size, e.checksum)

    def keys(self) -> list[bytes]:
        """Every block (waits for background recovery: a snapshot must be complete)."""
        self._recovered.wait()
        with self._lock:
            return list(self._index) + [k for k in self._queued if k not in self._index]

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def used_bytes(self) -> int:
        return self._slots.used_bytes

    @property
    def queued_blocks(self) -> int:
        with self._lock:
            return len(self._queued)

    # -- write path ----------------------------------------------------------------------
    def enqueue(self, key: bytes, namespace: bytes, data: np.ndarray, checksum: int) -> bool:
        """Copy a block into the write-behind queue. False when it was not taken (already
        there, queue full, tier closed); never blocks, because the caller holds the host lock."""
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise InvalidArgument(f"block keys are 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
        with self._lock:
            if self._closed or key in self._index or key in self._queued:
                return False
            if self._queue.full():
                self.stats.queue_full_drops += 1
                return False
            block = self._queue_copy(key, namespace, data, checksum)
            self._queue.put_nowait(block)
            return True

    def write_now(self, blocks: Sequence[tuple[bytes, bytes, np.ndarray, int]]) -> int:
        """Write blocks synchronously (bypassing the queue); returns how many were committed."""
        batch: list[QueuedBlock] = []
        with self._lock:
            for key, namespace, data, checksum in blocks:
                if key in self._index or key in self._queued:
                    continue
                batch.append(self._queue_copy(key, namespace, data, checksum))
            self._inflight_batches += 1
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
        buf = self._buffers.acquire(slot_bytes_for(size))
        block = QueuedBlock(key, namespace.ljust(NAMESPACE_BYTES, b"\0")[:NAMESPACE_BYTES], size, checksum, buf)
        block.payload()[:] = data
        self._queued[key] = block
        return block

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block is written (or dropped). True if drained in time."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._queued or self._inflight_batches:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.05))
            return True

    def _writer_loop(self) -> None:
        """Group commit, pipelined: take what is queued (lingering up to ``WRITER_LINGER_S``
        for more, so one fdatasync + one index commit covers many blocks), place it and start
        its writes, then finish the *previous* batch (wait, fdatasync, commit) while these
        writes run, so the disk is not idle during syncs and index commits."""
        finishing: Future[int] | None = None
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                break
            batch = [first]
            linger_until = time.monotonic() + self.WRITER_LINGER_S
            while len(batch) < self.WRITER_MAX_BATCH:
                try:
                    left = linger_until - time.monotonic()
                    nxt = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            with self._lock:
                self._inflight_batches += 1
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
        with self._lock:
            self.stats.io_errors += 1
            for block in batch:
                if self._queued.get(block.key) is block:
                    del self._queued[block.key]
            self._inflight_batches -= 1
            self._idle.notify_all()

    def _start_batch(self, batch: list[QueuedBlock]) -> _BatchInFlight:
        """The durability order of a batch is: (1) durably delete the index entries of the
        blocks evicted to make room, (2) write payloads and header pages, (3) fdatasync,
        (4) commit the new index entries. This stage (one batch at a time) chooses slots
        (evicting by policy), does (1) and starts (2); ``_finish_batch`` does the rest."""
        self._recovered.wait()  # slots are only known once the index is loaded
        with self._write_mutex:
            job = _BatchInFlight()
            with self._lock:
                for block in batch:
                    if block.cancelled or self._queued.get(block.key) is not block or block.key in self._index:
                        self._finish_queued(block)
                        continue
                    slot_bytes = slot_bytes_for(block.size)
                    where = self._alloc_slot(slot_bytes, job.victims, job.new_files)
                    if where is None:
                        self.stats.unplaced_drops += 1
                        self._finish_queued(block)
                        job.dropped.append(block.key)
                        continue
                    self._seq += 1
                    f, offset = where
                    entry = DiskEntry(
                        block.key, f, offset, block.size, block.checksum, slot_bytes, self._seq, block.namespace
                    )
                    job.placed.append((block, entry))
                    self._slot_pending[self._slot_key(entry)] = entry
                job.pages = self._header_pages(job.placed)
            if job.victims:
                self._commit_deletes([v.key for v in job.victims])
            if not job.placed:
                return job
            try:
                for f, slot_bytes in job.new_files:
                    self._write_file_header(f, slot_bytes)
                job.futures = [
                    self._pool.submit(self._pwrite_full, self._fds[entry.file], block.buf, entry.offset)
                    for block, entry in job.placed
                ]
                job.futures += [
                    self._pool.submit(self._pwrite_full, self._fds[f], image, FILE_HEADER_BYTES + page * IO_ALIGN_BYTES)
                    for f, page, image in job.pages
                ]
            except OSError as exc:
                job.error = exc
            return job

    def _finish_batch(self, job: _BatchInFlight) -> int:
        """Stage 2: wait for the writes, fdatasync the files, commit the index entries, make
        the blocks visible. Ends the batch's in-flight accounting."""
        try:
            return self._finish_batch_io(job)
        finally:
            for _, _, image in job.pages:
                self._buffers.release(image)
            with self._lock:
                for _, entry in job.placed:
                    slot_key = self._slot_key(entry)
                    if self._slot_pending.get(slot_key) is entry:
                        del self._slot_pending[slot_key]
                self._inflight_batches -= 1
                self._idle.notify_all()

    def _finish_batch_io(self, job: _BatchInFlight) -> int:
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
            for fut in [self._pool.submit(os.fdatasync, self._fds[f]) for f in touched]:
                fut.result()
            with self._env.begin(db=self._db_blocks, write=True) as txn:
                for _, entry in job.placed:
                    txn.put(entry.key, entry.pack())
        except (OSError, lmdb.Error) as exc:
            fault = StorageFault(
                f"disk tier write failed: {exc}; {len(job.placed)} demoted blocks dropped "
                "(the host tier keeps serving)",
                hint="free space on the disk or check it for errors"
                if getattr(exc, "errno", None) == errno.ENOSPC
                else "check the disk (dmesg) and --disk-dir",
            )
            log.error("%s", fault)
            with self._lock:
                self._note_fault(fault)
                self.stats.io_errors += 1
                for block, entry in job.placed:
                    self._slots.free(entry.file, entry.offset)
                    self._finish_queued(block)
            self._report_gone([v.key for v in job.victims] + job.dropped + [b.key for b, _ in job.placed])
            return 0
        committed = 0
        cancelled: list[bytes] = []
        with self._lock:
            for block, entry in job.placed:
                if block.cancelled:
                    cancelled.append(entry.key)
                    self._slots.free(entry.file, entry.offset)
                else:
                    self._index[entry.key] = entry
                    self._slot_owner[self._slot_key(entry)] = entry
                    self._policy.on_insert(entry.key)
                    self.stats.writes += 1
                    self.stats.bytes_in += entry.size
                    committed += 1
                self._finish_queued(block)
        if cancelled:
            self._commit_deletes(cancelled)
        self._report_gone([v.key for v in job.victims] + job.dropped)
        return committed

    def _unown(self, entry: DiskEntry) -> None:
        slot_key = self._slot_key(entry)
        if self._slot_owner.get(slot_key) is entry:
            del self._slot_owner[slot_key]

    def _slot_key(self, entry: DiskEntry) -> tuple[int, int]:
        slot = self._slots.slot_of(entry.slot_bytes, entry.offset)
        return entry.file, -1 if slot is None else slot

    def _header_pages(self, placed: list[tuple[QueuedBlock, DiskEntry]]) -> list[tuple[int, int, mmap.mmap]]:
        """Images of the header-table pages the batch touches: every live block's header in
        the page plus the batch's new ones (called under the lock)."""
        new: dict[tuple[int, int], DiskEntry] = {self._slot_key(e): e for _, e in placed}
        out: list[tuple[int, int, mmap.mmap]] = []
        for f, page in sorted({(f, slot // HEADERS_PER_PAGE) for f, slot in new}):
            image = self._buffers.acquire(IO_ALIGN_BYTES)
            image[:] = bytes(IO_ALIGN_BYTES)
            first = page * HEADERS_PER_PAGE
            for slot in range(first, first + HEADERS_PER_PAGE):
                entry = new.get((f, slot)) or self._slot_pending.get((f, slot)) or self._slot_owner.get((f, slot))
                if entry is not None:
                    image[(slot - first) * HEADER_BYTES : (slot - first + 1) * HEADER_BYTES] = self._header_bytes(entry)
            out.append((f, page, image))
        return out

    def _header_bytes(self, entry: DiskEntry) -> bytes:
        head = _BLOCK_HEADER.pack(
            BLOCK_MAGIC,
            FORMAT_VERSION,
            len(entry.key),
            self._scheme_raw,
            entry.key,  # padded to 32 bytes by the struct; its length is stored before it
            entry.namespace,
            entry.size,
            entry.checksum,
            entry.seq,
        )
        return (head + _BLOCK_HEADER_CRC.pack(checksum64(head))).ljust(HEADER_BYTES, b"\0")

    def _report_gone(self, keys: list[bytes]) -> None:
        if keys and self._on_evict is not None:
            self._on_evict(keys)

    def _pwrite_full(self, fd: int, buf: mmap.mmap, offset: int) -> None:
        view = memoryview(buf)
        done = 0
        total = len(view)
        while done < total:
            n = os.pwritev(fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            done += n

    def _alloc_slot(
        self, slot_bytes: int, victims: list[DiskEntry], new_files: list[tuple[int, int]]
    ) -> tuple[int, int] | None:
        """A free slot, evicting by policy when the tier is full (never a block being read)."""
        if slot_bytes > self.slab_file_bytes - FILE_HEADER_BYTES:
            return None
        self._evict_to_low_watermark(slot_bytes, victims)
        while True:
            empty_before = self._slots.empty_files
            where = self._slots.alloc(slot_bytes, self._may_open_file)
            if where is not None:
                if self._slots.empty_files < empty_before:  # an empty file was given this class
                    new_files.append((where[0], slot_bytes))
                return where
            if not self._evict_one(victims):
                return None

    def _evict_to_low_watermark(self, slot_bytes: int, victims: list[DiskEntry]) -> None:
        """A write that would take the tier above the high watermark (of the capacity it can
        use: ENOSPC may have stopped it short) first evicts by policy until, with the new
        block, usage is at most the low watermark. The victims join the batch's durable index
        deletes like any other eviction; 1.0 / 1.0 evicts only when no slot is free."""
        capacity = self._file_limit * self.slab_file_bytes
        if self._slots.used_bytes + slot_bytes <= self.high_watermark * capacity:
            return
        target = self.low_watermark * capacity - slot_bytes
        while self._slots.used_bytes > target and self._evict_one(victims):
            pass

    def _evict_one(self, victims: list[DiskEntry]) -> bool:
        """Evict one committed block by policy (never one being read); False if none can go."""
        key = self._policy.pop_victim(self._evictable)
        if key is None:
            return False
        victim = self._index.pop(key)
        self._unown(victim)
        victims.append(victim)
        self.stats.evictions += 1
        # Reusing the slot in this batch is safe: the batch commits the victims' index
        # deletes (synced) before any of its writes start, so no committed entry ever
        # points at bytes being overwritten.
        self._slots.free(victim.file, victim.offset)
        return True

    def _evictable(self, key: bytes) -> bool:
        entry = self._index.get(key)
        return entry is not None and entry.readers == 0

    def _finish_queued(self, block: QueuedBlock) -> None:
        if self._queued.get(block.key) is block:
            del self._queued[block.key]
        self._buffers.release(block.buf)

    def _commit_deletes(self, keys: list[bytes]) -> None:
        try:
            with self._env.begin(db=self._db_blocks, write=True) as txn:
                for key in keys:
                    txn.delete(key)
        except lmdb.Error as exc:
            fault = StorageFault(f"disk index delete failed: {exc}", hint="check the disk and --disk-dir")
            log.error("%s", fault)
            with self._lock:
                self._note_fault(fault)
                self.stats.io_errors += 1

    # -- read path -----------------------------------------------------------------------
    def read_many(self, keys: Sequence[bytes]) -> list[DiskBlock | None]:
        """Read and verify blocks in parallel; None for a miss or a block that failed its
        checks (which is dropped from the tier and counted)."""
        results: list[DiskBlock | None] = [None] * len(keys)
        jobs: list[tuple[int, DiskEntry]] = []
        early_txn: lmdb.Transaction | None = None
        with self._lock:
            for i, key in enumerate(keys):
                q = self._queued.get(key)
                if q is not None and not q.cancelled:
                    results[i] = DiskBlock(key, q.namespace, q.checksum, q.payload().copy())
                    self.stats.queue_hits += 1
                    self.stats.hits += 1
                    self.stats.bytes_out += q.size
                    continue
                entry = self._index.get(key)
                if entry is None and not self._recovered.is_set():
                    if early_txn is None:
                        early_txn = self._env.begin(db=self._db_blocks)
                    entry = self._early_entry(early_txn, key)
                if entry is None:
                    self.stats.misses += 1
                    continue
                entry.readers += 1
                jobs.append((i, entry))
            if early_txn is not None:
                early_txn.abort()
        futures = [(i, entry, self._pool.submit(self._read_one, entry)) for i, entry in jobs]
        failed: list[DiskEntry] = []
        for i, entry, fut in futures:
            try:
                block = fut.result()
            except OSError as exc:
                log.error("disk tier: read of block %s failed: %s", entry.key.hex(), exc)
                with self._lock:
                    self.stats.io_errors += 1
                block = None
            if block is None:
                failed.append(entry)
            results[i] = block
        with self._lock:
            for _, entry in jobs:
                entry.readers -= 1
                if entry.doomed and entry.readers == 0:
                    entry.doomed = False
                    self._slots.free(entry.file, entry.offset)
            dropped: list[bytes] = []
            for entry in failed:
                self.stats.misses += 1
                if not self._recovered.is_set() and entry.key not in self._index:
                    self._failed_early.add(entry.key)  # read straight from LMDB: dropped at install
                elif self._index.get(entry.key) is entry:
                    del self._index[entry.key]
                    self._unown(entry)
                    self._policy.on_remove(entry.key)
                    if entry.readers:
                        entry.doomed = True
                    else:
                        self._slots.free(entry.file, entry.offset)
                    dropped.append(entry.key)
            for i, _ in jobs:
                got = results[i]
                if got is not None:
                    self.stats.hits += 1
                    self.stats.bytes_out += int(got.data.size)
                    self._policy.on_access(got.key)
        if dropped:
            self._commit_deletes(dropped)
            self._report_gone(dropped)
        return results

    def _read_one(self, entry: DiskEntry) -> DiskBlock | None:
        """One aligned direct read of the payload, verified against the committed checksum."""
        buf = self._buffers.acquire(entry.slot_bytes)
        view = memoryview(buf)
        try:
            done = 0
            while done < entry.slot_bytes:
                n = os.preadv(self._fd_for(entry.file), [view[done:]], entry.offset + done)
                if n <= 0:
                    break
                done += n
            if done < entry.size or checksum64(view[: entry.size]) != entry.checksum:
                with self._lock:
                    self.stats.checksum_failures += 1
                log.warning("disk tier: block %s failed its checksum check; dropped", entry.key.hex())
                return None
            data = np.frombuffer(buf, dtype=np.uint8, count=entry.size).copy()
            return DiskBlock(entry.key, entry.namespace, entry.checksum, data)
        finally:
            view.release()
            self._buffers.release(buf)

    def _parse_header(self, raw: memoryview) -> tuple[bytes, bytes, int, int, int] | None:
        """(key, namespace, size, checksum, seq) of an intact header of this scheme, else None."""
        if len(raw) < _BLOCK_HEADER.size + _BLOCK_HEADER_CRC.size:
            return None
        magic, fmt, key_len, scheme, key, namespace, size, checksum, seq = _BLOCK_HEADER.unpack_from(raw, 0)
        if magic != BLOCK_MAGIC or fmt != FORMAT_VERSION or scheme != self._scheme_raw:
            return None
        if not 0 < key_len <= MAX_KEY_BYTES:
            return None
        (header_crc,) = _BLOCK_HEADER_CRC.unpack_from(raw, _BLOCK_HEADER.size)
        if checksum64(raw[: _BLOCK_HEADER.size]) != header_crc:
            return None
        return bytes(key[:key_len]), bytes(namespace), size, checksum, seq

    # -- removal and shutdown ------------------------------------------------------------
    def remove(self, keys: Sequence[bytes]) -> list[bytes]:
        """Forget blocks (durably); returns the keys that were here. A block being read is
        forgotten now; its slot is only reused once the read is done (readers hold it)."""
        gone: list[bytes] = []
        with self._lock:
            for key in keys:
                q = self._queued.get(key)
                if q is not None:
                    q.cancelled = True
                    del self._queued[key]
                    gone.append(key)
                entry = self._index.pop(key, None)
                if entry is None:
                    if not self._recovered.is_set() and key not in gone and key not in self._removed_early:
                        with self._env.begin(db=self._db_blocks) as txn:
                            if self._early_entry(txn, key) is not None:
                                self._removed_early.add(key)
                                gone.append(key)
                    continue
                self._unown(entry)
                self._policy.on_remove(key)
                if entry.readers:
                    entry.doomed = True
                else:
                    self._slots.free(entry.file, entry.offset)
                if key not in gone:
                    gone.append(key)
            self.stats.removed += len(gone)
        if gone:
            self._commit_deletes(gone)
        return gone

    def summary(self) -> dict[str, object]:
        with self._lock:
            s = self.stats
            return {
                "directory": str(self.directory),
                "direct_io": self.direct_io,
                "policy": self._policy_name,
                "capacity_bytes": self.capacity_bytes,
                "usable_capacity_bytes": self._file_limit * self.slab_file_bytes,
                "high_watermark": self.high_watermark,
                "low_watermark": self.low_watermark,
                "used_bytes": self._slots.used_bytes,
                "blocks": len(self._index),
                "queued_blocks": len(self._queued),
                "hits": s.hits,
                "misses": s.misses,
                "bytes_in": s.bytes_in,
                "bytes_out": s.bytes_out,
                "writes": s.writes,
                "evictions": s.evictions,
                "removed": s.removed,
                "checksum_failures": s.checksum_failures,
                "io_errors": s.io_errors,
                "queue_full_drops": s.queue_full_drops,
                "unplaced_drops": s.unplaced_drops,
                "queue_hits": s.queue_hits,
                "recovered_blocks": s.recovered_blocks,
                "recovery_dropped": s.recovery_dropped,
                "recovery_ms": round(s.recovery_ms, 3),
                "index_rebuilt": s.index_rebuilt,
                "recovering": not self._recovered.is_set(),
                "faults": list(s.faults),
            }

    def close(self, flush_timeout_s: float = 10.0) -> None:
        """Drain the write-behind queue (bounded wait), stop the writer, close files and index."""
        if self._closed:
            return
        self._recovered.wait()  # the loader reads the index: let it finish before closing it
        if self._writer is not None:
            self.flush(flush_timeout_s)
        with self._lock:
            self._closed = True
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout=flush_timeout_s)
        self._finisher.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        with self._lock:
            self._close_fds()
            self._env.close()
