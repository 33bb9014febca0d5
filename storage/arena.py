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

A client maps it as a ``kvpool.core.arena_map.ArenaMapping`` (this class's base, in core so
that the client does not import storage). A client's ``view`` is always a **read-only** mapping,
whichever way it got the arena (``tests/integration/test_arena_mapping.py``). It writes only
through a ``PutWindow``
(``put_window``): writable mappings of just the pages its put's slots cover, made from the
write descriptor (the file itself, or the one a node hands a put's holder) and unmapped
when the put's bytes are in. A stray write anywhere else, or after the put, is a SIGSEGV in
the client, never a change to another block.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import pathlib
import time
import uuid
from dataclasses import dataclass

from kvpool.core.arena_map import ArenaMapping
from kvpool.core.errors import CapacityExhausted, InvalidArgument, StorageFault
from kvpool.storage.thp import HugePagesUnavailable, ShmemThp, huge_share_level, mapped_huge_bytes, take_huge_pages

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


class SharedArena(ArenaMapping):
    """The node's arena: a mapped shared-memory file it creates, reserves and removes; a
    client maps it as a ``kvpool.core.arena_map.ArenaMapping`` (``attach``, ``from_fd``)."""

    def __init__(
        self, path: str, capacity_bytes: int, owner: bool, fd: int, mapping: mmap.mmap, write_fd: int = -1
    ) -> None:
        super().__init__(path, capacity_bytes, fd, mapping, write_fd)
        self.owner = owner
        #: on transparent huge pages of shared memory (``storage/thp.py``), not reserved ones
        self.transparent = False
        #: bytes of the arena on huge pages: all of it on reserved ones, what the kernel gave on transparent ones
        self.huge_bytes = capacity_bytes if self.huge_pages else 0

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
        transparent: ShmemThp | None = None,
    ) -> SharedArena:
        """A new arena in an anonymous memfd (no file name to open), sealed against shrinking
        and growing: a client that holds its descriptor cannot make the daemon's pages vanish
        (SIGBUS) by truncating it. Checked against ``MemAvailable`` and reserved up front like
        ``create`` (a memfd's pages are shared memory). ``huge_pages``: on reserved huge pages;
        ``transparent`` (the host's ``storage.thp.ShmemThp``): on transparent huge pages of
        shared memory, ``HugePagesUnavailable`` where the host gives shared memory none."""
        if capacity_bytes <= 0:
            raise InvalidArgument("arena capacity_bytes must be positive")
        if huge_pages:
            return cls._create_huge_memfd(capacity_bytes, name_hint, meminfo_path)
        if transparent is not None:
            transparent.require()
        available = available_memory_bytes(meminfo_path)
        short = available is not None and capacity_bytes > available
        if short and transparent is not None:  # its pages are taken at start, or it is not on them
            raise transparent_past_memory(capacity_bytes, available or 0)
        if short and not allow_overcommit:
            raise CapacityExhausted(
                f"arena of {_size(capacity_bytes)} exceeds available memory (MemAvailable {_size(available or 0)})",
                hint=OVERCOMMIT_HINT,
            )
        try:
            fd = os.memfd_create(f"{name_hint}-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise StorageFault(f"cannot create a memfd arena: {exc}", hint="use --arena-handoff file") from exc
        # transparent huge pages: the file in whole huge pages, so its last one can be huge too
        page = transparent.page_bytes if transparent is not None else 1
        file_bytes, started = -(-capacity_bytes // page) * page, time.monotonic()
        try:
            os.ftruncate(fd, file_bytes)
            if transparent is not None:
                take_huge_pages(fd, file_bytes, "the arena")
            elif not short:
                _reserve(fd, f"memfd:{name_hint}-arena", capacity_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mapping = mmap.mmap(fd, file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            raise StorageFault(f"cannot map a {capacity_bytes}-byte memfd arena: {exc}") from exc
        except BaseException:  # refused or short of memory (typed already): nothing is left open
            os.close(fd)
            raise
        arena = cls("", capacity_bytes, True, fd, mapping)
        if transparent is not None:
            arena.page_bytes, arena.transparent = transparent.page_bytes, True
            taken = mapped_huge_bytes(int(arena.view.ctypes.data), file_bytes)
            arena.huge_bytes = min(capacity_bytes, taken)
            _log_transparent("the arena", file_bytes, taken, transparent, started)
        return arena

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

    def read_only_fd(self) -> int:
        """A new descriptor of this arena opened O_RDONLY (through /proc/self/fd): whoever
        receives it can map it only read-only (mmap PROT_WRITE of it is EACCES)."""
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)

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

    def close(self) -> None:
        """Unmap; the owner also removes the file. Views handed out must be dropped first."""
        if self._fd < 0:
            return
        super().close()
        if self.owner and self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


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


def _log_transparent(what: str, file_bytes: int, taken: int, transparent: ShmemThp, started: float) -> None:
    """Log how much of a new arena on transparent huge pages got them (a warning below
    ``thp.LOW_HUGE_SHARE``), and how long taking its pages took since ``started``."""
    level, note = huge_share_level(taken / file_bytes)
    log.log(
        level,
        "%s: %s on transparent huge pages (shmem_enabled %s): %.0f %% of it in %d KiB pages, taken in %.0f ms%s",
        what,
        _size(file_bytes),
        transparent.setting,
        taken / file_bytes * 100,
        transparent.page_bytes >> 10,
        (time.monotonic() - started) * 1000,
        note,
    )


def transparent_past_memory(capacity_bytes: int, available_bytes: int) -> HugePagesUnavailable:
    """The refusal of an arena on transparent huge pages larger than ``MemAvailable``: it takes
    every page at start, so ``--allow-overcommit`` (for 4 KiB arenas) cannot apply."""
    return HugePagesUnavailable(
        f"an arena on transparent huge pages takes its {_size(capacity_bytes)} at start; "
        f"MemAvailable is {_size(available_bytes)}",
        hint="lower --capacity-bytes, or run with --arena-huge-pages off (--allow-overcommit applies there)",
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True
