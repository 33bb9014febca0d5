"""Fixed-size slab allocator over one arena: O(1) alloc and free.

The arena is cut into ``slab_bytes`` slabs. A slab is given to one size class (the
exact, 64-byte-aligned block size of a namespace) on first need and cut into equal
slots; a slab whose slots are all free goes back to the shared pool, so namespaces
with different block sizes share one arena without fragmentation inside a slab.
State is in flat arrays and int stacks: no Python object per block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpool.core.errors import InvalidArgument
from kvpool.core.invariants import require

SLOT_ALIGN_BYTES = 64


def slot_size_for(block_bytes: int) -> int:
    return -(-block_bytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES


def check_block_fits(block_bytes: int, slab_bytes: int) -> None:
    """The one rule for which block sizes an arena of ``slab_bytes`` slabs can hold; the daemon
    applies it when a namespace registers, so a bad spec fails at Hello, not at its first put."""
    if block_bytes <= 0:
        raise InvalidArgument(f"block size must be positive, got {block_bytes}")
    if slot_size_for(block_bytes) > slab_bytes:
        raise InvalidArgument(
            f"a {block_bytes}-byte block does not fit a {slab_bytes}-byte slab",
            hint="restart the daemon with a larger --slab-bytes, or use fewer tokens per block",
        )


@dataclass
class _SizeClass:
    slot_bytes: int
    slots_per_slab: int
    partial_slabs: list[int] = field(default_factory=list)  # slabs with at least one free slot
    partial_pos: dict[int, int] = field(default_factory=dict)  # slab -> index in partial_slabs


class SlabAllocator:
    """Allocates slots of exact size classes inside ``capacity_bytes`` of arena."""

    def __init__(self, capacity_bytes: int, slab_bytes: int) -> None:
        if slab_bytes <= 0 or capacity_bytes < slab_bytes:
            raise InvalidArgument(f"need capacity_bytes ({capacity_bytes}) >= slab_bytes ({slab_bytes}) > 0")
        self.slab_bytes = slab_bytes
        self.num_slabs = capacity_bytes // slab_bytes
        self.capacity_bytes = self.num_slabs * slab_bytes
        self._free_slabs: list[int] = list(range(self.num_slabs - 1, -1, -1))
        self._slab_class = np.zeros(self.num_slabs, dtype=np.int64)  # slot_bytes, 0 = free slab
        self._slab_used = np.zeros(self.num_slabs, dtype=np.int64)
        self._slab_free_slots: list[list[int]] = [[] for _ in range(self.num_slabs)]
        self._classes: dict[int, _SizeClass] = {}
        self.used_bytes = 0  # bytes in allocated slots (slot-rounded)

    def check_block_bytes(self, block_bytes: int) -> None:
        check_block_fits(block_bytes, self.slab_bytes)

    def alloc(self, block_bytes: int) -> int | None:
        """Offset of a free slot for a block of ``block_bytes``, or None if the arena is full
        for this class (the caller evicts and retries)."""
        self.check_block_bytes(block_bytes)
        slot_bytes = slot_size_for(block_bytes)
        cls = self._classes.get(slot_bytes)
        if cls is None:
            cls = _SizeClass(slot_bytes, self.slab_bytes // slot_bytes)
            self._classes[slot_bytes] = cls
        if not cls.partial_slabs:
            if not self._free_slabs:
                return None
            slab = self._free_slabs.pop()
            self._slab_class[slab] = slot_bytes
            self._slab_free_slots[slab] = list(range(cls.slots_per_slab - 1, -1, -1))
            self._add_partial(cls, slab)
        slab = cls.partial_slabs[-1]
        slot = self._slab_free_slots[slab].pop()
        self._slab_used[slab] += 1
        if not self._slab_free_slots[slab]:
            self._remove_partial(cls, slab)
        self.used_bytes += slot_bytes
        return slab * self.slab_bytes + slot * slot_bytes

    def free(self, offset: int) -> None:
        slab, within = divmod(offset, self.slab_bytes)
        if not 0 <= slab < self.num_slabs:
            raise InvalidArgument(f"offset {offset} is outside the arena")
        slot_bytes = int(self._slab_class[slab])
        if slot_bytes == 0 or within % slot_bytes or self._slab_used[slab] <= 0:
            raise InvalidArgument(f"offset {offset} is not an allocated slot")
        cls = self._classes[slot_bytes]
        free_slots = self._slab_free_slots[slab]
        if not free_slots:
            self._add_partial(cls, slab)
        free_slots.append(within // slot_bytes)
        self._slab_used[slab] -= 1
        self.used_bytes -= slot_bytes
        if self._slab_used[slab] == 0:  # whole slab free: back to the shared pool
            self._remove_partial(cls, slab)
            self._slab_class[slab] = 0
            self._slab_free_slots[slab] = []
            self._free_slabs.append(slab)

    def free_slots_for(self, block_bytes: int) -> int:
        """Slots of this block size obtainable now without freeing anything."""
        slot_bytes = slot_size_for(block_bytes)
        per_slab = self.slab_bytes // slot_bytes
        cls = self._classes.get(slot_bytes)
        partial = sum(len(self._slab_free_slots[s]) for s in cls.partial_slabs) if cls is not None else 0
        return partial + len(self._free_slabs) * per_slab

    def slots_per_slab(self, block_bytes: int) -> int:
        return self.slab_bytes // slot_size_for(block_bytes)

    def slab_of(self, offset: int) -> int:
        return offset // self.slab_bytes

    def slab_used_slots(self, slab: int) -> int:
        return int(self._slab_used[slab])

    def slot_bytes_at(self, offset: int) -> int:
        return int(self._slab_class[offset // self.slab_bytes])

    def free_slabs(self) -> int:
        return len(self._free_slabs)

    def can_alloc(self, block_bytes: int) -> bool:
        cls = self._classes.get(slot_size_for(block_bytes))
        return bool(self._free_slabs) or (cls is not None and bool(cls.partial_slabs))

    def check_invariants(self) -> None:
        """The allocator's accounting (debug mode; its owner calls it under its lock): each
        slab is free or of one class, its used and free slots add up to the class's slots,
        the partial lists are exactly the class slabs with a free slot, and ``used_bytes``
        is the sum of the used slots."""
        name = "SlabAllocator"
        free = set(self._free_slabs)
        require(name, "a free slab is listed once", len(free) == len(self._free_slabs))
        used_bytes = 0
        for slab in range(self.num_slabs):
            slot_bytes = int(self._slab_class[slab])
            used = int(self._slab_used[slab])
            free_slots = self._slab_free_slots[slab]
            if slot_bytes == 0:
                require(
                    name, "a classless slab is free and empty", slab in free and used == 0 and not free_slots, str(slab)
                )
                continue
            require(name, "a slab with a class is not free", slab not in free, str(slab))
            cls = self._classes.get(slot_bytes)
            require(name, "a slab's class is known", cls is not None, str(slot_bytes))
            assert cls is not None
            require(
                name,
                "used and free slots fill the slab",
                used > 0 and used + len(free_slots) == cls.slots_per_slab and len(set(free_slots)) == len(free_slots),
                f"slab {slab}: {used} used + {len(free_slots)} free, {cls.slots_per_slab} slots",
            )
            require(name, "partial slabs are those with a free slot", (slab in cls.partial_pos) == bool(free_slots))
            used_bytes += used * slot_bytes
        for cls in self._classes.values():
            require(name, "the partial index matches its list", len(cls.partial_pos) == len(cls.partial_slabs))
            for pos, slab in enumerate(cls.partial_slabs):
                require(name, "the partial index matches its list", cls.partial_pos.get(slab) == pos, str(slab))
        require(
            name, "used bytes are the used slots", used_bytes == self.used_bytes, f"{used_bytes} != {self.used_bytes}"
        )

    def _add_partial(self, cls: _SizeClass, slab: int) -> None:
        cls.partial_pos[slab] = len(cls.partial_slabs)
        cls.partial_slabs.append(slab)

    def _remove_partial(self, cls: _SizeClass, slab: int) -> None:
        pos = cls.partial_pos.pop(slab, None)
        if pos is None:
            return
        last = cls.partial_slabs.pop()
        if last != slab:
            cls.partial_slabs[pos] = last
            cls.partial_pos[last] = pos
