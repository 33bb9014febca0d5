"""Fixed-size slab allocator over one arena: O(1) alloc and free, slabs grouped in segments
that each belong to one owner at a time.

The arena is cut into ``slab_bytes`` slabs. A slab is given to one size class (the
exact, 64-byte-aligned block size of a namespace) on first need and cut into equal
slots; a slab whose slots are all free goes back to the shared pool, so namespaces
with different block sizes share one arena without fragmentation inside a slab.
State is in flat arrays and int stacks: no Python object per block.

Segments (per-tenant arenas, docs/security.md): the slabs are grouped into segments of
``segment_bytes`` (0 = the whole arena is one segment). A segment belongs to one **owner**
(an int: a tenant group of the daemon's credentials) from the first slab it gives that
owner until its last slab is free again; only then does it go back to the pool of free
segments, for any owner and any size class. ``alloc(block_bytes, owner)`` only ever hands
out slots in segments of ``owner``, so **no slab of a segment is ever given to two owners
at once** (``check_invariants``; hypothesis: ``tests/property/test_store_allocator_owners.py``).
Each segment has a ``generation``, raised when it is handed to an owner other than the one
it had last. Every time a free segment is handed to an owner, ``on_new_owner`` is told
(segment, owner, generation) first: the arena backs a segment whose owner changed with
fresh memory, so a client that mapped it for its previous owner keeps only the previous
owner's old bytes, never the new owner's. With one owner (no credentials) and one segment
this is the allocator it always was: the same slabs, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvpool.core.errors import InvalidArgument
from kvpool.core.invariants import require

SLOT_ALIGN_BYTES = 64
#: the owner of a free segment
NO_OWNER = -1


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


class _IndexedList:
    """A list with O(1) add, remove and membership (the partial lists)."""

    __slots__ = ("items", "pos")

    def __init__(self) -> None:
        self.items: list[int] = []
        self.pos: dict[int, int] = {}

    def add(self, item: int) -> None:
        self.pos[item] = len(self.items)
        self.items.append(item)

    def remove(self, item: int) -> None:
        pos = self.pos.pop(item, None)
        if pos is None:
            return
        last = self.items.pop()
        if last != item:
            self.items[pos] = last
            self.pos[last] = pos


@dataclass
class _SizeClass:
    slot_bytes: int
    slots_per_slab: int
    partial: _IndexedList = field(default_factory=lambda: _IndexedList())  # slabs with at least one free slot


#: called with (segment, owner, generation) before a free segment is handed to ``owner``
#: (the generation is raised where the owner changed): the arena backs a segment whose owner
#: changed with fresh memory; raising refuses the segment (nothing changed)
NewOwnerHook = Callable[[int, int, int], None]


class SlabAllocator:
    """Allocates slots of exact size classes inside ``capacity_bytes`` of arena."""

    def __init__(
        self,
        capacity_bytes: int,
        slab_bytes: int,
        segment_bytes: int = 0,
        on_new_owner: NewOwnerHook | None = None,
    ) -> None:
        if slab_bytes <= 0 or capacity_bytes < slab_bytes:
            raise InvalidArgument(f"need capacity_bytes ({capacity_bytes}) >= slab_bytes ({slab_bytes}) > 0")
        if segment_bytes < 0 or segment_bytes % slab_bytes:
            raise InvalidArgument(f"segment_bytes ({segment_bytes}) must be a multiple of slab_bytes ({slab_bytes})")
        self.slab_bytes = slab_bytes
        self.num_slabs = capacity_bytes // slab_bytes
        self.capacity_bytes = self.num_slabs * slab_bytes
        self.slabs_per_segment = segment_bytes // slab_bytes if segment_bytes else self.num_slabs
        self.segment_bytes = self.slabs_per_segment * slab_bytes
        self.num_segments = -(-self.num_slabs // self.slabs_per_segment)
        self._on_new_owner = on_new_owner
        # per slab / segment, as lists: alloc and free read and write them one item at a time,
        # where a numpy scalar costs ~5x a list item (free was ~1 us a block)
        self._slab_class: list[int] = [0] * self.num_slabs  # slot_bytes, 0 = free slab
        self._slab_used: list[int] = [0] * self.num_slabs
        self._slab_free_slots: list[list[int]] = [[] for _ in range(self.num_slabs)]
        self._classes: dict[tuple[int, int], _SizeClass] = {}  # (owner, slot bytes) -> class
        # segments: owner (NO_OWNER = free), the owner it had last, generation, its free slabs
        self._seg_owner: list[int] = [NO_OWNER] * self.num_segments
        self._seg_last_owner: list[int] = [NO_OWNER] * self.num_segments
        self._seg_generation = np.zeros(self.num_segments, dtype=np.int64)
        self._seg_free_slabs: list[list[int]] = []
        for seg in range(self.num_segments):
            first, stop = seg * self.slabs_per_segment, min((seg + 1) * self.slabs_per_segment, self.num_slabs)
            self._seg_free_slabs.append(list(range(stop - 1, first - 1, -1)))
        self._free_segments: list[int] = list(range(self.num_segments - 1, -1, -1))
        self._owner_partial: dict[int, _IndexedList] = {}  # owner -> its segments with a free slab
        self._owner_free_slabs: dict[int, int] = {}  # owner -> free slabs in its segments
        self._free_segment_slabs = self.num_slabs  # slabs in free segments
        self.used_bytes = 0  # bytes in allocated slots (slot-rounded)

    def check_block_bytes(self, block_bytes: int) -> None:
        check_block_fits(block_bytes, self.slab_bytes)

    def alloc(self, block_bytes: int, owner: int = 0) -> int | None:
        """Offset of a free slot for a block of ``block_bytes`` in a segment of ``owner``, or
        None if neither its segments nor a free segment have room for this class (the caller
        evicts and retries)."""
        got = self.alloc_many(block_bytes, 1, owner)
        return got[0] if got else None

    def alloc_many(self, block_bytes: int, count: int, owner: int = 0) -> list[int]:
        """Offsets of ``count`` free slots for blocks of ``block_bytes`` in segments of
        ``owner``: the slots a loop of single allocations would take, leaving the same state,
        in ascending order within each slab (fewer where room ran out: the caller evicts and
        asks again). Why: a put of 16,384 small blocks spent ~1 us a block allocating one at a
        time; here a slab's free slots are taken as one slice and their offsets computed in
        one numpy pass."""
        self.check_block_bytes(block_bytes)
        if count <= 0:
            return []
        slot_bytes = slot_size_for(block_bytes)
        cls = self._classes.get((owner, slot_bytes))
        if cls is None:
            cls = _SizeClass(slot_bytes, self.slab_bytes // slot_bytes)
            self._classes[(owner, slot_bytes)] = cls
        out: list[int] = []
        while len(out) < count:
            if not cls.partial.items:
                try:
                    slab = self._take_slab(owner)  # its on_new_owner hook may refuse a segment
                except BaseException:
                    for offset in out:  # the slots taken so far exist nowhere else: give them back
                        self.free(offset)
                    raise
                if slab is None:
                    break
                self._slab_class[slab] = slot_bytes
                self._slab_free_slots[slab] = list(range(cls.slots_per_slab - 1, -1, -1))
                cls.partial.add(slab)
            slab = cls.partial.items[-1]
            free_slots = self._slab_free_slots[slab]
            take = min(count - len(out), len(free_slots))
            if take == 1:  # a full pool's put: one slot at a time, each freed by an eviction
                out.append(slab * self.slab_bytes + free_slots.pop() * slot_bytes)
            else:
                # the slots that many allocs would pop, lowest first: slots freed by evicting
                # blocks in LRU order come back reversed, and a put's slots in reverse order are
                # no two adjacent, so its client copies (and opens its window) a block at a time
                cut = len(free_slots) - take
                slots = np.sort(np.array(free_slots[cut:], dtype=np.int64))
                del free_slots[cut:]
                out += (slots * slot_bytes + slab * self.slab_bytes).tolist()
            self._slab_used[slab] += take
            if not free_slots:
                cls.partial.remove(slab)
            self.used_bytes += take * slot_bytes
        return out

    def free(self, offset: int) -> None:
        slab, within = divmod(offset, self.slab_bytes)
        if not 0 <= slab < self.num_slabs:
            raise InvalidArgument(f"offset {offset} is outside the arena")
        slot_bytes = self._slab_class[slab]
        if slot_bytes == 0 or within % slot_bytes or self._slab_used[slab] <= 0:
            raise InvalidArgument(f"offset {offset} is not an allocated slot")
        owner = self._seg_owner[slab // self.slabs_per_segment]
        cls = self._classes[(owner, slot_bytes)]
        free_slots = self._slab_free_slots[slab]
        if not free_slots:
            cls.partial.add(slab)
        free_slots.append(within // slot_bytes)
        self._slab_used[slab] -= 1
        self.used_bytes -= slot_bytes
        if self._slab_used[slab] == 0:  # whole slab free: back to its segment
            cls.partial.remove(slab)
            self._slab_class[slab] = 0
            self._slab_free_slots[slab] = []
            self._give_back_slab(slab, owner)

    def can_hand_over(self, offset: int, block_bytes: int, owner: int) -> bool:
        """Whether the allocated slot at ``offset``, about to be given up by an eviction, is
        the very slot ``alloc_many(block_bytes, 1, owner)`` would hand out right after its
        ``free``, so a put may take it over as it is (no free, no alloc; the same state):
        same size class and owner, and its slab holds other blocks (it stays partial, not
        given back to its segment). Only right after ``alloc_many`` came back empty for this
        class and owner (no free slot, no slab to take): then the freed slot is the only one
        it could give. A full pool's put evicted and allocated one block at a time, ~2.5 us
        a block here; this is the common case of that loop."""
        slab = offset // self.slab_bytes
        return (
            self._slab_class[slab] == slot_size_for(block_bytes)
            and self._seg_owner[slab // self.slabs_per_segment] == owner
            and self._slab_used[slab] > 1
        )

    def _take_slab(self, owner: int) -> int | None:
        """A free slab of a segment of ``owner``, taking a free segment for it if it has none."""
        segs = self._owner_partial.get(owner)
        if segs is None or not segs.items:
            if not self._free_segments:
                return None
            seg = self._free_segments[-1]
            last = self._seg_last_owner[seg]
            generation = int(self._seg_generation[seg]) + (last not in (NO_OWNER, owner))
            if self._on_new_owner is not None:
                self._on_new_owner(seg, owner, generation)  # may raise: nothing changed yet
            self._seg_generation[seg] = generation
            self._free_segments.pop()
            self._seg_owner[seg] = owner
            self._seg_last_owner[seg] = owner
            free = len(self._seg_free_slabs[seg])
            self._free_segment_slabs -= free
            self._owner_free_slabs[owner] = self._owner_free_slabs.get(owner, 0) + free
            segs = self._owner_partial.setdefault(owner, _IndexedList())
            segs.add(seg)
        seg = segs.items[-1]
        slabs = self._seg_free_slabs[seg]
        slab = slabs.pop()
        self._owner_free_slabs[owner] -= 1
        if not slabs:
            segs.remove(seg)
        return slab

    def _give_back_slab(self, slab: int, owner: int) -> None:
        """Return an emptied slab to its segment; a segment with no slab in use goes back to
        the free segments (for any owner)."""
        seg = slab // self.slabs_per_segment
        slabs = self._seg_free_slabs[seg]
        segs = self._owner_partial.setdefault(owner, _IndexedList())
        if not slabs:
            segs.add(seg)
        slabs.append(slab)
        self._owner_free_slabs[owner] = self._owner_free_slabs.get(owner, 0) + 1
        if len(slabs) == self.segment_slabs(seg):
            segs.remove(seg)
            self._owner_free_slabs[owner] -= len(slabs)
            if not self._owner_free_slabs[owner] and not segs.items:
                del self._owner_free_slabs[owner], self._owner_partial[owner]  # bounded by owners holding slabs
            self._seg_owner[seg] = NO_OWNER
            self._free_segments.append(seg)
            self._free_segment_slabs += len(slabs)

    def segment_slabs(self, seg: int) -> int:
        """Slabs in ``seg`` (the last segment may have fewer)."""
        return min(self.slabs_per_segment, self.num_slabs - seg * self.slabs_per_segment)

    def free_slots_for(self, block_bytes: int, owner: int = 0) -> int:
        """Slots of this block size ``owner`` can obtain now without freeing anything."""
        slot_bytes = slot_size_for(block_bytes)
        per_slab = self.slab_bytes // slot_bytes
        cls = self._classes.get((owner, slot_bytes))
        partial = sum(len(self._slab_free_slots[s]) for s in cls.partial.items) if cls is not None else 0
        return partial + (self._owner_free_slabs.get(owner, 0) + self._free_segment_slabs) * per_slab

    def slots_per_slab(self, block_bytes: int) -> int:
        return self.slab_bytes // slot_size_for(block_bytes)

    def slab_of(self, offset: int) -> int:
        return offset // self.slab_bytes

    def segment_of(self, offset: int) -> int:
        return offset // self.segment_bytes

    def segment_owner(self, segment: int) -> int:
        """The owner of ``segment`` now (``NO_OWNER`` when it is free)."""
        return self._seg_owner[segment]

    def segment_generation(self, segment: int) -> int:
        return int(self._seg_generation[segment])

    def generations_of(self, offsets: list[int]) -> list[int]:
        """The generation of the segment of each offset (the wire's ``segment_generations``)."""
        if not offsets:
            return []
        return self._seg_generation[np.asarray(offsets, dtype=np.int64) // self.segment_bytes].tolist()  # type: ignore[no-any-return]

    def segment_slabs_used(self, segment: int) -> int:
        """Slabs of ``segment`` given to a size class now."""
        return self.segment_slabs(segment) - len(self._seg_free_slabs[segment])

    def slab_used_slots(self, slab: int) -> int:
        return self._slab_used[slab]

    def slot_bytes_at(self, offset: int) -> int:
        return self._slab_class[offset // self.slab_bytes]

    def free_slabs(self) -> int:
        return self._free_segment_slabs + sum(self._owner_free_slabs.values())

    def free_segments(self) -> int:
        return len(self._free_segments)

    def can_alloc(self, block_bytes: int, owner: int = 0) -> bool:
        cls = self._classes.get((owner, slot_size_for(block_bytes)))
        own = self._owner_partial.get(owner)
        has_partial = cls is not None and bool(cls.partial.items)
        return bool(self._free_segments) or (own is not None and bool(own.items)) or has_partial

    def check_invariants(self) -> None:
        """The allocator's accounting (debug mode; its owner calls it under its lock): each
        slab is free or of one class of its segment's owner, its used and free slots add up to
        the class's slots, the partial lists are exactly the class slabs with a free slot,
        ``used_bytes`` is the sum of the used slots; every slab of a segment belongs to that
        segment's owner, a free segment has no slab in use, and the free-slab counts add up."""
        name = "SlabAllocator"
        self._check_segments(name)
        used_bytes = 0
        class_of_slab: dict[int, tuple[int, int]] = {}
        for key, size_class in self._classes.items():
            for slab in size_class.partial.items:
                class_of_slab[slab] = key
        for slab in range(self.num_slabs):
            slot_bytes = self._slab_class[slab]
            used = self._slab_used[slab]
            free_slots = self._slab_free_slots[slab]
            seg = slab // self.slabs_per_segment
            owner = self._seg_owner[seg]
            if slot_bytes == 0:
                require(
                    name,
                    "a classless slab is free and empty",
                    slab in self._seg_free_slabs[seg] and used == 0 and not free_slots,
                    str(slab),
                )
                continue
            require(name, "a slab in use lies in an owned segment", owner != NO_OWNER, str(slab))
            cls = self._classes.get((owner, slot_bytes))
            require(name, "a slab's class is known", cls is not None, str(slot_bytes))
            assert cls is not None
            require(
                name,
                "used and free slots fill the slab",
                used > 0 and used + len(free_slots) == cls.slots_per_slab and len(set(free_slots)) == len(free_slots),
                f"slab {slab}: {used} used + {len(free_slots)} free, {cls.slots_per_slab} slots",
            )
            require(name, "partial slabs are those with a free slot", (slab in cls.partial.pos) == bool(free_slots))
            require(
                name,
                "every slab of a segment belongs to that segment's owner",
                slab not in class_of_slab or class_of_slab[slab][0] == owner,
                f"slab {slab} of segment {seg} (owner {owner}) is listed for owner {class_of_slab.get(slab)}",
            )
            used_bytes += used * slot_bytes
        for cls in self._classes.values():
            require(name, "the partial index matches its list", len(cls.partial.pos) == len(cls.partial.items))
            for pos, slab in enumerate(cls.partial.items):
                require(name, "the partial index matches its list", cls.partial.pos.get(slab) == pos, str(slab))
        require(
            name, "used bytes are the used slots", used_bytes == self.used_bytes, f"{used_bytes} != {self.used_bytes}"
        )

    def _check_segments(self, name: str) -> None:
        free = set(self._free_segments)
        require(name, "a free segment is listed once", len(free) == len(self._free_segments))
        owner_free: dict[int, int] = {}
        free_segment_slabs = 0
        for seg in range(self.num_segments):
            owner = self._seg_owner[seg]
            slabs = self._seg_free_slabs[seg]
            require(name, "a segment's free slabs are its own and listed once", len(set(slabs)) == len(slabs))
            first = seg * self.slabs_per_segment
            require(
                name,
                "a segment's free slabs are its own and listed once",
                all(first <= s < first + self.segment_slabs(seg) for s in slabs),
                str(seg),
            )
            if owner == NO_OWNER:
                require(
                    name,
                    "a free segment has no slab in use",
                    seg in free and len(slabs) == self.segment_slabs(seg),
                    str(seg),
                )
                free_segment_slabs += len(slabs)
                continue
            require(name, "an owned segment is not free", seg not in free, str(seg))
            require(name, "an owned segment has a slab in use", len(slabs) < self.segment_slabs(seg), str(seg))
            owner_free[owner] = owner_free.get(owner, 0) + len(slabs)
            segs = self._owner_partial.get(owner)
            require(
                name,
                "an owner's partial segments are its segments with a free slab",
                (segs is not None and seg in segs.pos) == bool(slabs),
                str(seg),
            )
        require(name, "free segment slabs add up", free_segment_slabs == self._free_segment_slabs)
        require(
            name,
            "owners' free slabs add up",
            {o: n for o, n in owner_free.items() if n} == {o: n for o, n in self._owner_free_slabs.items() if n},
        )
        for owner, segs in self._owner_partial.items():
            for seg in segs.items:
                require(name, "a partial segment is its owner's", self._seg_owner[seg] == owner, str(seg))
