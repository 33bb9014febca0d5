"""``PipelinedWindow``: a put copied by the client itself switches its pages a piece at a time
while the copy runs (``kvpool.core.put_pipeline``). Real mappings of a memfd, checked in
``/proc/self/maps``: a piece is writable only between its open and its shut, every byte lands,
nothing is writable once the window is closed, after a failed copy too, and a put smaller
than a piece keeps the plain ``ProtectedWindow``."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.client.blocks import write_rows
from kvpool.core import arena_map
from kvpool.core.arena_map import ArenaMapping, ProtectedWindow, can_protect
from kvpool.core.checksum import checksum_rows
from kvpool.core.errors import Unavailable
from kvpool.core.put_pipeline import PipelinedWindow
from tests.unit.test_arena_window import PAGE, memfd, writable_bytes

pytestmark = pytest.mark.skipif(not can_protect(), reason="needs mprotect (Linux)")

CAPACITY = 256 * PAGE
PIECE = 8 * PAGE


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ArenaMapping, int]]:
    monkeypatch.setattr(arena_map, "PUT_PIECE_BYTES", PIECE)
    fd = memfd(CAPACITY)
    mapping = ArenaMapping(
        f"/proc/self/fd/{fd}", CAPACITY, os.dup(fd), mmap.mmap(fd, CAPACITY, prot=mmap.PROT_READ), fd
    )
    mapping.keyed_puts = False  # the pipelined window is the one without protection keys
    try:
        yield mapping, fd
    finally:
        mapping.close()


def test_pieces_open_ahead_and_shut_behind_the_copy(client: tuple[ArenaMapping, int]) -> None:
    mapping, fd = client
    block = 2 * PAGE
    offsets = [16 * PAGE + i * block for i in range(16)]  # 32 pages: four pieces
    window = mapping.put_window(offsets, block, own_copy=True)
    assert isinstance(window, PipelinedWindow)
    writer = mapping._writer
    assert writer is not None
    start, stop = offsets[0], offsets[-1] + block
    for piece_start in range(start, stop, PIECE):
        with window.writing(piece_start, piece_start + PIECE):  # its pages are open in here
            window.view_of(piece_start, piece_start + PIECE)[:] = piece_start // PAGE
        writer.helper().submit(lambda: None).result()  # the helper's queue has run
        writable = writable_bytes(fd)
        assert writable == stop - (piece_start + PIECE)  # those after are open, this one and before shut
    window.close()
    assert writable_bytes(fd) == 0
    for piece_start in range(start, stop, PIECE):
        assert (mapping.view[piece_start : piece_start + PIECE] == piece_start // PAGE).all()


@settings(max_examples=25, deadline=None)
@given(
    slots=st.sets(st.integers(0, 63), min_size=1, max_size=40),
    blocks_pages=st.sampled_from([1, 2, 3]),
    fail_at=st.one_of(st.none(), st.integers(0, 39)),
    seed=st.integers(0, 2**16),
)
def test_write_rows_lands_every_byte_and_leaves_nothing_writable(
    slots: set[int], blocks_pages: int, fail_at: int | None, seed: int
) -> None:
    """Any slots (adjacent or not), as ``PoolClient.put`` copies them; a copy that fails
    part-way leaves nothing writable either (queued opens cancelled, the rest shut)."""
    block = blocks_pages * PAGE
    offsets = [s * block for s in sorted(slots) if (s + 1) * block <= CAPACITY]
    fd = memfd(CAPACITY)
    mapping = ArenaMapping(
        f"/proc/self/fd/{fd}", CAPACITY, os.dup(fd), mmap.mmap(fd, CAPACITY, prot=mmap.PROT_READ), fd
    )
    mapping.keyed_puts = False
    saved = arena_map.PUT_PIECE_BYTES
    arena_map.PUT_PIECE_BYTES = PIECE
    try:
        rows = np.random.default_rng(seed).integers(0, 256, size=(len(offsets), block), dtype=np.uint8)
        window = mapping.put_window(offsets, block, own_copy=True)
        assert isinstance(window, PipelinedWindow) == (len(offsets) * block > PIECE)
        failed = False
        with window:
            if fail_at is not None and fail_at < len(offsets) and isinstance(window, PipelinedWindow):
                with pytest.raises(RuntimeError), window.writing(offsets[fail_at], offsets[fail_at] + block):
                    raise RuntimeError("the copy failed")
                failed = True
            else:
                digests = write_rows(window, rows, list(range(len(offsets))), offsets)
        assert writable_bytes(fd) == 0
        if not failed:
            assert digests == checksum_rows(rows)
            for i, off in enumerate(offsets):
                assert np.array_equal(mapping.view[off : off + block], rows[i])
    finally:
        arena_map.PUT_PIECE_BYTES = saved
        mapping.close()


def test_a_put_within_one_piece_keeps_the_plain_window(client: tuple[ArenaMapping, int]) -> None:
    mapping, _ = client
    window = mapping.put_window([0, PAGE], PAGE, own_copy=True)
    assert type(window) is ProtectedWindow
    window.close()
    window = mapping.put_window([i * PAGE for i in range(16)], PAGE, own_copy=False)  # an engine's fill
    assert type(window) is ProtectedWindow
    window.close()


def test_a_mapping_closed_mid_put_fails_the_copy_and_shuts_what_opened(client: tuple[ArenaMapping, int]) -> None:
    mapping, fd = client
    offsets = [i * PAGE for i in range(32)]
    writer = mapping._kept_writer()
    assert writer is not None
    gate = writer.helper().submit(lambda: None)
    gate.result()
    window = mapping.put_window(offsets, PAGE, own_copy=True)
    assert isinstance(window, PipelinedWindow)
    writer.close()  # no new opens: the queued ones fail (or were done already)
    with window:
        try:
            for off in range(0, 32 * PAGE, PIECE):
                with window.writing(off, off + PIECE):
                    window.view_of(off, off + PIECE)[:] = 1
        except Unavailable:
            pass  # an open refused after close: the put fails, typed
    assert writable_bytes(fd) == 0


def test_the_helper_thread_is_joined_when_the_mapping_closes(client: tuple[ArenaMapping, int]) -> None:
    mapping, fd = client
    offsets = [i * PAGE for i in range(32)]
    with mapping.put_window(offsets, PAGE, own_copy=True) as window:
        write_rows(window, np.ones((32, PAGE), np.uint8), list(range(32)), offsets)
    assert any(t.name.startswith("kvpool-put-window") for t in threading.enumerate())
    assert writable_bytes(fd) == 0
    mapping.close()
    assert not any(t.name.startswith("kvpool-put-window") for t in threading.enumerate())


def test_a_huge_page_arena_keeps_the_whole_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """512x fewer page entries to switch: the pieces' hand-offs would cost more than they hide."""
    monkeypatch.setattr(arena_map, "PUT_PIECE_BYTES", PIECE)
    fd = memfd(CAPACITY)
    read_only = mmap.mmap(fd, CAPACITY, prot=mmap.PROT_READ)
    mapping = ArenaMapping(f"/proc/self/fd/{fd}", CAPACITY, os.dup(fd), read_only, fd)
    mapping.keyed_puts = False
    mapping.page_bytes = 16 * PAGE  # as a huge-page arena's (64 KiB here: any size above the base page)
    try:
        window = mapping.put_window([0, 16 * PAGE, 32 * PAGE], 16 * PAGE, own_copy=True)
        assert type(window) is ProtectedWindow
        window.close()
    finally:
        mapping.close()


