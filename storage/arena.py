"""One shared-memory arena per node: a file in /dev/shm, mapped by the daemon and by
every same-host client, so block bytes move with one memcpy and never through gRPC.

The daemon creates it (``SharedArena.create``) and removes the file on close; clients
map the same file by path (``SharedArena.attach``).

Guarantees (tests: ``tests/unit/test_arena_capacity.py``,
``tests/integration/test_arena_capacity_daemon.py``):

- an arena larger than the machine can hold is refused before anything is created:
  ``capacity_bytes`` must fit both in ``MemAvailable`` (``/proc/meminfo``) and in the free
  space of the arena directory's filesystem (``statvfs``), else ``CapacityExhausted``
  names the numbers and what to do;
- every page of the arena file is reserved up front (``posix_fallocate``): a store on a
  mapped file whose filesystem is full is a SIGBUS in whichever process touches the page
  (a client's memcpy), with no Python error; with the pages reserved at start that cannot
  happen. The reservation costs its memory at start (tmpfs pages are allocated, zeroed)
  and the time to zero them (``docs/tiers.md``);
- ``allow_overcommit=True`` is the explicit way out: a shortfall is logged as a warning
  and the file stays sparse (pages come lazily, and a client may get SIGBUS when the
  filesystem runs out).

Or, with the arena hand-off (``kvpool.daemon.arena_handoff``), it is an anonymous memfd
(``create_memfd``: no path any process can open, checked against ``MemAvailable`` and
reserved the same way, its size sealed so no holder can shrink it under the daemon) whose
descriptors reach only admitted clients (``from_fd``): a read-only one (``read_only_fd``: a
mapping of it cannot be made writable) or the read-write one.

With ``huge_pages=True`` the memfd is ``MFD_HUGETLB``: the arena lives on the host's reserved
huge pages (2 MiB on x86-64; ``/proc/sys/vm/nr_hugepages``), which a copy out of it reads
as fast as private memory on transparent huge pages, where 4 KiB-page shared memory is
slower (docs/benchmarks.md). There must be enough free reserved pages for the whole arena
(``HugePages_Free``): they are taken up front, else ``HugePagesUnavailable`` says how many
to reserve and the daemon falls back to 4 KiB pages or refuses (``--arena-huge-pages``,
``tests/integration/test_arena_huge_pages.py``). ``page_bytes`` says which it got.

A client's ``view`` is always a **read-only** mapping, whichever way it got the arena
(``tests/integration/test_arena_mapping.py``). It writes only through a ``PutWindow``
(``put_window``): writable mappings of just the pages its put's slots cover, made from the
write descriptor (the file itself, or the one a node hands a put's holder) and unmapped
when the put's bytes are in. A stray write anywhere else, or after the put, is a SIGSEGV in
the client, never a change to another block.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import logging
import mmap
import os
import pathlib
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.core.errors import CapacityExhausted, InvalidArgument, StorageFault, Unavailable

log = logging.getLogger("kvpool.arena")

MEMINFO_PATH = "/proc/meminfo"
OVERCOMMIT_HINT = (
    "lower --capacity-bytes, or pass --allow-overcommit to start anyway (clients may then die with SIGBUS)"
)


def available_memory_bytes(meminfo_path: str = MEMINFO_PATH) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes: the kernel's estimate of what can be
    allocated without swapping. None where the file or the field is missing (not Linux,
    kernels before 3.14), so the check is skipped rather than guessed."""
    try:
        with open(meminfo_path, encoding="ascii") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name == "MemAvailable":
                    value, _, unit = rest.strip().partition(" ")
                    return int(value) * (1024 if unit.strip().lower() == "kb" else 1)
    except (OSError, ValueError):
        return None
    return None


class HugePagesUnavailable(CapacityExhausted):
    """The host cannot back a huge-page arena now (no reserved pages free, or too few)."""


