"""A mapping of a node's shared-memory arena as a same-host client holds it: the interface
between the client (``kvpool.client``) and the arena the storage layer owns
(``kvpool.storage.arena.SharedArena``, a subclass that also creates, reserves and removes
the file). It lives in core so that the client and storage, which sit beside each other in
the layer table of ``docs/architecture.md``, both depend downward on it and not on each other.

A client's ``view`` is always a **read-only** mapping, whichever way it got the arena (by
path, ``attach``, or by a descriptor a node handed over, ``from_fd``). It writes only through
a ``PutWindow`` (``put_window``): just the pages its put's slots cover are writable, and only
until the put's bytes are in. A stray write anywhere else, or after the put, is a SIGSEGV in
the client, never a change to another block. Where slots are whole pages, the window opens
pages of one writable mapping of the arena that is kept ``PROT_NONE`` between puts
(``mprotect``, ``ProtectedWindow``): mapping and unmapping a window per put cost a third of
the copy's time on 4 KiB pages (faulting every page in, then a TLB shootdown); switching the
protection of pages that stay mapped costs less (~13 ms against ~55 ms per 256 MiB), still a
large part of a put (docs/benchmarks.md, "What limits a put here"). A put whose
bytes the client copies itself (``PoolClient.put``: one thread, our own copy routine) uses a
second kept mapping whose pages carry a memory protection key instead (``kvpool.core.pkeys``,
where the CPU has them): no thread may touch it except the copying one, during the copy
(``PutWindow.writing``), and opening it changes no page table.
stdlib + numpy only, like the rest of core.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext

import numpy as np

from kvpool.core.errors import InvalidArgument, Unavailable
from kvpool.core.pkeys import ProtectionKey, allocate_key, linux_libc

log = logging.getLogger(__name__)

#: a put copied by the client itself and larger than this has its pages switched in pieces
#: of this many bytes while the copy runs (``kvpool.core.put_pipeline``; a multiple of every
#: page size): small enough that the first piece's open and the last one's shut, which
#: nothing hides, are short; large enough that each switch is one call among few (16 and
#: 32 MiB measured alike, 64 MiB slower)
PUT_PIECE_BYTES = 16 << 20
#: the largest page size a client takes from a node's Hello (x86-64's gigantic page)
MAX_PAGE_BYTES = 1 << 30


class ArenaMapping:
    """A mapped arena, exposed as one flat uint8 numpy array (``view``)."""

    def __init__(self, path: str, capacity_bytes: int, fd: int, mapping: mmap.mmap, write_fd: int = -1) -> None:
        """``fd``: what ``mapping`` was made from; ``write_fd``: a client's descriptor that
        may be mapped writable for a put (``put_window``), -1 while it has none (``fd`` itself
        when it is read-write: the client maps it read-only all the same)."""
        self.path = path
        self.capacity_bytes = capacity_bytes
        self._fd = fd
        self._write_fd = write_fd
        self._mmap = mapping
        self._writer: WriteMapping | None = None  # made at the first put whose slots are whole pages
        self._writer_failed = False
        self._keyed: WriteMapping | None = None  # made at the first put that copies its own bytes
        self._keyed_failed = False
        #: False: puts that copy their own bytes switch page protection per put like the
        #: others (the A/B of tools/bench_pool.py --put-ab); True uses a key where there is one
        self.keyed_puts = True
        #: False: such puts without a key switch all their pages at once around the copy
        #: instead of in pieces while it runs (``kvpool.core.put_pipeline``; the A/B again)
        self.pipelined_puts = True
        self._writer_lock = threading.Lock()
        self.view = np.frombuffer(mapping, dtype=np.uint8)[:capacity_bytes]
        #: the kernel's page size of the arena's memory: 4 KiB (mmap.PAGESIZE), or the huge
        #: page size of a hugetlb memfd (its st_blksize); put windows are made of whole pages
        blksize = os.fstat(fd).st_blksize
        self.page_bytes = blksize if blksize > mmap.PAGESIZE and blksize & (blksize - 1) == 0 else mmap.PAGESIZE

    def adopt_page_bytes(self, page_bytes: int) -> None:
        """Take the page size the node says its arena is on, where it is larger than the one
        this mapping found: a transparent huge page's file reports 4 KiB (``storage/thp.py``),
        and a put window that covers part of a huge page makes the kernel split its mapping
        into 4 KiB entries (slow to switch again). 0 (a node that does not say), or a size that
        is not a power of two of at least the base page or is past ``MAX_PAGE_BYTES``, changes
        nothing."""
        if self._can_adopt(page_bytes):
            self.page_bytes = page_bytes

    def _can_adopt(self, page_bytes: int) -> bool:
        return (
            self.page_bytes < page_bytes <= MAX_PAGE_BYTES
            and page_bytes % mmap.PAGESIZE == 0
            and page_bytes & (page_bytes - 1) == 0
        )

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran (a client that reconnected to a restarted daemon replaced it)."""
        return self._fd < 0

    @property
    def huge_pages(self) -> bool:
        """Whether the arena is on huge pages (``page_bytes`` above the base page size)."""
        return self.page_bytes > mmap.PAGESIZE

    @classmethod
    def from_fd(cls, fd: int, capacity_bytes: int, name: str = "") -> ArenaMapping:
        """Map an arena descriptor received from the daemon read-only (the view is a
        read-only array); takes ownership of ``fd``. ``name``: where it came from (its
        ``path``, never unlinked: the client does not own it)."""
        try:
            check_size(fd, capacity_bytes, "the arena handed over")
            mapping = mmap.mmap(fd, capacity_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        return ArenaMapping(name, capacity_bytes, fd, mapping)

    @classmethod
    def attach(cls, path: str, capacity_bytes: int) -> ArenaMapping:
        """Map an existing arena file (a same-host client of a node without the hand-off):
        read-only, with the file's descriptor kept for put windows."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise Unavailable(
                f"cannot open the pool's arena {path}: {exc}",
                hint="the client must run on the daemon's host, as a user that can read it",
            ) from exc
        try:
            check_size(fd, capacity_bytes, f"arena {path}")
            mapping = mmap.mmap(fd, capacity_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        return ArenaMapping(path, capacity_bytes, fd, mapping, write_fd=fd)

    def adopt_write_fd(self, fd: int) -> None:
        """Keep ``fd`` (the read-write descriptor a node handed this client for a put) for
        this and later puts' windows; takes ownership. Nothing is mapped writable here."""
        try:
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
                raise Unavailable("the node handed over a descriptor that is not read-write")
            check_size(fd, self.capacity_bytes, "the writable arena handed over")
        except BaseException:
            os.close(fd)
            raise
        self._drop_writer()
        if self._write_fd >= 0 and self._write_fd != self._fd:
            os.close(self._write_fd)
        self._write_fd = fd

    @property
    def can_write(self) -> bool:
        """Whether this client holds a descriptor it can open put windows with."""
        return self._write_fd >= 0

    def ensure(self, offsets: Sequence[int], generations: Sequence[int], put_id: int = 0) -> None:
        """Make the bytes at ``offsets`` readable (and, with ``put_id``, writable through a put
        window): nothing to do for a one-piece arena, mapped whole. A per-tenant arena
        (``kvpool.core.arena_segments``) maps the segments they lie in here."""

    def put_window(self, offsets: Sequence[int], length: int, own_copy: bool = False) -> PutWindow:
        """The pages that ``[offset, offset + length)`` of each offset covers made writable,
        and nothing else; close it (``with``) as soon as the bytes are in. Slots of whole
        pages get pages of the kept ``WriteMapping`` (``ProtectedWindow``), others a
        mapping of their own (``PutWindow``), as do all where ``mprotect`` cannot be used.
        ``own_copy``: the caller writes only inside ``window.writing()``, from that thread
        (``write_rows``): the window is then on the keyed mapping where keys exist here.
        Never for bytes an engine writes (its copy may run on threads of its own)."""
        if self._write_fd < 0:
            raise Unavailable("this arena mapping has no write descriptor", hint="ask the node for one with a put id")
        page = self.page_bytes
        if length % page == 0 and not (np.asarray(offsets, dtype=np.int64) % page).any():
            keyed = self._keyed_writer() if own_copy and self.keyed_puts else None
            writer = keyed or self._kept_writer()
            # on huge pages a whole window switches 512x fewer entries: cheaper than the pieces'
            # hand-offs (put 4 MiB 1.48x the copy whole, 1.32x in pieces, interleaved)
            pipelined = own_copy and self.pipelined_puts and keyed is None and page <= mmap.PAGESIZE
            # pieces are shut by the bytes written into them: each slot must be written once
            pipelined = pipelined and len(offsets) * length > PUT_PIECE_BYTES and len(set(offsets)) == len(offsets)
            if writer is not None and pipelined:
                from kvpool.core.put_pipeline import PipelinedWindow  # it extends ProtectedWindow

                return PipelinedWindow(writer, self.capacity_bytes, offsets, length, page, PUT_PIECE_BYTES)
            if writer is not None:
                return ProtectedWindow(writer, self.capacity_bytes, offsets, length, page)
        return PutWindow(self._write_fd, self.capacity_bytes, offsets, length, page)

    def _kept_writer(self) -> WriteMapping | None:
        """The ``WriteMapping`` of this arena, made at the first call; None where it cannot
        be made (no ``mprotect`` here, or it failed once: logged, windows from then on)."""
        with self._writer_lock:
            if self._writer is None and not self._writer_failed and can_protect():
                try:
                    self._writer = WriteMapping(self._write_fd, self.capacity_bytes, self.page_bytes)
                except (OSError, Unavailable) as exc:
                    self._writer_failed = True
                    log.warning("puts map a window each (the kept write mapping failed: %s)", exc)
            return self._writer

    def _keyed_writer(self) -> WriteMapping | None:
        """The keyed ``WriteMapping`` of this arena, made at the first call; None where no
        protection key can be had (no PKU, or all 15 taken: logged once) or it failed."""
        with self._writer_lock:
            if self._keyed is None and not self._keyed_failed and can_protect():
                key = allocate_key()
                try:
                    if key is None:
                        raise OSError("no memory protection key available (no PKU here, or all 15 in use)")
                    self._keyed = WriteMapping(self._write_fd, self.capacity_bytes, self.page_bytes, key)
                except (OSError, Unavailable) as exc:
                    if key is not None:
                        key.free()
                    self._keyed_failed = True
                    log.info("puts switch page protection per put (%s)", exc)
            return self._keyed

    def _drop_writer(self) -> None:
        with self._writer_lock:
            writers = (self._writer, self._keyed)
            self._writer = self._keyed = None
        for writer in writers:
            if writer is not None:
                writer.close()  # unmapped once the last open window shuts

    @property
    def fd(self) -> int:
        return self._fd

    @property
    def writable(self) -> bool:
        """Whether ``view`` is writable: only the daemon's (the owner's) is."""
        return bool(self.view.flags.writeable)

    def region(self, offset: int, length: int) -> np.ndarray:
        """A uint8 view of [offset, offset + length) with bounds checked."""
        if offset < 0 or length < 0 or offset + length > self.capacity_bytes:
            raise InvalidArgument(f"arena region [{offset}, {offset + length}) is outside 0..{self.capacity_bytes}")
        return self.view[offset : offset + length]

    def close(self) -> None:
        """Unmap and close the descriptors. Views handed out must be dropped first."""
        if self._fd < 0:
            return
        self.view = np.empty(0, dtype=np.uint8)
        close_mapping(self._mmap)
        self._drop_writer()
        if self._write_fd >= 0 and self._write_fd != self._fd:
            os.close(self._write_fd)
        self._write_fd = -1
        os.close(self._fd)
        self._fd = -1


class PutWindow:
    """Writable mappings of only the pages a put's slots cover (``ArenaMapping.put_window``).

    Slots are grouped into runs of overlapping or adjacent page ranges, one ``MAP_SHARED``
    ``PROT_WRITE`` mapping per run (``MAP_POPULATE``: one fault pass, not one per page).
    ``window[start:stop] = src`` writes arena bytes ``[start, stop)``, which must lie in one
    slot given at creation (``InvalidArgument`` otherwise). ``close`` unmaps everything.
    Where a slot does not start or end on a page boundary, its first and last pages are
    shared with its neighbours and are writable too: pages are the kernel's unit, and on a
    huge-page arena (``page_bytes`` 2 MiB) that is every slot in the same 2 MiB.
    """

    def __init__(
        self,
        fd: int | Callable[[int], int],
        capacity_bytes: int,
        offsets: Sequence[int],
        length: int,
        page_bytes: int = mmap.ALLOCATIONGRANULARITY,
        segment_bytes: int = 0,
    ) -> None:
        """``fd``: the write descriptor of the arena, or, for a per-tenant arena of
        ``segment_bytes`` segments, a function from a segment to its write descriptor (a
        run of pages then never spans two segments, and maps its segment's file)."""
        ranges = page_runs(capacity_bytes, offsets, length, page_bytes, segment_bytes)
        self._fd = fd
        self._starts = [start for start, _ in ranges]
        self._runs: list[tuple[int, int, mmap.mmap | None, np.ndarray]] = []
        self._slots = np.unique(np.asarray(offsets, dtype=np.int64))  # sorted
        self._length = length
        #: each segment is its own mapping (0: one arena file); writers break runs there
        self.segment_bytes = segment_bytes
        try:
            for start, stop in ranges:
                self._runs.append((start, stop, *self._open_run(start, stop)))
        except BaseException:
            self.close()
            raise

    def _open_run(self, start: int, stop: int) -> tuple[mmap.mmap | None, np.ndarray]:
        """Make arena bytes ``[start, stop)`` (whole pages) writable: a mapping of its own."""
        seg = start // self.segment_bytes if self.segment_bytes else 0
        fd = self._fd
        mapping = mmap.mmap(
            fd if isinstance(fd, int) else fd(seg),
            stop - start,
            mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
            mmap.PROT_READ | mmap.PROT_WRITE,
            offset=start - seg * self.segment_bytes,
        )
        return mapping, np.frombuffer(mapping, dtype=np.uint8)

    def _close_run(self, start: int, stop: int, mapping: mmap.mmap | None) -> None:
        assert mapping is not None
        close_mapping(mapping)

    def writing(self, start: int = -1, stop: int = -1) -> AbstractContextManager[None]:
        """Wrap each write into this window (all of them on the calling thread), of arena
        bytes ``[start, stop)``: needed for a window on a keyed mapping and for a pipelined
        one (``put_window(own_copy=True)``), a no-op for the others."""
        return nullcontext()

    @property
    def mapped_bytes(self) -> int:
        return sum(stop - start for start, stop, _, _ in self._runs)

    def view_of(self, start: int, stop: int) -> np.ndarray:
        """The writable bytes ``[start, stop)``: one slot of this put, a prefix of one, or
        whole slots that follow one another (a run the client copies in one call);
        ``InvalidArgument`` for anything else."""
        start, stop = int(start), int(stop)
        whole = (stop - start) // self._length if stop - start > self._length else 1
        wanted = start + self._length * np.arange(whole, dtype=np.int64)
        at = np.searchsorted(self._slots, wanted)
        slots_ok = (
            stop > start
            and bool((at < self._slots.size).all())
            and (self._slots[at % self._slots.size] == wanted).all()
        )
        if not slots_ok or stop - start > whole * self._length:
            raise InvalidArgument(f"arena bytes [{start}, {stop}) are not slots of this put")
        run_start, run_stop, _, view = self._runs[bisect.bisect_right(self._starts, start) - 1]
        if stop > run_stop:  # slots in two runs are never adjacent, but say so if they are
            raise InvalidArgument(f"arena bytes [{start}, {stop}) span two mappings of this put")
        return view[start - run_start : stop - run_start]

    def __setitem__(self, where: slice, value: np.ndarray) -> None:
        self.view_of(where.start, where.stop)[:] = value

    def close(self) -> None:
        """Close every run (all of them, even when one fails; the first error is raised)."""
        error: BaseException | None = None
        while self._runs:
            start, stop, mapping, view = self._runs.pop()
            del view  # the last reference to the run's array: its buffer export ends here
            try:
                self._close_run(start, stop, mapping)
            except BaseException as exc:  # the rest must still be closed
                error = error or exc
        if error is not None:
            raise error

    def __enter__(self) -> PutWindow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ProtectedWindow(PutWindow):
    """A ``PutWindow`` whose runs are pages of the client's one ``WriteMapping``, made
    writable for this put and ``PROT_NONE`` again at ``close``: the same pages writable for
    the same time as a window of its own, without faulting them in and tearing them down on
    every put (``ArenaMapping.put_window`` uses it where slots are whole pages)."""

    def __init__(
        self, writer: WriteMapping, capacity_bytes: int, offsets: Sequence[int], length: int, page_bytes: int
    ) -> None:
        self._writer = writer
        super().__init__(-1, capacity_bytes, offsets, length, page_bytes)

    def _open_run(self, start: int, stop: int) -> tuple[mmap.mmap | None, np.ndarray]:
        return None, self._writer.open(start, stop)

    def _close_run(self, start: int, stop: int, mapping: mmap.mmap | None) -> None:
        self._writer.shut(start, stop)

    def writing(self, start: int = -1, stop: int = -1) -> AbstractContextManager[None]:
        return self._writer.writing()


class WriteMapping:
    """The whole arena mapped once, shared, and ``PROT_NONE`` except over the pages of puts
    being written (``open`` / ``shut``, whole pages). Pages keep their page-table entries
    while shut, so opening them again only switches their protection; a page's first open
    also populates its entries in one call (``MADV_POPULATE_WRITE``, Linux 5.14+: a fault
    per 4 KiB page costs ~3 us here, several times the copy of the page).

    With a ``key`` the pages are read-write and tagged with that protection key once, and
    ``open`` / ``shut`` change nothing: every thread is denied the key except inside
    ``writing()``, which opens it to the calling thread only (``kvpool.core.pkeys``).

    Safe for puts of many threads: a page is shut only when no open window covers it (two
    puts' slots never share a page, but a put reclaimed after ``put_ttl_ms`` can still be
    writing a slot the node has since given to another put of this client). ``close``
    refuses new opens at once and unmaps when the last open window shuts; the mapping holds
    its own descriptor. Not inherited by a forked child (``MADV_DONTFORK``)."""

    def __init__(self, fd: int, capacity_bytes: int, page_bytes: int, key: ProtectionKey | None = None) -> None:
        self._page_bytes = page_bytes
        self._key = key  # freed with the mapping
        mapped_bytes = -(-capacity_bytes // page_bytes) * page_bytes  # a huge-page file is rounded up too
        self._fd = os.dup(fd)
        try:
            self._mmap = mmap.mmap(self._fd, mapped_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self._fd)
            raise
        try:
            self.view = np.frombuffer(self._mmap, dtype=np.uint8)
            self._address = int(self.view.ctypes.data)
            if key is None:
                self._mprotect(0, mapped_bytes, PROT_NONE)  # nothing was touched while it was writable
            else:  # denied to every thread from here on; nothing touched it before
                key.tag(self._address, mapped_bytes, mmap.PROT_READ | mmap.PROT_WRITE)
                # a process has 15 keys: give this one back when the pages are gone, even where
                # the client is dropped unclosed (CPython runs an mmap's weakref callbacks after
                # its munmap, so nothing is tagged with the key by then; free is idempotent)
                weakref.finalize(self._mmap, key.free)
            self._mmap.madvise(mmap.MADV_DONTFORK)
        except BaseException:
            self.view = np.empty(0, dtype=np.uint8)
            close_mapping(self._mmap)
            os.close(self._fd)
            raise
        self._pid = os.getpid()  # a forked child does not have the mapping (MADV_DONTFORK)
        self._populated = np.zeros(mapped_bytes // page_bytes, dtype=np.bool_)  # one byte per page
        self._open_runs: dict[tuple[int, int], int] = {}  # (start, stop) -> open windows with it
        self._lock = threading.Lock()
        self._closed = False
        self._helper: ThreadPoolExecutor | None = None  # made by the first pipelined put

    def _mprotect(self, start: int, stop: int, prot: int) -> None:
        if _libc.mprotect(self._address + start, stop - start, prot) != 0:
            err = ctypes.get_errno()
            raise Unavailable(f"mprotect of arena bytes [{start}, {stop}) failed: {os.strerror(err)}")

    def open(self, start: int, stop: int) -> np.ndarray:
        """Make ``[start, stop)`` (whole pages) writable and return it; ``Unavailable`` once closed."""
        with self._lock:
            if self._closed:
                raise Unavailable("the arena mapping was closed during this put (the client reconnected)")
            if os.getpid() != self._pid:  # its address may hold anything in the child
                raise Unavailable(
                    "this client's arena write mapping is not inherited by a forked child",
                    hint="connect a new client in the child process",
                )
            if self._key is None:
                self._mprotect(start, stop, mmap.PROT_READ | mmap.PROT_WRITE)
            self._open_runs[(start, stop)] = self._open_runs.get((start, stop), 0) + 1
            first, last = start // self._page_bytes, stop // self._page_bytes
            fresh = not self._populated[first:last].all()
            self._populated[first:last] = True
        if fresh:  # fails on a kernel before 5.14: the copy then faults the pages in one by one
            with self.writing():  # the kernel checks the key of the thread that populates
                _libc.madvise(self._address + start, stop - start, MADV_POPULATE_WRITE)
        return self.view[start:stop]

    def helper(self) -> ThreadPoolExecutor:
        """The one thread that switches pieces of pipelined puts while their copies run
        (``kvpool.core.put_pipeline``), in the order asked; joined by ``close``. Once made it is
        returned without the lock, which the helper holds through each switch: a new put's
        window must not wait out another put's switch to start (a helper shut down meanwhile
        refuses the window's first submit, which the window reports as ``Unavailable``)."""
        helper = self._helper
        if helper is not None and not self._closed:
            return helper
        with self._lock:
            if self._closed:
                raise Unavailable("the arena mapping was closed during this put (the client reconnected)")
            if self._helper is None:
                self._helper = ThreadPoolExecutor(1, thread_name_prefix="kvpool-put-window")
            return self._helper

    def writing(self) -> AbstractContextManager[None]:
        """Around the writes into opened pages: opens the key to the calling thread (keyed), or nothing."""
        return nullcontext() if self._key is None else self._key.open()

    def shut(self, start: int, stop: int) -> None:
        """Make ``[start, stop)`` inaccessible again (a write is a SIGSEGV from now on), but
        for pages another open window still covers."""
        with self._lock:
            count = self._open_runs.pop((start, stop), 0)
            if count > 1:
                self._open_runs[(start, stop)] = count - 1
            pieces = [(start, stop)]
            for lo, hi in self._open_runs:  # cut out what other open windows hold
                pieces = [part for a, b in pieces for part in ((a, min(b, lo)), (max(a, hi), b)) if part[0] < part[1]]
            for a, b in pieces if self._key is None else ():
                self._mprotect(a, b, PROT_NONE)
            if self._closed and not self._open_runs:
                self._unmap()

    def close(self) -> None:
        """No new opens; unmap now, or when the last open window shuts. The helper thread
        runs what was queued (opens now refused, shuts done) and is joined."""
        with self._lock:
            self._closed = True
            helper, self._helper = self._helper, None
            if not self._open_runs:
                self._unmap()
        if helper is not None:  # outside the lock: its queued switches take it
            helper.shutdown(wait=True)

    def _unmap(self) -> None:
        if self._fd < 0:
            return
        self.view = np.empty(0, dtype=np.uint8)
        close_mapping(self._mmap)
        os.close(self._fd)
        self._fd = -1
        if self._key is not None and self._mmap.closed:  # its pages are gone: nothing is tagged with it
            self._key.free()  # (still mapped while a view lives: then kept, never reused, for the process)


PROT_NONE = 0
MADV_POPULATE_WRITE = 23  # Linux 5.14+; not in Python 3.11's mmap module


class _Libc:
    """libc's ``mprotect`` and ``madvise`` through ctypes (Linux), or ``usable`` False where
    they cannot be called: puts then map a window of their own (``PutWindow``)."""

    def __init__(self) -> None:
        self.usable = False
        libc = linux_libc()
        if libc is None:
            return
        self.mprotect = libc.mprotect
        self.madvise = libc.madvise
        for function in (self.mprotect, self.madvise):
            function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            function.restype = ctypes.c_int
        self.usable = True


_libc = _Libc()


def can_protect() -> bool:
    """Whether puts can use ``ProtectedWindow`` here."""
    return _libc.usable


def madvise(address: int, length: int, advice: int) -> int:
    """libc's ``madvise`` on ``[address, address + length)``: 0, or the errno it failed with
    (``ENOSYS`` where libc cannot be called here)."""
    if not _libc.usable:
        return errno.ENOSYS
    return 0 if _libc.madvise(address, length, advice) == 0 else ctypes.get_errno()


def page_runs(
    capacity_bytes: int, offsets: Sequence[int], length: int, page_bytes: int, segment_bytes: int = 0
) -> list[tuple[int, int]]:
    """The page ranges ``[start, stop)`` that slots of ``length`` bytes at ``offsets``
    cover, overlapping or adjacent ones merged (never across a segment edge);
    ``InvalidArgument`` for a slot outside the arena."""
    page = page_bytes
    off = np.sort(np.asarray(offsets, dtype=np.int64))
    if off.size == 0:
        return []
    bad = (off < 0) | (off + length > capacity_bytes) if length > 0 else np.ones(off.size, dtype=np.bool_)
    if bad.any():
        offset = int(off[np.argmax(bad)])
        raise InvalidArgument(f"arena slot [{offset}, {offset + length}) is outside 0..{capacity_bytes}")
    starts = off - off % page
    stops = np.minimum(-(-(off + length) // page) * page, capacity_bytes)
    # a slot opens a new run where it starts past every page before it, or in another segment
    # (numpy, not a loop per slot: a put of 16 KiB blocks has thousands)
    opens = np.ones(off.size, dtype=np.bool_)
    opens[1:] = starts[1:] > np.maximum.accumulate(stops)[:-1]
    if segment_bytes:
        opens[1:] |= starts[1:] // segment_bytes != starts[:-1] // segment_bytes
    first = np.flatnonzero(opens)
    return list(zip(starts[first].tolist(), np.maximum.reduceat(stops, first).tolist(), strict=True))


def close_mapping(mapping: mmap.mmap) -> None:
    """Unmap ``mapping`` now, or, while a numpy view still exports its buffer, when the last
    view dies (``BufferError`` here)."""
    try:
        mapping.close()
    except BufferError:
        pass


def check_size(fd: int, capacity_bytes: int, what: str) -> None:
    """``Unavailable`` when the file behind ``fd`` is shorter than the arena it should hold
    (a mapping past its end is SIGBUS on first touch)."""
    size = os.fstat(fd).st_size
    if size < capacity_bytes:
        raise Unavailable(f"{what} is {size} bytes, expected {capacity_bytes}")


__all__ = [
    "ArenaMapping",
    "ProtectedWindow",
    "PutWindow",
    "WriteMapping",
    "can_protect",
    "check_size",
    "close_mapping",
    "madvise",
    "page_runs",
]
