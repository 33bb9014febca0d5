"""Runs of blocks that lie end to end on both sides of a read, moved as one message.

A UCX read of a whole prompt is hundreds of blocks; sent one tag message each, every block
pays a rendezvous (request, get, completion) on both workers: on this host 512 x 256 KiB
messages moved 128 MiB at about half the speed of one 128 MiB message (the same bytes, the
same two processes). A batch the client put together usually sits end to end in the node's
arena (the allocator places one batch's blocks adjacently) and is usually read into rows of
one array, so most prompts are a handful of runs. The reader says which of its rows continue
the row before (``reader_joins``), the server keeps only the joins its arena also has
(``server_runs``) and answers its cut; each run is then one message, and every block in it is
still verified on its own when it lands (``verify_in_place``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


def _root(row: np.ndarray) -> np.ndarray:
    """The array that owns ``row``'s memory (the last ndarray up its chain of bases)."""
    while isinstance(row.base, np.ndarray):
        row = row.base
    return row


def _end_to_end(before: np.ndarray, row: np.ndarray) -> bool:
    return before.ctypes.data + before.nbytes == row.ctypes.data and _root(before) is _root(row)


def reader_joins(rows: Sequence[np.ndarray]) -> list[bool]:
    """Per row: whether it starts where the row before ends, in memory of the same owner (a
    contiguous owner, so one span covers both: ``span``). Rows not C-contiguous or not
    writable never join."""
    joins = [False] * len(rows)
    for i in range(1, len(rows)):
        before, row = rows[i - 1], rows[i]
        joins[i] = (
            before.flags.c_contiguous
            and row.flags.c_contiguous
            and row.flags.writeable
            and _root(row).flags.c_contiguous
            and _end_to_end(before, row)
        )
    return joins


def run_bounds(joins: Sequence[bool]) -> list[tuple[int, int]]:
    """``(start, end)`` item ranges of the runs a joins list describes."""
    starts = [i for i, join in enumerate(joins) if i == 0 or not join]
    return [(start, end) for start, end in zip(starts, [*starts[1:], len(joins)])]


def span(rows: Sequence[np.ndarray]) -> np.ndarray:
    """One writable byte array over rows that ``reader_joins`` joined (the first row's owner,
    sliced): the target of the run's one receive."""
    for before, row in itertools.pairwise(rows):
        if not _end_to_end(before, row):  # the caller checked; a wrong span would write past the rows
            raise ValueError("the rows do not lie end to end")
    root = _root(rows[0])
    flat = root.reshape(-1).view(np.uint8)  # a view: the owner is C-contiguous
    offset = rows[0].ctypes.data - flat.ctypes.data
    nbytes = sum(row.nbytes for row in rows)
    if offset < 0 or offset + nbytes > flat.nbytes:
        raise ValueError("the rows do not lie inside one array")
    return flat[offset : offset + nbytes]


def server_runs(
    arena: np.ndarray, views: Sequence[memoryview], asked: Sequence[bool]
) -> tuple[list[bool], list[np.ndarray]]:
    """The server's cut of a READ_UCX_RUNS: join an item to the one before where the reader
    asked for it and the two lie end to end in ``arena``; returns the joins (the reply's
    bitmap) and one array per run (what each message sends)."""
    origin = arena.ctypes.data
    addresses = [np.frombuffer(view, dtype=np.uint8).ctypes.data - origin for view in views]
    inside = [at >= 0 and at + len(view) <= arena.nbytes for at, view in zip(addresses, views)]
    joins = [False] * len(views)
    for i in range(1, len(views)):
        end_to_end = addresses[i - 1] + len(views[i - 1]) == addresses[i]
        joins[i] = bool(asked[i]) and inside[i - 1] and inside[i] and end_to_end
    runs = []
    for start, stop in run_bounds(joins):
        first = addresses[start]
        if stop - start == 1:
            runs.append(np.frombuffer(views[start], dtype=np.uint8))
        else:
            runs.append(arena[first : addresses[stop - 1] + len(views[stop - 1])])
    return joins, runs