def test_slots_given_twice_keep_the_plain_window(client: tuple[ArenaMapping, int]) -> None:
    """A piece is shut once its bytes were written: a slot written twice would shut it early."""
    mapping, _ = client
    offsets = [i * PAGE for i in range(16)] + [0]
    window = mapping.put_window(offsets, PAGE, own_copy=True)
    assert type(window) is ProtectedWindow
    window.close()


def test_a_mapping_closed_while_the_window_opens_leaves_nothing_writable(
    client: tuple[ArenaMapping, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first piece is opened, then the mapping closes before the rest are queued: the
    window fails typed and shuts the piece it opened (the constructor's close covers only
    runs opened whole)."""
    mapping, fd = client
    writer = mapping._kept_writer()
    assert writer is not None
    real_open = writer.open

    def open_then_close(start: int, stop: int) -> Any:
        view = real_open(start, stop)
        writer.close()  # the helper is shut down: queueing the next piece's open fails
        return view

    monkeypatch.setattr(writer, "open", open_then_close)
    with pytest.raises(Unavailable):
        mapping.put_window([i * PAGE for i in range(32)], PAGE, own_copy=True)
    assert writable_bytes(fd) == 0
    assert writer._open_runs == {}


def test_a_window_takes_the_helper_once_not_under_the_lock_at_each_piece(client: tuple[ArenaMapping, int]) -> None:
    """``WriteMapping.helper`` takes the lock the helper holds through each switch: asked
    for at every filled piece, the copy waited out the switch it should run beside."""
    mapping, fd = client
    writer = mapping._kept_writer()
    assert writer is not None
    calls = 0
    real_helper = writer.helper

    def counting_helper() -> Any:
        nonlocal calls
        calls += 1
        return real_helper()

    writer.helper = counting_helper  # type: ignore[method-assign]
    offsets = [i * PAGE for i in range(32)]
    with mapping.put_window(offsets, PAGE, own_copy=True) as window:
        assert isinstance(window, PipelinedWindow)
        write_rows(window, np.ones((32, PAGE), np.uint8), list(range(32)), offsets)
    assert calls == 1
    assert writable_bytes(fd) == 0


def test_the_helper_is_handed_out_while_it_holds_the_lock_through_a_switch(client: tuple[ArenaMapping, int]) -> None:
    """Another put's switch holds the mapping's lock: a new window gets the helper without
    waiting for it; a mapping closed meanwhile still refuses."""
    mapping, _ = client
    writer = mapping._kept_writer()
    assert writer is not None
    helper = writer.helper()
    got: list[object] = []
    with writer._lock:  # as the helper holds it through a switch
        asker = threading.Thread(target=lambda: got.append(writer.helper()))
        asker.start()
        asker.join(timeout=10)
        assert got == [helper]
    writer.close()
    with pytest.raises(Unavailable):
        writer.helper()
