"""A same-host client's mapping of a per-tenant arena: only its own tenants' segments.

The node's arena is made of segments, one memfd each, every one owned by one tenant group
at a time (``kvpool.storage.arena_segments``). The client reserves the whole arena's address
range **inaccessible** (``PROT_NONE``) and maps each segment it is handed read-only
(``MAP_FIXED``) at its place, so ``view[offset]`` works unchanged for its own blocks, while
the bytes of a segment it was not handed are not in its address space at all: a touch is a
SIGSEGV, never a read (``tests/integration/test_arena_segments.py``).

Segments are mapped when first needed: a lease or put names offsets and, with them, the
generation of each offset's segment (``segment_generations`` on the wire); ``ensure`` fetches
every segment not mapped yet, or mapped at an older generation (the node gave it fresh
memory when it changed owner, so the old mapping holds only stale bytes), over the hand-off
socket, authenticated with the token as before; the node refuses a segment owned by
another tenant. A lease or a pending put keeps its segments' owner and generation fixed, so
what ``ensure`` maps is what the node serves. A put window maps, writable, only its slots'
pages from the segments' write descriptors (``PutWindow``), asked for naming the put.
stdlib + numpy only, like the rest of core.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.core.arena_map import ArenaMapping, PutWindow
from kvpool.core.errors import InvalidArgument, Unavailable
from kvpool.core.fixed_map import Reservation, map_segment

#: fetch(mode "r" | "w", put id, segment) -> (descriptor, generation); the caller owns the fd
SegmentFetch = Callable[[str, int, int], tuple[int, int]]


class SegmentedMapping(ArenaMapping):
    """A client's view of a per-tenant arena (module docstring). Thread-safe."""

    def __init__(self, name: str, capacity_bytes: int, segment_bytes: int, fetch: SegmentFetch) -> None:
        if segment_bytes <= 0 or capacity_bytes <= 0:
            raise InvalidArgument("a segmented arena needs positive capacity and segment sizes")
        self.path = name
        self.capacity_bytes = capacity_bytes
        self.segment_bytes = segment_bytes
        self.num_segments = -(-capacity_bytes // segment_bytes)
        self._fetch = fetch
        self._reservation = Reservation(self.num_segments * segment_bytes, writable=False)
        self.view = self._reservation.view[:capacity_bytes]
        self._mmap = None  # type: ignore[assignment]
        self._fd = -1
        self._write_fd = -1
        self.page_bytes = mmap.PAGESIZE  # until a segment says it is on huge pages
        self._generations = np.full(self.num_segments, -1, dtype=np.int64)  # -1: not mapped
        self._write_fds: dict[int, tuple[int, int]] = {}  # segment -> (write descriptor, generation)
        self._lock = threading.Lock()
        self.fetched = 0  # segments mapped (counted for tests and stats)

    def _can_adopt(self, page_bytes: int) -> bool:
        """A page size must also tile a segment: a window run never crosses a segment's edge."""
        return super()._can_adopt(page_bytes) and self.segment_bytes % page_bytes == 0

    def mapped_segments(self) -> list[int]:
        """The segments mapped now."""
        return [int(s) for s in np.flatnonzero(self._generations >= 0)]

    def ensure(self, offsets: Sequence[int], generations: Sequence[int], put_id: int = 0) -> None:
        if not len(offsets):
            return
        if len(generations) != len(offsets):
            raise Unavailable("the node named no segment generations for a per-tenant arena", hint="upgrade the node")
        segs = np.asarray(offsets, dtype=np.int64) // self.segment_bytes
        gens = np.asarray(generations, dtype=np.int64)
        if put_id == 0 and not np.any(self._generations[segs] != gens):
            return  # the hot path: every segment mapped at its generation
        wanted = dict(zip(segs.tolist(), gens.tolist(), strict=True))
        with self._lock:
            for seg, gen in wanted.items():
                if self._generations[seg] != gen:
                    self._map(seg, gen)
                if put_id and self._write_fds.get(seg, (-1, -1))[1] != gen:
                    self._adopt_write(seg, gen, put_id)

    def _map(self, seg: int, generation: int) -> None:
        if not 0 <= seg < self.num_segments:
            raise InvalidArgument(f"segment {seg} is outside the arena")
        fd, got = self._fetch("r", 0, seg)
        try:
            if got != generation:
                raise Unavailable(f"arena segment {seg} is at generation {got}, the node said {generation}")
            length = os.fstat(fd).st_size
            least = min(self.segment_bytes, self.capacity_bytes - seg * self.segment_bytes)
            if not least <= length <= self.segment_bytes:
                raise Unavailable(f"arena segment {seg} handed over is {length} bytes")
            map_segment(self._reservation.address + seg * self.segment_bytes, length, fd, writable=False)
            blksize = os.fstat(fd).st_blksize  # a hugetlb memfd's is its huge page size: windows use whole ones
            if blksize > mmap.PAGESIZE and blksize & (blksize - 1) == 0:
                self.page_bytes = blksize
        finally:
            os.close(fd)  # the mapping keeps the memory; no descriptor stays open for reads
        self._generations[seg] = generation
        self.fetched += 1

    def _adopt_write(self, seg: int, generation: int, put_id: int) -> None:
        fd, got = self._fetch("w", put_id, seg)
        if got != generation:
            os.close(fd)
            raise Unavailable(f"arena segment {seg} is at generation {got}, the node said {generation}")
        old = self._write_fds.pop(seg, None)
        if old is not None:
            os.close(old[0])
        self._write_fds[seg] = (fd, generation)

    @property
    def can_write(self) -> bool:
        return bool(self._write_fds)

    def put_window(self, offsets: Sequence[int], length: int, own_copy: bool = False) -> PutWindow:
        """Writable mappings of only the pages of the put's slots, from the segments' write
        descriptors (``ensure`` with the put id first); a window of its own whoever writes."""

        def fd_of(seg: int) -> int:
            found = self._write_fds.get(seg)
            if found is None:
                raise Unavailable(f"no write descriptor for arena segment {seg}", hint="ensure() with the put id first")
            return found[0]

        return PutWindow(fd_of, self.capacity_bytes, offsets, length, self.page_bytes, self.segment_bytes)

    @property
    def fd(self) -> int:
        raise InvalidArgument("a per-tenant arena mapping has no single descriptor")

    @property
    def closed(self) -> bool:
        return not hasattr(self, "_reservation")

    def close(self) -> None:
        if not hasattr(self, "_reservation"):
            return
        self.view = np.empty(0, dtype=np.uint8)
        self._reservation.close()
        del self._reservation
        for fd, _ in self._write_fds.values():
            os.close(fd)
        self._write_fds.clear()
        self._generations[:] = -1


__all__ = ["SegmentFetch", "SegmentedMapping"]
