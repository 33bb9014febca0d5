"""SlabAllocator under random alloc/free sequences, checked against a model of live slots."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.storage.allocator import SLOT_ALIGN_BYTES, SlabAllocator, slot_size_for

SLAB_BYTES = 4096
NUM_SLABS = 6
SIZES = [100, 512, 1000, 1500, 4096]  # slot sizes 128, 512, 1024, 1536, 4096

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.sampled_from(SIZES)),
        st.tuples(st.just("free"), st.integers(min_value=0, max_value=10_000)),
    ),
    min_size=1,
    max_size=120,
)


@settings(max_examples=80, deadline=None)
@given(ops=OPS)
def test_random_alloc_free_never_overlaps_and_accounts_exactly(ops: list[tuple[str, int]]) -> None:
    alloc = SlabAllocator(NUM_SLABS * SLAB_BYTES + 100, SLAB_BYTES)  # the tail < 1 slab is unused
    assert alloc.capacity_bytes == NUM_SLABS * SLAB_BYTES
    live: dict[int, int] = {}  # offset -> slot bytes
    for op, arg in ops:
        if op == "alloc":
            offset = alloc.alloc(arg)
            slot = slot_size_for(arg)
            if offset is None:
                # refused only when no free slab and no partial slab of this class
                assert alloc.free_slabs() == 0
                assert not alloc.can_alloc(arg)
                continue
            assert offset % SLOT_ALIGN_BYTES == 0
            assert offset >= 0 and offset + slot <= alloc.capacity_bytes
            assert offset // SLAB_BYTES == (offset + slot - 1) // SLAB_BYTES  # never straddles a slab
            for other, other_slot in live.items():
                assert offset + slot <= other or other + other_slot <= offset, "overlapping slots"
            assert alloc.slot_bytes_at(offset) == slot
            live[offset] = slot
        elif live:
            offset = sorted(live)[arg % len(live)]
            alloc.free(offset)
            del live[offset]
        assert alloc.used_bytes == sum(live.values())
        slabs_in_use = {off // SLAB_BYTES for off in live}
        assert alloc.free_slabs() == NUM_SLABS - len(slabs_in_use)
    for offset in list(live):
        alloc.free(offset)
    assert alloc.used_bytes == 0 and alloc.free_slabs() == NUM_SLABS


@settings(max_examples=30, deadline=None)
@given(first=st.sampled_from(SIZES), second=st.sampled_from(SIZES))
def test_freed_slabs_are_reusable_by_another_size_class(first: int, second: int) -> None:
    alloc = SlabAllocator(NUM_SLABS * SLAB_BYTES, SLAB_BYTES)
    taken = []
    while (off := alloc.alloc(first)) is not None:
        taken.append(off)
    assert len(taken) == NUM_SLABS * (SLAB_BYTES // slot_size_for(first))
    if slot_size_for(second) != slot_size_for(first):
        assert alloc.alloc(second) is None  # full: every slab belongs to the first class
    for off in taken:
        alloc.free(off)
    again = []
    while (off := alloc.alloc(second)) is not None:
        again.append(off)
    assert len(again) == NUM_SLABS * (SLAB_BYTES // slot_size_for(second))
    assert alloc.used_bytes == len(again) * slot_size_for(second)


def _state(alloc: SlabAllocator) -> tuple[object, ...]:
    """Everything an allocation can change, comparable between two allocators."""
    # a size class with no slab is the same as none (alloc makes one before it asks for a slab)
    classes = {key: (c.partial.items[:], dict(c.partial.pos)) for key, c in alloc._classes.items() if c.partial.items}
    owners = {owner: segs.items[:] for owner, segs in alloc._owner_partial.items()}
    return (
        list(alloc._slab_class),
        list(alloc._slab_used),
        [slots[:] for slots in alloc._slab_free_slots],
        classes,
        owners,
        dict(alloc._owner_free_slabs),
        alloc._free_segments[:],
        [slabs[:] for slabs in alloc._seg_free_slabs],
        list(alloc._seg_owner),
        alloc.used_bytes,
    )


BATCH_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.sampled_from(SIZES), st.integers(0, 40), st.integers(0, 2)),
        st.tuples(st.just("free"), st.integers(0, 10_000), st.integers(1, 30), st.just(0)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=120, deadline=None)
@given(ops=BATCH_OPS, segment_slabs=st.sampled_from([0, 1, 2, 3]))
def test_alloc_many_gives_what_that_many_allocs_give(ops: list[tuple[str, int, int, int]], segment_slabs: int) -> None:
    """A batch of ``count`` slots is what ``count`` single allocations give (``alloc`` takes
    one slot at a time, the path a full pool's put uses): the same offsets (lowest first
    within a slab) and the same state after, with owners and segments, across slab
    boundaries, up to running out."""
    capacity = NUM_SLABS * SLAB_BYTES
    batched = SlabAllocator(capacity, SLAB_BYTES, segment_slabs * SLAB_BYTES)
    single = SlabAllocator(capacity, SLAB_BYTES, segment_slabs * SLAB_BYTES)
    live: list[int] = []
    for op, size, count, owner in ops:
        if op == "alloc":
            got = batched.alloc_many(size, count, owner)
            want: list[int] = []
            while len(want) < count:
                offset = single.alloc(size, owner)
                if offset is None:
                    break
                want.append(offset)
            assert sorted(got) == sorted(want)
            for lo, hi in itertools.pairwise(got):  # ascending within a slab (a put's slots end to end)
                assert lo < hi or lo // SLAB_BYTES != hi // SLAB_BYTES
            live += got
        else:
            for _ in range(min(count, len(live))):
                offset = live.pop(size % len(live))
                batched.free(offset)
                single.free(offset)
        assert _state(batched) == _state(single)
        batched.check_invariants()


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(1, 24),
    refuse_at=st.integers(1, 4),
    before=st.lists(st.integers(0, 2), max_size=6),
)
def test_alloc_many_refused_a_segment_leaves_nothing_taken(count: int, refuse_at: int, before: list[int]) -> None:
    """The arena may refuse a segment (its ``on_new_owner`` hook raises: no fresh memory):
    ``alloc_many`` then gives back the slots it took in the same call, so the state is the one
    before the call (nothing allocated and owned by no one)."""
    calls = [0]

    def hook(segment: int, owner: int, generation: int) -> None:
        calls[0] += 1
        if armed[0] and calls[0] >= refuse_at:
            raise MemoryError("no fresh memory for the segment")

    armed = [False]
    alloc = SlabAllocator(NUM_SLABS * SLAB_BYTES, SLAB_BYTES, SLAB_BYTES, on_new_owner=hook)
    for owner in before:
        alloc.alloc_many(1024, 2, owner)

    def taken(a: SlabAllocator) -> tuple[object, ...]:
        """What is allocated and to whom (not the order of the free stacks, nor the
        generations of segments handed over and back, as a loop of allocs would leave them)."""
        return (a.used_bytes, list(a._slab_class), list(a._slab_used), list(a._seg_owner), sorted(a._free_segments))

    state = taken(alloc)
    armed[0], calls[0] = True, 0
    try:
        alloc.alloc_many(1024, count, 3)
    except MemoryError:
        assert taken(alloc) == state
    alloc.check_invariants()
