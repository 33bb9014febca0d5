"""SlabAllocator under random alloc/free sequences, checked against a model of live slots."""

from __future__ import annotations

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
