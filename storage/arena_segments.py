"""A node's arena made of segments, one memfd each, mapped side by side: per-tenant arenas.

Why (docs/security.md, "Per-tenant arenas"): a client that maps the whole arena can read
every tenant's bytes. Here the arena is ``num_segments`` anonymous memfds of
``segment_bytes`` each (the last may be shorter), mapped contiguously in the daemon
(``kvpool.core.fixed_map``), so the daemon, the TCP/UCX data plane and every offset on the
wire still see one flat array. The slab allocator gives each segment to one owner (a tenant
group) at a time (``storage/allocator.py``); the hand-off (``kvpool.daemon.arena_handoff``)
gives a client the descriptor of a segment only while the segment's owner is one of the
client's. A client maps the segments it was given at their places in a reserved,
inaccessible range (``kvpool.core.arena_segments``): another tenant's bytes are not mapped
in it at all.

A segment handed to an owner other than the one it had last gets **fresh memory** first
(``on_owned``: a new memfd mapped over the old one, ``generation`` raised): a client of the
previous owner that still maps it keeps only the previous owner's old bytes, and learns
from the generation on the wire that its mapping is stale. ``segment_fd`` reads the
segment's owner, generation and descriptor under one lock, so a descriptor handed out is
never one a new owner's bytes go into after the owner was checked.

Each memfd is sealed against shrinking and growing like the one-piece arena's, its pages
reserved up front (``posix_fallocate``), and on huge pages with ``huge_pages`` (each
segment a whole number of 2 MiB pages, starting on a 2 MiB boundary).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Collection

from kvpool.core.errors import CapacityExhausted, InvalidArgument, PermissionDenied, StorageFault
from kvpool.core.fixed_map import ALIGN_BYTES, Reservation, map_segment
from kvpool.storage.allocator import NO_OWNER
from kvpool.storage.arena import (
    OVERCOMMIT_HINT,
    HugePageRoom,
    HugePagesUnavailable,
    SharedArena,
    _size,
    available_memory_bytes,
    transparent_past_memory,
)
from kvpool.storage.thp import ShmemThp, huge_share_level, mapped_huge_bytes, take_huge_pages

log = logging.getLogger("kvpool.arena")


class SegmentedArena(SharedArena):
    """The daemon's arena as ``num_segments`` memfds in one flat ``view`` (module docstring)."""

    def __init__(
        self,
        capacity_bytes: int,
        segment_bytes: int,
        *,
        huge_pages: bool,
        meminfo_path: str,
        transparent: ShmemThp | None = None,
    ) -> None:
        """``huge_pages``: each segment on reserved huge pages; ``transparent`` (the host's
        ``storage.thp.ShmemThp``): on transparent huge pages of shared memory."""
        if transparent is not None:
            transparent.require()
        if transparent is not None and segment_bytes % transparent.page_bytes:
            raise HugePagesUnavailable(
                f"arena segments of {segment_bytes} bytes are not whole transparent huge pages of "
                f"{transparent.page_bytes} bytes",
                hint="use --arena-segment-bytes a multiple of the huge page size, or --arena-huge-pages off",
            )
        if capacity_bytes <= 0 or segment_bytes <= 0 or segment_bytes % ALIGN_BYTES:
            raise InvalidArgument(
                f"arena segments of {segment_bytes} bytes: they must be a positive multiple of 2 MiB",
                hint="use --arena-segment-bytes 64MiB (a multiple of 2 MiB and of --slab-bytes)",
            )
        self.path = ""
        self.owner = True
        self.capacity_bytes = capacity_bytes
        self.segment_bytes = segment_bytes
        self.num_segments = -(-capacity_bytes // segment_bytes)
        self._huge = huge_pages
        self._transparent = transparent
        self.page_bytes = HugePageRoom.measure(meminfo_path).page_bytes if huge_pages else os.sysconf("SC_PAGESIZE")
        self.transparent = transparent is not None
        if transparent is not None:
            self.page_bytes = transparent.page_bytes
        #: bytes of the arena on huge pages: all on reserved ones; on transparent ones, what the
        #: kernel gave the segments when they were made (counted again when one is made fresh)
        self.huge_bytes = capacity_bytes if huge_pages else 0
        self._check_room(meminfo_path)
        self._lock = threading.Lock()
        self._fds: list[int] = []
        self._owners = [NO_OWNER] * self.num_segments
        self._generations = [0] * self.num_segments
        self._reservation = Reservation(self.num_segments * segment_bytes, writable=True)
        self._fd = -1
        self._write_fd = -1
        try:
            for seg in range(self.num_segments):
                fd = self._new_memfd(seg)
                self._fds.append(fd)
                map_segment(self._address(seg), self._mapped_bytes(seg), fd, writable=True)
            self._count_huge()
        except BaseException:
            self.close()
            raise
        self.view = self._reservation.view[:capacity_bytes]
        self.renewed = 0
        share = self.huge_bytes / capacity_bytes
        level, note = huge_share_level(share) if transparent is not None else (logging.INFO, "")
        log.log(
            level,
            "arena: %s in %d segments of %s (per-tenant), %d-byte pages%s%s",
            _size(capacity_bytes),
            self.num_segments,
            _size(segment_bytes),
            self.page_bytes,
            f", {share:.0%} of it on transparent huge pages (shmem_enabled {transparent.setting})"
            if transparent
            else "",
            note,
        )

    def _count_huge(self) -> None:
        """``huge_bytes`` of an arena on transparent huge pages: one count over every segment."""
        if self._transparent is not None:
            mapped = sum(self._mapped_bytes(seg) for seg in range(self.num_segments))
            self.huge_bytes = min(self.capacity_bytes, mapped_huge_bytes(self._reservation.address, mapped))

    def _check_room(self, meminfo_path: str) -> None:
        if self._huge:
            room = HugePageRoom.measure(meminfo_path)
            need = sum(self._mapped_bytes(seg) for seg in range(self.num_segments)) // max(1, room.page_bytes)
            if not room.page_bytes or room.free_pages < need:
                raise HugePagesUnavailable(
                    f"a huge-page arena of {_size(self.capacity_bytes)} needs {need} free huge pages; the host has "
                    f"{room.free_pages} free of {room.total_pages} reserved",
                    hint="reserve them as root (/proc/sys/vm/nr_hugepages), or run with --arena-huge-pages off",
                )
            return
        available = available_memory_bytes(meminfo_path)
        if available is not None and self.capacity_bytes > available and self._transparent is not None:
            raise transparent_past_memory(self.capacity_bytes, available)  # as the one-piece arena
        if available is not None and self.capacity_bytes > available:
            raise CapacityExhausted(
                f"arena of {_size(self.capacity_bytes)} exceeds available memory (MemAvailable {_size(available)})",
                hint=OVERCOMMIT_HINT,
            )

    def _address(self, seg: int) -> int:
        return self._reservation.address + seg * self.segment_bytes

    def _mapped_bytes(self, seg: int) -> int:
        """The segment's bytes, rounded up to whole pages (the last one may be short)."""
        length = min(self.segment_bytes, self.capacity_bytes - seg * self.segment_bytes)
        page = ALIGN_BYTES if self._huge else os.sysconf("SC_PAGESIZE")
        if self._transparent is not None:  # whole transparent huge pages, as the one-piece arena
            page = max(ALIGN_BYTES, self._transparent.page_bytes)
        return -(-length // page) * page

    def _new_memfd(self, seg: int) -> int:
        """A new memfd for segment ``seg``, every page taken (as transparent huge pages where
        asked and the kernel has them)."""
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if self._huge else 0)
        length = self._mapped_bytes(seg)
        try:
            fd = os.memfd_create(f"kvpool-arena-{seg}", flags)
        except OSError as exc:
            raise StorageFault(f"cannot create arena segment {seg}: {exc}", hint="use --arena-handoff file") from exc
        try:
            os.ftruncate(fd, length)
            if self._transparent is not None:  # every page now, as huge ones where the kernel has them
                take_huge_pages(fd, length, f"arena segment {seg}")  # __init__ logs how much got them
            else:
                os.posix_fallocate(fd, 0, length)  # every page now: no SIGBUS in a client later
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except OSError as exc:
            os.close(fd)
            raise CapacityExhausted(
                f"cannot reserve {_size(length)} for arena segment {seg}: {exc.strerror}",
                hint="free memory on the host, or lower --capacity-bytes",
            ) from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def on_owned(self, seg: int, owner: int, generation: int) -> None:
        """The allocator hands free segment ``seg`` to ``owner`` (``NewOwnerHook``): where the
        owner changed, map fresh memory over it first, so nothing a client mapped for the
        previous owner ever shows the new owner's bytes. Raises (nothing changed) if the
        fresh memory cannot be had."""
        with self._lock:
            if self._owners[seg] not in (NO_OWNER, owner):
                fd = self._new_memfd(seg)
                try:
                    map_segment(self._address(seg), self._mapped_bytes(seg), fd, writable=True)
                except BaseException:
                    os.close(fd)
                    raise
                os.close(self._fds[seg])  # the old pages go when the last client unmaps them
                self._fds[seg] = fd
                self._count_huge()
                self.renewed += 1
            self._owners[seg] = owner
            self._generations[seg] = generation

    def segment_fd(self, seg: int, writable: bool, owners: Collection[int] | None) -> tuple[int, int]:
        """A new descriptor of segment ``seg`` (read-only unless ``writable``: opened
        ``O_RDONLY``, so it cannot be mapped writable) and its generation, if the segment's
        owner is in ``owners`` (None: any); the caller owns the descriptor. A segment no owner
        has taken yet is refused; a free one is handed only to the owner it had last (it holds
        only that owner's old bytes)."""
        if not 0 <= seg < self.num_segments:
            raise InvalidArgument(f"segment {seg} is outside 0..{self.num_segments - 1}")
        with self._lock:
            owner = self._owners[seg]
            if owner == NO_OWNER or (owners is not None and owner not in owners):
                raise PermissionDenied(f"arena segment {seg} holds another tenant's blocks")
            mode = os.O_RDWR if writable else os.O_RDONLY
            return os.open(f"/proc/self/fd/{self._fds[seg]}", mode | os.O_CLOEXEC), self._generations[seg]

    def segment_owner(self, seg: int) -> int:
        with self._lock:
            return self._owners[seg]

    @property
    def fd(self) -> int:
        raise InvalidArgument("a segmented arena has one descriptor per segment (segment_fd)")

    def read_only_fd(self) -> int:
        raise InvalidArgument("a segmented arena hands out segments (segment_fd), not a whole-arena descriptor")

    def close(self) -> None:
        if not hasattr(self, "_reservation"):
            return
        self.view = self._reservation.view[:0]
        self._reservation.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        del self._reservation


__all__ = ["SegmentedArena"]
