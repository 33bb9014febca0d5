"""SlabAllocator with segments and owners (per-tenant arenas, docs/security.md): under any
sequence of allocs and frees by several owners, no slab of a segment is ever given to two
owners, an owner's slots lie only in its own segments, and a segment emptied by one owner
is reusable by any other owner and size class (checked against a model of live slots)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.storage.allocator import NO_OWNER, SlabAllocator, slot_size_for

SLAB_BYTES = 4096
SLABS_PER_SEGMENT = 2
NUM_SEGMENTS = 4
SEGMENT_BYTES = SLAB_BYTES * SLABS_PER_SEGMENT
SIZES = [100, 1000, 1500, 4096]
OWNERS = [0, 1, 2]

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.sampled_from(OWNERS), st.sampled_from(SIZES)),
        st.tuples(st.just("free"), st.just(0), st.integers(min_value=0, max_value=10_000)),
    ),
    min_size=1,
    max_size=150,
)


@settings(max_examples=120, deadline=None)
@given(ops=OPS, tail=st.integers(min_value=0, max_value=SLABS_PER_SEGMENT - 1))
def test_no_slab_of_a_segment_is_ever_given_to_two_owners(ops: list[tuple[str, int, int]], tail: int) -> None:
    capacity = NUM_SEGMENTS * SEGMENT_BYTES - tail * SLAB_BYTES  # the last segment may be short
    told: list[tuple[int, int, int]] = []
    alloc = SlabAllocator(capacity, SLAB_BYTES, SEGMENT_BYTES, lambda seg, own, gen: told.append((seg, own, gen)))
    generation = [0] * alloc.num_segments
    live: dict[int, tuple[int, int]] = {}  # offset -> (owner, slot bytes)
    seg_owner_model: dict[int, int] = {}  # segment -> owner, while it holds a live slot
    last_owner: dict[int, int] = {}
    for op, owner, arg in ops:
        if op == "alloc":
            before = list(told)
            offset = alloc.alloc(arg, owner)
            if offset is None:
                assert not alloc.can_alloc(arg, owner)
                assert alloc.free_segments() == 0
                continue
            slot = slot_size_for(arg)
            seg = offset // SEGMENT_BYTES
            assert seg_owner_model.get(seg, owner) == owner, "a segment given to a second owner"
            assert alloc.segment_owner(seg) == owner
            if seg not in seg_owner_model:  # a free segment taken: the arena is told first
                generation[seg] += last_owner.get(seg, owner) != owner  # raised only when the owner changed
                assert told[len(before) :] == [(seg, owner, generation[seg])]
                assert alloc.segment_generation(seg) == generation[seg]
            else:
                assert told == before
            for other, (_, other_slot) in live.items():
                assert offset + slot <= other or other + other_slot <= offset, "overlapping slots"
            seg_owner_model[seg] = owner
            last_owner[seg] = owner
            live[offset] = (owner, slot)
        elif live:
            offset = sorted(live)[arg % len(live)]
            alloc.free(offset)
            del live[offset]
            seg = offset // SEGMENT_BYTES
            if not any(o // SEGMENT_BYTES == seg for o in live):
                del seg_owner_model[seg]
                assert alloc.segment_owner(seg) == NO_OWNER  # empty: back to the free segments
        alloc.check_invariants()
        assert alloc.used_bytes == sum(slot for _, slot in live.values())
        assert alloc.free_segments() == alloc.num_segments - len(seg_owner_model)
    for offset in list(live):
        alloc.free(offset)
    assert alloc.used_bytes == 0 and alloc.free_segments() == alloc.num_segments


@settings(max_examples=40, deadline=None)
@given(first=st.sampled_from(SIZES), second=st.sampled_from(SIZES))
def test_a_segment_freed_by_one_owner_is_reusable_by_another(first: int, second: int) -> None:
    renewed: list[int] = []
    alloc = SlabAllocator(
        NUM_SEGMENTS * SEGMENT_BYTES, SLAB_BYTES, SEGMENT_BYTES, lambda seg, own, gen: gen and renewed.append(seg)
    )
    taken = []
    while (off := alloc.alloc(first, owner=1)) is not None:
        taken.append(off)
    assert len(taken) == NUM_SEGMENTS * SLABS_PER_SEGMENT * (SLAB_BYTES // slot_size_for(first))
    assert alloc.alloc(second, owner=2) is None  # owner 1 holds every segment
    for off in taken:
        alloc.free(off)
    again = []
    while (off := alloc.alloc(second, owner=2)) is not None:
        again.append(off)
    assert len(again) == NUM_SEGMENTS * SLABS_PER_SEGMENT * (SLAB_BYTES // slot_size_for(second))
    assert sorted(renewed) == list(range(NUM_SEGMENTS))  # each got fresh memory for its new owner
    assert {alloc.segment_generation(s) for s in range(NUM_SEGMENTS)} == {1}
    alloc.check_invariants()


def test_one_owner_and_one_segment_hand_out_slabs_as_before() -> None:
    """No credentials: one segment, one owner; the same order of slabs as the allocator
    without segments (lowest first, a freed slab reused first), generations stay 0."""
    alloc = SlabAllocator(4 * SLAB_BYTES, SLAB_BYTES)
    assert alloc.num_segments == 1
    first = [alloc.alloc(SLAB_BYTES) for _ in range(3)]
    assert first == [0, SLAB_BYTES, 2 * SLAB_BYTES]
    alloc.free(SLAB_BYTES)
    assert alloc.alloc(SLAB_BYTES) == SLAB_BYTES
    assert alloc.generations_of([0, SLAB_BYTES]) == [0, 0]


def test_a_segment_whose_fresh_memory_cannot_be_had_is_not_taken() -> None:
    """The arena raises from ``on_new_owner`` (no memory for a fresh memfd): the allocator
    has changed nothing, and the segment is taken once the arena can back it."""
    refuse = [True]

    def hook(seg: int, owner: int, generation: int) -> None:
        if generation and refuse[0]:
            raise MemoryError("no room for a fresh segment")

    alloc = SlabAllocator(2 * SEGMENT_BYTES, SLAB_BYTES, SEGMENT_BYTES, hook)
    taken = [alloc.alloc(SLAB_BYTES, owner=1) for _ in range(2 * SLABS_PER_SEGMENT)]
    for off in taken:
        assert off is not None
        alloc.free(off)
    try:
        alloc.alloc(SLAB_BYTES, owner=2)
    except MemoryError:
        pass
    else:
        raise AssertionError("the hook's refusal was swallowed")
    alloc.check_invariants()
    assert alloc.free_segments() == 2 and alloc.used_bytes == 0 and alloc.segment_generation(1) == 0
    refuse[0] = False
    off = alloc.alloc(SLAB_BYTES, owner=2)
    assert off is not None and alloc.segment_generation(off // SEGMENT_BYTES) == 1
