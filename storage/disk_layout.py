"""The disk tier's on-disk format and I/O buffers: what a slab file looks like, where a
block's payload and header sit in it, and the page-aligned memory that ``O_DIRECT`` needs.

A slab file is ``[file header page][block header table][payload slots]``. Each payload slot
is the block rounded up to ``IO_ALIGN_BYTES``, and the slot area starts on a boundary aligned
to the slot size (up to 4 MiB), so a 4 MiB block is one aligned 4 MiB direct write (a header
in front of each payload would misalign every large write and cost about a third of the
throughput). Each block's 128-byte header (magic, format and hash-scheme versions, block key
with its length (up to 32 bytes: the daemon's keys are namespace digest || hash), namespace,
length, checksum, write sequence, header checksum) sits in the file's header table, so the
files are self-describing and a lost index can be rebuilt from them.

Everything here is pure (no state, no locks) except ``BufferPool``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pathlib
import struct
import threading

from kvpool.core.checksum import checksum64
from kvpool.core.errors import InvalidArgument

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
BLOCK_HEADER = struct.Struct("<4sHBx16s32s16sQQQ")
BLOCK_HEADER_CRC = struct.Struct("<Q")
# slab file header: magic, format, scheme, slab_file_bytes, slot_bytes (0 = unassigned)
FILE_HEADER = struct.Struct("<8sH6x16sQQ")
# LMDB value: file, offset in file, size, checksum, slot bytes, seq, namespace
INDEX_VALUE = struct.Struct("<IQQQIQ16s")


def scheme_bytes(scheme: str) -> bytes:
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


class BufferPool:
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


def slab_file_path(slab_dir: pathlib.Path, f: int) -> pathlib.Path:
    """Where slab file number ``f`` lives."""
    return slab_dir / f"slab-{f:05d}.kvd"


def pack_block_header(scheme_raw: bytes, key: bytes, namespace: bytes, size: int, checksum: int, seq: int) -> bytes:
    """One block's header-table record (``HEADER_BYTES``), with its own checksum."""
    head = BLOCK_HEADER.pack(
        BLOCK_MAGIC,
        FORMAT_VERSION,
        len(key),
        scheme_raw,
        key,  # padded to 32 bytes by the struct; its length is stored before it
        namespace,
        size,
        checksum,
        seq,
    )
    return (head + BLOCK_HEADER_CRC.pack(checksum64(head))).ljust(HEADER_BYTES, b"\0")


def parse_block_header(raw: memoryview, scheme_raw: bytes) -> tuple[bytes, bytes, int, int, int] | None:
    """(key, namespace, size, checksum, seq) of an intact header of this scheme, else None."""
    if len(raw) < BLOCK_HEADER.size + BLOCK_HEADER_CRC.size:
        return None
    magic, fmt, key_len, scheme, key, namespace, size, checksum, seq = BLOCK_HEADER.unpack_from(raw, 0)
    if magic != BLOCK_MAGIC or fmt != FORMAT_VERSION or scheme != scheme_raw:
        return None
    if not 0 < key_len <= MAX_KEY_BYTES:
        return None
    (header_crc,) = BLOCK_HEADER_CRC.unpack_from(raw, BLOCK_HEADER.size)
    if checksum64(raw[: BLOCK_HEADER.size]) != header_crc:
        return None
    return bytes(key[:key_len]), bytes(namespace), size, checksum, seq


def pack_file_header(buf: mmap.mmap, scheme_raw: bytes, slab_file_bytes: int, slot_bytes: int) -> None:
    """Write a slab file's header page image into ``buf`` (``FILE_HEADER_BYTES`` long)."""
    buf[:] = b"\0" * FILE_HEADER_BYTES
    FILE_HEADER.pack_into(buf, 0, FILE_MAGIC, FORMAT_VERSION, scheme_raw, slab_file_bytes, slot_bytes)


def parse_file_header(head: bytes, scheme_raw: bytes, slab_file_bytes: int) -> int:
    """The slot size a slab file serves, from its header page; 0 if the header is not one of
    this format, scheme and slab size (or the file never got a slot class)."""
    if len(head) < FILE_HEADER.size:
        return 0
    magic, fmt, scheme, slab_bytes, slot_bytes = FILE_HEADER.unpack_from(head)
    if magic != FILE_MAGIC or fmt != FORMAT_VERSION or scheme != scheme_raw or slab_bytes != slab_file_bytes:
        return 0
    return int(slot_bytes)
