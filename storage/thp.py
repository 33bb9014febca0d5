"""The arena on transparent huge pages of shared memory (``--arena-huge-pages thp``).

Why: on 4 KiB pages a copy out of the arena runs slower than one between private buffers,
and a put without memory protection keys switches the protection of every 4 KiB page its
window covers, which takes a core for as long as the copy (docs/benchmarks.md, "What limits
a put here"). Reserved huge pages (``MFD_HUGETLB``, ``storage/arena.py``) fix both, but the
host must set memory aside for them. Where the kernel gives shared memory transparent huge
pages (``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` is ``advise``, ``within_size``,
``always`` or ``force``), an ordinary memfd mapped with ``MADV_HUGEPAGE`` gets 2 MiB pages
from the common pool instead: nothing reserved, one sysfs setting.

How: the daemon maps the memfd, advises huge pages on its mapping and populates every page
at once (``MADV_POPULATE_WRITE``, Linux 5.14): that is the up-front reservation of the
4 KiB arena (a page that cannot be had is an error at start, not a SIGBUS in a client
later), and under ``advise`` it is the fault that allocates the page with the mapping's
advice, where ``posix_fallocate`` (no mapping) would get 4 KiB pages. Clients map the memfd
as always; the kernel places a shared-memory mapping on a 2 MiB boundary and maps each huge
page whole, with no advice of theirs. The daemon tells clients its page size (Hello's
``arena_page_bytes``), so put windows cover whole 2 MiB pages, as on reserved ones.

Best effort: where memory is fragmented the kernel falls back to 4 KiB pages for some of
the arena; ``huge_bytes`` (read from ``/proc/self/smaps``) says how much got huge pages,
logged at start and shown in Stats and ``kvpool inspect doctor``. Correctness never depends
on it. Refused, so that ``try`` falls back to 4 KiB pages and ``thp`` does not start: a host
whose shared memory gets no transparent huge pages, a kernel that cannot take pages with the
advice (before 5.14), and an arena larger than the memory (``--allow-overcommit``: its pages
could not be taken up front).

Tests: ``tests/unit/test_arena_thp_host.py`` (unprivileged: the machinery on any host, with
the setting given), ``tests/integration/test_arena_thp.py`` (as root: real huge pages).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from kvpool.core.arena_map import MADV_POPULATE_WRITE, madvise
from kvpool.core.errors import CapacityExhausted


class HugePagesUnavailable(CapacityExhausted):
    """The host cannot back a huge-page arena now: no reserved pages free or too few, or no
    transparent huge pages for shared memory (``storage/thp.py``)."""


SYSFS_THP_DIR = "/sys/kernel/mm/transparent_hugepage"
SMAPS_PATH = "/proc/self/smaps"
#: shmem_enabled settings under which a memfd mapped with MADV_HUGEPAGE gets huge pages
THP_SHMEM_ON = ("advise", "within_size", "always", "force")
MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22  # Linux 5.14+, as MADV_POPULATE_WRITE
THP_ON_COMMAND = "echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled as root"
THP_HINT = (
    f"let shared memory have transparent huge pages: {THP_ON_COMMAND} "
    "(or transparent_hugepage_shmem=advise on the kernel command line); "
    "or reserve huge pages and use --arena-huge-pages on; or run with --arena-huge-pages off"
)
#: below this share of an arena on huge pages the daemon warns and doctor says so
LOW_HUGE_SHARE = 0.9


def huge_share_level(share: float) -> tuple[int, str]:
    """The log level for an arena with ``share`` of it on transparent huge pages, and what
    the line should add: nothing from ``LOW_HUGE_SHARE`` up, else why the rest is not."""
    if share >= LOW_HUGE_SHARE:
        return logging.INFO, ""
    if share <= 0:
        return (
            logging.WARNING,
            " (the kernel gave none: all of it is on 4 KiB pages; the host's memory may be too fragmented)",
        )
    return logging.WARNING, " (the host's memory is fragmented: the rest is on 4 KiB pages)"


def shmem_setting(sysfs_dir: str = SYSFS_THP_DIR) -> str:
    """The global ``shmem_enabled`` word as the file says it (what to write back to restore
    it); "" where it cannot be read."""
    return _setting(Path(sysfs_dir) / "shmem_enabled")


def _setting(path: Path) -> str:
    """The bracketed word of a sysfs THP setting file ("always [advise] never" -> "advise");
    "" where the file is missing or unreadable."""
    try:
        text = path.read_text(encoding="ascii")
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else text.strip()


@dataclass(frozen=True)
class ShmemThp:
    """Whether this host gives shared memory transparent huge pages, read from sysfs."""

    setting: str  # the effective shmem_enabled word for PMD-sized pages; "" where unknown
    page_bytes: int  # hpage_pmd_size; 0 where unknown

    @classmethod
    def measure(cls, sysfs_dir: str = SYSFS_THP_DIR) -> ShmemThp:
        folder = Path(sysfs_dir)
        try:
            page_bytes = int((folder / "hpage_pmd_size").read_text(encoding="ascii"))
        except (OSError, ValueError):
            page_bytes = 0
        setting = _setting(folder / "shmem_enabled")
        # since Linux 6.11 each size has its own control; "inherit" (the default) defers to the global one
        per_size = _setting(folder / f"hugepages-{page_bytes >> 10}kB" / "shmem_enabled") if page_bytes else ""
        if per_size and per_size != "inherit":
            setting = per_size
        return cls(setting, page_bytes)

    @property
    def usable(self) -> bool:
        return self.setting in THP_SHMEM_ON and self.page_bytes > 0

    def describe(self) -> str:
        if not self.page_bytes:
            return "this kernel has no transparent huge pages"
        return f"shmem_enabled is {self.setting or 'unreadable'}"

    def require(self) -> None:
        """``HugePagesUnavailable`` (what to set) where shared memory gets none here."""
        if not self.usable:
            raise HugePagesUnavailable(
                f"transparent huge pages for shared memory are off here ({self.describe()})", hint=THP_HINT
            )


def take_huge_pages(fd: int, length: int, what: str) -> None:
    """Take every page of the first ``length`` bytes of the shared-memory file ``fd`` now,
    as transparent huge pages where the kernel has them: through a mapping of its own with
    huge-page advice, unmapped after (the pages stay in the file, huge, and any mapping of
    it later maps them whole; ``mapped_huge_bytes`` counts them there). Raises
    ``HugePagesUnavailable`` on a kernel without ``MADV_POPULATE_WRITE`` (before 5.14: no
    way to take them with the advice) or one that refuses the advice, ``CapacityExhausted``
    when the memory cannot be had;
    the file is then as it was, but for pages already taken."""
    mapping = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        window = (ctypes.c_char * length).from_buffer(mapping)
        address = ctypes.addressof(window)
        del window  # no export left: the mapping can close
        err = madvise(address, length, MADV_HUGEPAGE)
        if err:  # a kernel without transparent huge pages, or libc not callable: try falls back
            raise HugePagesUnavailable(f"{what}: madvise(MADV_HUGEPAGE) failed: {os.strerror(err)}", hint=THP_HINT)
        err = madvise(address, length, MADV_POPULATE_WRITE)
        if not err:
            return
        if err == errno.EINVAL:  # a kernel before 5.14
            raise HugePagesUnavailable(
                f"{what}: this kernel cannot take pages with huge-page advice (MADV_POPULATE_WRITE, Linux 5.14)",
                hint="reserve huge pages and use --arena-huge-pages on, or run with --arena-huge-pages off",
            )
        raise CapacityExhausted(
            f"cannot take the memory of {what} ({length} bytes): {os.strerror(err)}",
            hint="free memory on the host, or lower --capacity-bytes",
        )
    finally:
        mapping.close()


def mapped_huge_bytes(address: int, length: int) -> int:
    """How many bytes of this process's mapping ``[address, address + length)`` of a shared-
    memory file are on huge pages. smaps counts only mapped pages, so the range's are mapped
    first (``MADV_POPULATE_READ``: they exist already, so this fills page-table entries, one
    per huge page; a page it cannot map counts as not huge). One read of smaps for the whole
    range: a per-tenant arena counts every segment at once, not one read each (a read walks
    every mapping listed before the range)."""
    madvise(address, length, MADV_POPULATE_READ)
    return huge_bytes(address, length)


def huge_bytes(address: int, length: int, smaps_path: str = SMAPS_PATH) -> int:
    """How many bytes of ``[address, address + length)`` this process maps with huge pages of
    shared memory (``ShmemPmdMapped`` of the mappings inside it); 0 where smaps cannot be read."""
    total, inside = 0, False
    stop = address + length
    try:
        with open(smaps_path, encoding="ascii", errors="replace") as fh:
            for line in fh:  # the kernel makes the file as it is read: stopping early is cheap
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:  # a mapping's header: "start-end perms ..."
                    first, _, last = head.partition("-")
                    try:
                        start, end = int(first, 16), int(last, 16)
                    except ValueError:
                        inside = False
                        continue
                    if start >= stop:  # mappings are listed by address: the rest lie past the range
                        break
                    inside = address <= start and end <= stop
                elif inside and line.startswith("ShmemPmdMapped:"):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total
