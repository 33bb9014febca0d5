"""One pass per byte (issue 13, item 2): ``read_rows`` / ``write_rows`` copy each run of
adjacent blocks with one call that checksums as it copies (``copy_checksum_rows``; the
kernels themselves: tests/property/test_checksum_native.py). The checksums must stay exactly
xxh3-64 of the whole block (what every store, disk file and peer already holds), whatever
the runs."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.client import blocks as blocks_mod
from kvpool.client.blocks import adjacent_runs, fill_slots, read_rows, use_rows, write_rows
from kvpool.core.arena_map import PutWindow
from kvpool.core.checksum import checksum64

PAGE = mmap.ALLOCATIONGRANULARITY


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> int:
    """Runs of at most 1000 bytes (not a divisor of any block size used here)."""
    monkeypatch.setattr(blocks_mod, "COPY_RUN_BYTES", 1000)
    return 1000


def test_runs_join_blocks_adjacent_on_both_sides_up_to_a_piece(small_pieces: int) -> None:
    bb = 300  # 3 blocks fit in a 1000-byte piece
    offsets = [0, 300, 600, 900, 1200, 5000, 5300, 9000]
    indices = [0, 1, 2, 3, 4, 5, 7, 8]  # 5 -> 7 breaks the run on the row side
    assert adjacent_runs(offsets, indices, bb) == [(0, 3), (3, 2), (5, 1), (6, 1), (7, 1)]
    assert adjacent_runs([0, 4096], [0, 1], 4096) == [(0, 1), (1, 1)]  # a block larger than a piece: alone


def _layout(block_bytes: int, order: list[int], gaps: list[bool]) -> tuple[list[int], np.ndarray]:
    """Slot offsets (some adjacent, some a block apart, in ``order``) and a zeroed arena holding them."""
    offsets, cursor = [], 0
    for gap in gaps:
        offsets.append(cursor)
        cursor += block_bytes + (block_bytes if gap else 0)
    return [offsets[i] for i in order], np.zeros(cursor, dtype=np.uint8)


@settings(max_examples=40, deadline=None)
@given(
    block_bytes=st.sampled_from([64, 300, 1000, 2500]),
    order=st.permutations(list(range(8))),
    gaps=st.lists(st.booleans(), min_size=8, max_size=8),
    seed=st.integers(0, 1000),
)
def test_read_and_write_rows_round_trip_with_true_checksums(
    block_bytes: int, order: list[int], gaps: list[bool], seed: int
) -> None:
    """Slots laid out with some adjacent and some apart, in any order; what comes back is
    the bytes put, and every checksum is the one-shot xxh3-64 of its row."""
    old = blocks_mod.COPY_RUN_BYTES
    blocks_mod.COPY_RUN_BYTES = 1000
    try:
        offsets, arena = _layout(block_bytes, order, gaps)
        rows = np.random.default_rng(seed).integers(0, 256, (8, block_bytes), dtype=np.uint8)
        sums = write_rows(arena, rows, list(range(8)), offsets)
        assert sums == [checksum64(rows[i]) for i in range(8)]
        out = np.zeros_like(rows)
        assert read_rows(arena, out, offsets, sums, "test") == 8
        assert np.array_equal(out, rows)
    finally:
        blocks_mod.COPY_RUN_BYTES = old


@pytest.mark.parametrize("bad", [0, 1, 2, 4])
def test_a_bad_block_inside_a_run_ends_the_read_there(small_pieces: int, bad: int) -> None:
    bb = 250  # 4 blocks per piece: blocks 0-3 are one run, 4 the next
    rows = np.random.default_rng(bad).integers(0, 256, (5, bb), dtype=np.uint8)
    arena = np.zeros(5 * bb, dtype=np.uint8)
    offsets = [i * bb for i in range(5)]
    sums = write_rows(arena, rows, list(range(5)), offsets)
    arena[offsets[bad] + 17] ^= 0xFF
    assert read_rows(arena, np.zeros_like(rows), offsets, sums, "test") == bad


def test_write_rows_through_a_put_window_in_runs(small_pieces: int) -> None:
    """Adjacent slots of one put are written with one copy through the window; the window
    refuses a range that is not whole slots of the put."""
    bb = 200
    fd = os.memfd_create("test-block-copy", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4 * PAGE)
    try:
        offsets = [0, 200, 400, 2 * PAGE]  # three adjacent slots, one apart
        rows = np.random.default_rng(1).integers(0, 256, (4, bb), dtype=np.uint8)
        with PutWindow(fd, 4 * PAGE, offsets, bb) as window:
            sums = write_rows(window, rows, [0, 1, 2, 3], offsets)
            with pytest.raises(Exception, match="not slots of this put"):
                window.view_of(0, 500)  # two and a half slots
            with pytest.raises(Exception, match="not slots of this put"):
                window.view_of(400, 800)  # slot 400 and the unheld bytes after it
        assert sums == [checksum64(r) for r in rows]
        back = np.frombuffer(os.pread(fd, 4 * PAGE, 0), dtype=np.uint8)
        for off, row in zip(offsets, rows, strict=True):
            assert np.array_equal(back[off : off + bb], row)
    finally:
        os.close(fd)


@settings(max_examples=40, deadline=None)
@given(
    block_bytes=st.sampled_from([64, 300, 1000, 2500]),
    order=st.permutations(list(range(8))),
    gaps=st.lists(st.booleans(), min_size=8, max_size=8),
    bad=st.one_of(st.none(), st.integers(0, 7)),
    seed=st.integers(0, 1000),
)
def test_fill_slots_and_use_rows_hand_out_every_slot_once_with_true_checksums(
    block_bytes: int, order: list[int], gaps: list[bool], bad: int | None, seed: int
) -> None:
    """The in-place path (connectors): ``fill`` is asked for every slot exactly once, in
    runs of adjacent slots; the checksums are the one-shot xxh3-64 of what it wrote; ``use``
    sees exactly the verified leading blocks, in order, and nothing from a bad block on."""
    old = blocks_mod.ENGINE_RUN_BYTES
    blocks_mod.ENGINE_RUN_BYTES = 1000
    try:
        offsets, arena = _layout(block_bytes, order, gaps)
        rows = np.random.default_rng(seed).integers(0, 256, (8, block_bytes), dtype=np.uint8)
        asked: list[int] = []

        def fill(first: int, count: int, slots: np.ndarray) -> None:
            assert slots.shape == (count, block_bytes)
            assert count == 1 or count * block_bytes <= 1000
            asked.extend(range(first, first + count))
            slots[:] = rows[first : first + count]

        sums = fill_slots(arena, block_bytes, list(range(8)), offsets, fill)
        assert sorted(asked) == list(range(8)) and sums == [checksum64(rows[i]) for i in range(8)]
        if bad is not None:
            arena[offsets[bad] + block_bytes // 2] ^= 0x40
        seen: list[int] = []

        def use(first: int, count: int, got: np.ndarray) -> None:
            assert np.array_equal(got, rows[first : first + count])
            seen.extend(range(first, first + count))

        good = use_rows(arena, block_bytes, offsets, sums, use, "test")
        assert good == (8 if bad is None else bad) and seen == list(range(good))
    finally:
        blocks_mod.ENGINE_RUN_BYTES = old


@pytest.mark.parametrize("block_bytes", [64 * 1024, 256 * 1024])
def test_slots_either_side_of_a_segment_edge_are_written_through_their_own_mappings(block_bytes: int) -> None:
    """A per-tenant arena maps each segment of a put on its own: two slots side by side in
    the arena but on either side of a segment edge are written as two runs (write_rows and
    fill_slots), never as one run that spans two mappings (InvalidArgument before)."""
    segment = 2 * 1024 * 1024
    fds = [os.memfd_create(f"test-segment-{k}", os.MFD_CLOEXEC) for k in range(2)]
    try:
        for fd in fds:
            os.ftruncate(fd, segment)
        offsets = [segment - block_bytes, segment]
        rows = np.random.default_rng(block_bytes).integers(0, 256, (2, block_bytes), dtype=np.uint8)
        with PutWindow(lambda seg: fds[seg], 2 * segment, offsets, block_bytes, segment_bytes=segment) as window:
            sums = write_rows(window, rows, [0, 1], offsets)
        assert sums == [checksum64(rows[0]), checksum64(rows[1])]
        assert os.pread(fds[0], block_bytes, segment - block_bytes) == rows[0].tobytes()
        assert os.pread(fds[1], block_bytes, 0) == rows[1].tobytes()

        calls: list[tuple[int, int]] = []

        def fill(first: int, count: int, slots: np.ndarray) -> None:
            calls.append((first, count))
            slots[:] = 255 - rows[first : first + count]

        with PutWindow(lambda seg: fds[seg], 2 * segment, offsets, block_bytes, segment_bytes=segment) as window:
            sums = fill_slots(window, block_bytes, [0, 1], offsets, fill)
        assert calls == [(0, 1), (1, 1)] and sums == [checksum64(255 - rows[0]), checksum64(255 - rows[1])]
        assert os.pread(fds[1], block_bytes, 0) == (255 - rows[1]).tobytes()
    finally:
        for fd in fds:
            os.close(fd)
