"""The run-finders of a batch (``adjacent_runs``: slots copied in one call; ``page_runs``: the
page ranges a put window opens) are numpy, not a loop per block; hypothesis holds each to the
plain loop it replaced, segments and caps included."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.client.blocks import adjacent_runs
from kvpool.core.arena_map import page_runs
from kvpool.core.errors import InvalidArgument


def runs_by_loop(offsets: list[int], indices: list[int], bb: int, most: int, split: int) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for k in range(len(offsets)):
        if runs:
            first, count = runs[-1]
            last = first + count - 1
            if (
                count < most
                and offsets[k] == offsets[last] + bb
                and indices[k] == indices[last] + 1
                and not (split and offsets[k] // split != offsets[first] // split)
            ):
                runs[-1] = (first, count + 1)
                continue
        runs.append((k, 1))
    return runs


def pages_by_loop(capacity: int, offsets: list[int], length: int, page: int, segment: int) -> list[tuple[int, int]]:
    ranges: list[tuple[int, int]] = []
    for offset in sorted(offsets):
        if offset < 0 or length <= 0 or offset + length > capacity:
            raise InvalidArgument("outside")
        start, stop = offset - offset % page, min(-(-(offset + length) // page) * page, capacity)
        same_segment = not segment or (ranges and ranges[-1][0] // segment == start // segment)
        if ranges and start <= ranges[-1][1] and same_segment:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], stop))
        else:
            ranges.append((start, stop))
    return ranges


@settings(max_examples=300, deadline=None)
@given(
    slots=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=60),
    bb=st.sampled_from([1, 2, 4]),
    most=st.integers(1, 6),
    split=st.sampled_from([0, 4, 8, 16]),
    adjacent=st.integers(0, 3),
)
def test_adjacent_runs_match_the_loop(
    slots: list[tuple[int, int]], bb: int, most: int, split: int, adjacent: int
) -> None:
    offsets, indices = [o * bb for o, _ in slots], [i for _, i in slots]
    for k in range(1, len(offsets), 2) if adjacent else ():  # make many neighbours
        offsets[k], indices[k] = offsets[k - 1] + bb, indices[k - 1] + 1
    assert adjacent_runs(offsets, indices, bb, most * bb, split) == runs_by_loop(offsets, indices, bb, most, split)


@settings(max_examples=300, deadline=None)
@given(
    offsets=st.lists(st.integers(0, 300), max_size=40),
    length=st.integers(1, 40),
    page=st.sampled_from([4, 8, 16]),
    segment_pages=st.sampled_from([0, 2, 4]),
)
def test_page_runs_match_the_loop(offsets: list[int], length: int, page: int, segment_pages: int) -> None:
    capacity, segment = 320, segment_pages * page
    fits = all(o + length <= capacity for o in offsets)
    if not fits:
        with pytest.raises(InvalidArgument):
            page_runs(capacity, offsets, length, page, segment)
        return
    assert page_runs(capacity, offsets, length, page, segment) == pages_by_loop(
        capacity, offsets, length, page, segment
    )