@dataclass(frozen=True)
class HugePageRoom:
    """The host's reserved huge pages, from ``/proc/meminfo``."""

    page_bytes: int  # Hugepagesize
    total_pages: int  # HugePages_Total (nr_hugepages)
    free_pages: int  # HugePages_Free: reserved and not in use

    @classmethod
    def measure(cls, meminfo_path: str = MEMINFO_PATH) -> HugePageRoom:
        fields: dict[str, int] = {}
        try:
            with open(meminfo_path, encoding="ascii") as fh:
                for line in fh:
                    name, _, rest = line.partition(":")
                    if name in ("Hugepagesize", "HugePages_Total", "HugePages_Free"):
                        fields[name] = int(rest.split()[0])
        except (OSError, ValueError, IndexError):
            pass
        return cls(
            fields.get("Hugepagesize", 0) * 1024, fields.get("HugePages_Total", 0), fields.get("HugePages_Free", 0)
        )

    @property
    def free_bytes(self) -> int:
        return self.free_pages * self.page_bytes

    def pages_for(self, capacity_bytes: int) -> int:
        return -(-capacity_bytes // self.page_bytes) if self.page_bytes else 0


def filesystem_free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer can still allocate on ``directory``'s filesystem
    (``f_bavail``: root's reserve excluded, since the daemon need not run as root)."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def _size(nbytes: int) -> str:
    """'1099511627776 bytes (1.00 TiB)': the exact figure for scripts, the rounded one for people."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{nbytes} bytes ({value:.2f} {unit})"


@dataclass(frozen=True)
class ArenaRoom:
    """What the machine offers an arena in one directory, read once at start."""

    directory: str
    mem_available_bytes: int | None  # None: the kernel does not say (check skipped)
    fs_free_bytes: int

    @classmethod
    def measure(cls, directory: str, meminfo_path: str = MEMINFO_PATH) -> ArenaRoom:
        return cls(directory, available_memory_bytes(meminfo_path), filesystem_free_bytes(directory))

    def shortfalls(self, capacity_bytes: int) -> list[str]:
        """Each limit ``capacity_bytes`` exceeds, as a phrase naming it; empty when it fits."""
        out: list[str] = []
        if self.mem_available_bytes is not None and capacity_bytes > self.mem_available_bytes:
            out.append(f"available memory (MemAvailable {_size(self.mem_available_bytes)})")
        if capacity_bytes > self.fs_free_bytes:
            out.append(f"the free space of {self.directory} ({_size(self.fs_free_bytes)})")
        return out

    def most_bytes(self) -> int:
        """The largest arena that passes the check here."""
        limits = [self.fs_free_bytes] + ([self.mem_available_bytes] if self.mem_available_bytes is not None else [])
        return min(limits)


class SharedArena:
    """A mapped shared-memory file, exposed as one flat uint8 numpy array (``view``)."""

    def __init__(
        self, path: str, capacity_bytes: int, owner: bool, fd: int, mapping: mmap.mmap, write_fd: int = -1
    ) -> None:
        """``fd``: what ``mapping`` was made from; ``write_fd``: a client's descriptor that
        may be mapped writable for a put (``put_window``), -1 while it has none (``fd`` itself
        when it is read-write: the client maps it read-only all the same)."""
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.owner = owner
        self._fd = fd
        self._write_fd = write_fd
        self._mmap = mapping
        self.view = np.frombuffer(mapping, dtype=np.uint8)[:capacity_bytes]
        #: the kernel's page size of the arena's memory: 4 KiB (mmap.PAGESIZE), or the huge
        #: page size of a hugetlb memfd (its st_blksize); put windows are made of whole pages
        blksize = os.fstat(fd).st_blksize
        self.page_bytes = blksize if blksize > mmap.PAGESIZE and blksize & (blksize - 1) == 0 else mmap.PAGESIZE

    @property
    def huge_pages(self) -> bool:
        """Whether the arena is on huge pages (``page_bytes`` above the base page size)."""
        return self.page_bytes > mmap.PAGESIZE

    @classmethod
    def create(
        cls,
        directory: str,
        capacity_bytes: int,
        name_hint: str = "kvpool",
        *,
        allow_overcommit: bool = False,
        meminfo_path: str = MEMINFO_PATH,
    ) -> SharedArena:
        """Create a new arena file of ``capacity_bytes`` under ``directory`` (normally /dev/shm),
        after checking the machine can hold it, and reserve its pages (module docstring)."""
        if capacity_bytes <= 0:
            raise InvalidArgument("arena capacity_bytes must be positive")
        folder = pathlib.Path(directory)
        if not folder.is_dir():
            raise StorageFault(f"arena directory {directory} does not exist", hint="use --arena-dir /dev/shm")
        room = ArenaRoom.measure(directory, meminfo_path)
        shortfalls = room.shortfalls(capacity_bytes)
        if shortfalls and not allow_overcommit:
            raise CapacityExhausted(
                f"arena of {_size(capacity_bytes)} exceeds {' and '.join(shortfalls)}",
                hint=f"{OVERCOMMIT_HINT}; at most {_size(room.most_bytes())} fits here",
            )
        if shortfalls:
            log.warning(
                "arena of %s exceeds %s; starting anyway (--allow-overcommit): pages are not reserved, "
                "and a client writing a page the machine cannot back dies with SIGBUS",
                _size(capacity_bytes),
                " and ".join(shortfalls),
            )
        path = str(folder / f"{name_hint}-{os.getpid()}-{uuid.uuid4().hex[:8]}.arena")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise StorageFault(f"cannot create arena file {path}: {exc}", hint="check --arena-dir is writable") from exc
        try:
            os.ftruncate(fd, capacity_bytes)
            if not shortfalls:
                _reserve(fd, path, capacity_bytes)
            mapping = mmap.mmap(fd, capacity_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException as exc:
            os.close(fd)
            os.unlink(path)
            if isinstance(exc, OSError):
                raise StorageFault(
                    f"cannot map a {capacity_bytes}-byte arena at {path}: {exc}",
                    hint="lower --capacity-bytes or enlarge /dev/shm",
                ) from exc
            raise
        return cls(path, capacity_bytes, True, fd, mapping)

    @classmethod
    def create_memfd(
        cls,
        capacity_bytes: int,
        name_hint: str = "kvpool",
        *,
        allow_overcommit: bool = False,
        meminfo_path: str = MEMINFO_PATH,
        huge_pages: bool = False,
    ) -> SharedArena:
        """A new arena in an anonymous memfd (no file name to open), sealed against shrinking
        and growing: a client that holds its descriptor cannot make the daemon's pages vanish
        (SIGBUS) by truncating it. Checked against ``MemAvailable`` and reserved up front like
        ``create`` (a memfd's pages are shared memory)."""
        if capacity_bytes <= 0:
            raise InvalidArgument("arena capacity_bytes must be positive")
        if huge_pages:
            return cls._create_huge_memfd(capacity_bytes, name_hint, meminfo_path)
        available = available_memory_bytes(meminfo_path)
        short = available is not None and capacity_bytes > available
        if short and not allow_overcommit:
            raise CapacityExhausted(
                f"arena of {_size(capacity_bytes)} exceeds available memory (MemAvailable {_size(available or 0)})",
                hint=OVERCOMMIT_HINT,
            )
        try:
            fd = os.memfd_create(f"{name_hint}-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise StorageFault(f"cannot create a memfd arena: {exc}", hint="use --arena-handoff file") from exc
        try:
            os.ftruncate(fd, capacity_bytes)
            if not short:
                _reserve(fd, f"memfd:{name_hint}-arena", capacity_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mapping = mmap.mmap(fd, capacity_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            raise StorageFault(f"cannot map a {capacity_bytes}-byte memfd arena: {exc}") from exc
        return cls("", capacity_bytes, True, fd, mapping)

    @classmethod
    def _create_huge_memfd(cls, capacity_bytes: int, name_hint: str, meminfo_path: str) -> SharedArena:
        """``create_memfd`` on reserved huge pages: every page taken now (a hugetlb page that
        cannot be had at fault time is a SIGBUS, so there is no overcommit here), the file
        rounded up to whole pages, sealed like the 4 KiB one."""
        room = HugePageRoom.measure(meminfo_path)
        need = room.pages_for(capacity_bytes)
        hint = (
            f"reserve them as root: echo {room.total_pages - room.free_pages + need} > /proc/sys/vm/nr_hugepages "
            "(or vm.nr_hugepages in sysctl.conf), or run with --arena-huge-pages off"
        )
        if not room.page_bytes or room.free_pages < need:
            raise HugePagesUnavailable(
                f"a huge-page arena of {_size(capacity_bytes)} needs {need} free huge pages of "
                f"{_size(room.page_bytes)}; the host has {room.free_pages} free of {room.total_pages} reserved",
                hint=hint,
            )
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB
        try:
            fd = os.memfd_create(f"{name_hint}-arena", flags)
        except OSError as exc:
            raise HugePagesUnavailable(f"cannot create a huge-page memfd: {exc}", hint=hint) from exc
        try:
            file_bytes = need * room.page_bytes
            os.ftruncate(fd, file_bytes)
            try:
                os.posix_fallocate(fd, 0, file_bytes)
            except OSError as exc:  # another process took the pages between the check and here
                raise HugePagesUnavailable(
                    f"cannot take {need} huge pages for the arena: {exc.strerror}", hint=hint
                ) from None
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mapping = mmap.mmap(fd, file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                raise StorageFault(f"cannot map a {capacity_bytes}-byte huge-page arena: {exc}") from exc
            raise
        log.info("arena: %s on %d huge pages of %s", _size(capacity_bytes), need, _size(room.page_bytes))
        return cls("", capacity_bytes, True, fd, mapping)

    @classmethod
    def from_fd(cls, fd: int, capacity_bytes: int, name: str = "") -> SharedArena:
        """Map an arena descriptor received from the daemon read-only (the view is a
        read-only array); takes ownership of ``fd``. ``name``: where it came from (its
        ``path``, never unlinked: the client does not own it)."""
        try:
            _check_size(fd, capacity_bytes, "the arena handed over")
            mapping = mmap.mmap(fd, capacity_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, capacity_bytes, False, fd, mapping)

    def adopt_write_fd(self, fd: int) -> None:
        """Keep ``fd`` (the read-write descriptor a node handed this client for a put) for
        this and later puts' windows; takes ownership. Nothing is mapped writable here."""
        try:
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
                raise Unavailable("the node handed over a descriptor that is not read-write")
            _check_size(fd, self.capacity_bytes, "the writable arena handed over")
        except BaseException:
            os.close(fd)
            raise
        if self._write_fd >= 0 and self._write_fd != self._fd:
            os.close(self._write_fd)
        self._write_fd = fd

    @property
    def can_write(self) -> bool:
        """Whether this client holds a descriptor it can open put windows with."""
        return self._write_fd >= 0

    def put_window(self, offsets: Sequence[int], length: int) -> PutWindow:
        """Writable mappings of the pages that ``[offset, offset + length)`` of each offset
        covers, and of nothing else; close it (``with``) as soon as the bytes are in."""
        if self._write_fd < 0:
            raise Unavailable("this arena mapping has no write descriptor", hint="ask the node for one with a put id")
        return PutWindow(self._write_fd, self.capacity_bytes, offsets, length, self.page_bytes)

    def read_only_fd(self) -> int:
        """A new descriptor of this arena opened O_RDONLY (through /proc/self/fd): whoever
        receives it can map it only read-only (mmap PROT_WRITE of it is EACCES)."""
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)

    @property
    def fd(self) -> int:
        return self._fd

    @property
    def writable(self) -> bool:
        """Whether ``view`` is writable: only the daemon's (the owner's) is."""
        return bool(self.view.flags.writeable)

    @classmethod
    def attach(cls, path: str, capacity_bytes: int) -> SharedArena:
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
            _check_size(fd, capacity_bytes, f"arena {path}")
            mapping = mmap.mmap(fd, capacity_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, capacity_bytes, False, fd, mapping, write_fd=fd)

    @staticmethod
    def reap_stale(directory: str, name_hint: str = "kvpool") -> list[str]:
        """Remove arena files left by daemons that died without cleaning up (SIGKILL, OOM).

        A file is stale when the pid in its name is no longer alive; each would otherwise
        pin its size of shared memory until reboot.
        """
        removed: list[str] = []
        for path in pathlib.Path(directory).glob(f"{name_hint}-*-*.arena"):
            parts = path.name.split("-")
            if len(parts) < 3 or not parts[1].isdigit():
                continue
            pid = int(parts[1])
            if pid == os.getpid() or _pid_alive(pid):
                continue
            try:
                path.unlink()
                removed.append(str(path))
            except OSError:
                pass  # another user's file, or already gone
        return removed

    def region(self, offset: int, length: int) -> np.ndarray:
        """A uint8 view of [offset, offset + length) with bounds checked."""
        if offset < 0 or length < 0 or offset + length > self.capacity_bytes:
            raise InvalidArgument(f"arena region [{offset}, {offset + length}) is outside 0..{self.capacity_bytes}")
        return self.view[offset : offset + length]

    def close(self) -> None:
        """Unmap; the owner also removes the file. Views handed out must be dropped first."""
        if self._fd < 0:
            return
        self.view = np.empty(0, dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass  # a live numpy view still exports the buffer; the mapping dies with it
        if self._write_fd >= 0 and self._write_fd != self._fd:
            os.close(self._write_fd)
        self._write_fd = -1
        os.close(self._fd)
        self._fd = -1
        if self.owner and self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class PutWindow:
    """Writable mappings of only the pages a put's slots cover (``SharedArena.put_window``).

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
        fd: int,
        capacity_bytes: int,
        offsets: Sequence[int],
        length: int,
        page_bytes: int = mmap.ALLOCATIONGRANULARITY,
    ) -> None:
        page = page_bytes
        ranges: list[tuple[int, int]] = []
        for offset in sorted(offsets):
            if offset < 0 or length <= 0 or offset + length > capacity_bytes:
                raise InvalidArgument(f"arena slot [{offset}, {offset + length}) is outside 0..{capacity_bytes}")
            start, stop = offset - offset % page, min(-(-(offset + length) // page) * page, capacity_bytes)
            if ranges and start <= ranges[-1][1]:
                ranges[-1] = (ranges[-1][0], max(ranges[-1][1], stop))
            else:
                ranges.append((start, stop))
        self._starts = [start for start, _ in ranges]
        self._runs: list[tuple[int, int, mmap.mmap, np.ndarray]] = []
        self._slots = set(offsets)
        self._length = length
        try:
            for start, stop in ranges:
                mapping = mmap.mmap(
                    fd,
                    stop - start,
                    mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                    mmap.PROT_READ | mmap.PROT_WRITE,
                    offset=start,
                )
                self._runs.append((start, stop, mapping, np.frombuffer(mapping, dtype=np.uint8)))
        except BaseException:
            self.close()
            raise

    @property
    def mapped_bytes(self) -> int:
        return sum(stop - start for start, stop, _, _ in self._runs)

    def view_of(self, start: int, stop: int) -> np.ndarray:
        """The writable bytes ``[start, stop)``: one slot of this put, a prefix of one, or
        whole slots that follow one another (a run the client copies in one call);
        ``InvalidArgument`` for anything else."""
        start, stop = int(start), int(stop)
        whole = (stop - start) // self._length if stop - start > self._length else 1
        slots_ok = stop > start and all(start + k * self._length in self._slots for k in range(whole))
        if not slots_ok or stop - start > whole * self._length:
            raise InvalidArgument(f"arena bytes [{start}, {stop}) are not slots of this put")
        run_start, run_stop, _, view = self._runs[bisect.bisect_right(self._starts, start) - 1]
        if stop > run_stop:  # slots in two runs are never adjacent, but say so if they are
            raise InvalidArgument(f"arena bytes [{start}, {stop}) span two mappings of this put")
        return view[start - run_start : stop - run_start]

    def __setitem__(self, where: slice, value: np.ndarray) -> None:
        self.view_of(where.start, where.stop)[:] = value

    def close(self) -> None:
        while self._runs:
            _, _, mapping, view = self._runs.pop()
            del view  # the last reference to the run's array: its buffer export ends here
            try:
                mapping.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping dies with it

    def __enter__(self) -> PutWindow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_size(fd: int, capacity_bytes: int, what: str) -> None:
    size = os.fstat(fd).st_size
    if size < capacity_bytes:
        raise Unavailable(f"{what} is {size} bytes, expected {capacity_bytes}")


def _reserve(fd: int, path: str, capacity_bytes: int) -> None:
    """Allocate every page of the arena file now, so that no store into the mapping can
    fault on a full filesystem later (SIGBUS in a client). Another process may have taken
    the room between the check and here: that is the same typed refusal."""
    started = time.monotonic()
    try:
        os.posix_fallocate(fd, 0, capacity_bytes)
    except OSError as exc:
        folder = os.path.dirname(path)  # "" for a memfd: shared memory, bounded by RAM
        free = filesystem_free_bytes(folder) if folder else (available_memory_bytes(MEMINFO_PATH) or 0)
        raise CapacityExhausted(
            f"cannot reserve an arena of {_size(capacity_bytes)} at {path}: {exc.strerror} (free now: {_size(free)})",
            hint=OVERCOMMIT_HINT,
        ) from None
    log.info("arena %s: %s reserved in %.0f ms", path, _size(capacity_bytes), (time.monotonic() - started) * 1000)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True
