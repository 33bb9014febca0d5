"""Runs of blocks that lie end to end in memory, moved (or registered) as one piece.

A UCX read of a whole prompt is hundreds of blocks; sent one tag message each, every block
pays a rendezvous (request, get, completion) on both workers: on this host 512 x 256 KiB
messages moved 128 MiB at about half the speed of one 128 MiB message (the same bytes, the
same two processes). A batch the client put together usually sits end to end in the node's
arena (the allocator places one batch's blocks adjacently) and is usually read into rows of
one array, so most prompts are a handful of runs. The reader says which of its rows continue
the row before (``row_joins``), the server keeps only the joins its arena also has
(``server_runs``) and answers its cut; each run is then one message, and every block in it is
still verified on its own when it lands (``verify_in_place``). NIXL registers the same runs of
the reader's rows (``row_spans``).

Rows join by address alone: a run's span covers exactly its rows' bytes, whichever arrays
they belong to, so it never reaches memory the caller did not hand over.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np


def writable_rows(rows: Sequence[np.ndarray]) -> bool:
    """Whether every row is a writable C-contiguous buffer (a read may land in it directly)."""
    return all(row.flags.c_contiguous and row.flags.writeable for row in rows)


def row_joins(rows: Sequence[np.ndarray]) -> list[bool]:
    """Per row: whether it starts where the row before ends (rows from ``writable_rows``)."""
    addresses = [int(row.ctypes.data) for row in rows]
    return [i > 0 and addresses[i - 1] + rows[i - 1].nbytes == addresses[i] for i in range(len(rows))]


def run_bounds(joins: Sequence[bool]) -> list[tuple[int, int]]:
    """``(start, end)`` item ranges of the runs a joins list describes."""
    starts = [i for i, join in enumerate(joins) if i == 0 or not join]
    return [(start, end) for start, end in zip(starts, [*starts[1:], len(joins)])]


def row_spans(rows: Sequence[np.ndarray], max_spans: int = 0) -> list[tuple[int, int]] | None:
    """The (address, bytes) spans covering ``rows`` in order, adjacent rows merged; None when a
    row is not a writable C-contiguous buffer or there are more than ``max_spans`` spans
    (0 = no limit)."""
    if not writable_rows(rows):
        return None
    bounds = run_bounds(row_joins(rows))
    if max_spans and len(bounds) > max_spans:
        return None
    return [(int(rows[start].ctypes.data), sum(row.nbytes for row in rows[start:end])) for start, end in bounds]


def span(rows: Sequence[np.ndarray]) -> np.ndarray:
    """One writable byte array over rows that lie end to end (``row_joins``): the target of
    their run's one receive. It does not own the memory: the rows must outlive the receive."""
    if not all(row_joins(rows)[1:]):  # the caller checked; a wrong span would write past the rows
        raise ValueError("the rows do not lie end to end")
    nbytes = sum(row.nbytes for row in rows)
    return np.frombuffer(memoryview((ctypes.c_uint8 * nbytes).from_address(int(rows[0].ctypes.data))), dtype=np.uint8)


def server_runs(
    arena: np.ndarray, offsets: Sequence[int], lengths: Sequence[int], asked: Sequence[bool]
) -> tuple[list[bool], list[np.ndarray]]:
    """The server's cut of a READ_UCX_RUNS over leased items at arena ``offsets``: join an item
    to the one before where the reader asked for it and the two lie end to end in ``arena``;
    returns the joins (the reply's bitmap) and one array per run (what each message sends)."""
    joins = [i > 0 and bool(asked[i]) and offsets[i - 1] + lengths[i - 1] == offsets[i] for i in range(len(offsets))]
    runs = [arena[offsets[start] : offsets[end - 1] + lengths[end - 1]] for start, end in run_bounds(joins)]
    return joins, runs
