"""The disk tier's slab files: opening them (``O_DIRECT`` where the filesystem takes it),
preallocating a new one, writing its header page, and full-length positional writes.

Why its own lock: opening and preallocating a file are I/O (``posix_fallocate`` of a 1 GiB
slab can take long, and falls back to writing zeros on filesystems without fallocate). They
run under this small lock only, never under the tier's state lock, which the host tier's
eviction path waits for (issue 16).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import pathlib
import threading

from kvpool.storage.disk_layout import FILE_HEADER_BYTES, BufferPool, pack_file_header, slab_file_path


class SlabFiles:
    """File descriptors of one tier's slab files, and which files are fully preallocated."""

    def __init__(
        self, slab_dir: pathlib.Path, slab_file_bytes: int, direct_io: bool, scheme_raw: bytes, buffers: BufferPool
    ) -> None:
        self.slab_dir = slab_dir
        self.slab_file_bytes = slab_file_bytes
        self.direct_io = direct_io
        self._scheme_raw = scheme_raw
        self._buffers = buffers
        self._lock = threading.Lock()
        self.fds: dict[int, int] = {}
        self._prepared: set[int] = set()  # preallocated to slab_file_bytes

    def path(self, f: int) -> pathlib.Path:
        return slab_file_path(self.slab_dir, f)

    def existing_size(self, f: int) -> int:
        try:
            return self.path(f).stat().st_size
        except OSError:
            return 0

    def fd(self, f: int) -> int:
        """The descriptor of an existing slab file (opened on first use)."""
        with self._lock:
            return self._open(f, create=False)

    def _open(self, f: int, create: bool) -> int:
        fd = self.fds.get(f)
        if fd is not None:
            return fd
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        if self.direct_io:
            flags |= os.O_DIRECT
        fd = os.open(self.path(f), flags, 0o600)
        self.fds[f] = fd
        return fd

    def adopt(self, f: int, size: int) -> None:
        """A file found at recovery holding ``size`` bytes: open it, remember if it is whole."""
        with self._lock:
            self._open(f, create=False)
            if size >= self.slab_file_bytes:
                self._prepared.add(f)

    def is_prepared(self, f: int) -> bool:
        with self._lock:
            return f in self._prepared

    def prepare(self, f: int) -> OSError | None:
        """Create and preallocate slab file ``f`` (a full disk shows up here, as ENOSPC,
        never half-way through a block). The error, or None; a failed file is closed and
        removed unless it was already whole."""
        with self._lock:
            if f in self._prepared:
                return None
            try:
                fd = self._open(f, create=True)
                os.posix_fallocate(fd, 0, self.slab_file_bytes)
            except OSError as exc:
                fd2 = self.fds.pop(f, None)
                if fd2 is not None:
                    os.close(fd2)
                with contextlib.suppress(OSError):
                    if self.existing_size(f) < self.slab_file_bytes:
                        self.path(f).unlink()
                return exc
            self._prepared.add(f)
            return None

    def write_file_header(self, f: int, slot_bytes: int) -> None:
        buf = self._buffers.acquire(FILE_HEADER_BYTES)
        try:
            pack_file_header(buf, self._scheme_raw, self.slab_file_bytes, slot_bytes)
            os.pwritev(self.fd(f), [buf], 0)
        finally:
            self._buffers.release(buf)

    def sync(self, f: int) -> None:
        os.fdatasync(self.fd(f))

    def close(self) -> None:
        with self._lock:
            for fd in self.fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.fds.clear()


def pwrite_full(fd: int, buf: mmap.mmap, offset: int) -> None:
    """Write all of ``buf`` at ``offset`` (retrying short writes)."""
    view = memoryview(buf)
    done = 0
    total = len(view)
    while done < total:
        n = os.pwritev(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n
