"""Slot allocation over the disk tier's numbered slab files: each file serves one slot size
while it holds any block and returns to the free pool when empty. Pure bookkeeping (no I/O,
no lock: the tier's state lock covers it); the caller decides whether an empty file may be
given a class (``may_open``), which is where a file that is not preallocated yet is refused.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.core.errors import InvalidArgument
from kvpool.core.invariants import require
from kvpool.storage.disk_layout import IO_ALIGN_BYTES, file_layout


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

    def check_invariants(self) -> None:
        """Slot accounting (debug mode; called under the tier's lock, after recovery): each
        file is empty or of one class with its used and free slots filling it, the partial
        sets are exactly the files with a free slot, and ``used_bytes`` adds up."""
        name = "DiskSlots"
        empty = set(self._empty_files)
        used_bytes = 0
        for f in range(self.num_files):
            cls = self.file_class[f]
            if cls == 0:
                require(
                    name, "a classless file is empty", f in empty and self._used[f] == 0 and not self._free[f], str(f)
                )
                continue
            require(name, "a file with a class is not listed empty", f not in empty, str(f))
            require(
                name,
                "used and free slots fill the file",
                self._used[f] > 0 and self._used[f] + len(self._free[f]) == self.slots_per_file(cls),
                f"file {f}",
            )
            require(
                name,
                "partial files are those with a free slot",
                (f in self._partial.get(cls, ())) == bool(self._free[f]),
            )
            used_bytes += self._used[f] * cls
        require(
            name, "used bytes are the used slots", used_bytes == self.used_bytes, f"{used_bytes} != {self.used_bytes}"
        )
