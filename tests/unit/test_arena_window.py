"""``PutWindow``: a client's writable mappings cover the pages of its put's slots and
nothing else (issue 10, item 3); the daemon-side ``SharedArena`` keeps its own view."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.arena_map import ArenaMapping, PutWindow
from kvpool.core.errors import InvalidArgument, Unavailable
from kvpool.storage.arena import SharedArena

PAGE = mmap.ALLOCATIONGRANULARITY
CAPACITY = 64 * PAGE


def memfd(capacity: int = CAPACITY) -> int:
    fd = os.memfd_create("test-arena", os.MFD_CLOEXEC)
    os.ftruncate(fd, capacity)
    return fd


def maps_of(fd: int) -> list[tuple[int, int, str]]:
    """(start, end, perms) of this process's mappings of the memfd ``fd``."""
    inode = os.fstat(fd).st_ino
    out = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 6 and int(parts[4]) == inode and "test-arena" in line:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, parts[1]))
    return out


@settings(max_examples=60, deadline=None)
@given(
    length=st.integers(1, 3 * PAGE),
    slots=st.sets(st.integers(0, 15), min_size=1, max_size=8),
    data=st.data(),
)
def test_a_window_maps_only_the_pages_of_its_slots(length: int, slots: set[int], data: st.DataObject) -> None:
    stride = data.draw(st.integers(length, 4 * PAGE))
    offsets = [s * stride for s in sorted(slots) if s * stride + length <= CAPACITY]
    if not offsets:
        return
    fd = memfd()
    try:
        pages = {p for off in offsets for p in range(off // PAGE, -(-(off + length) // PAGE))}
        with PutWindow(fd, CAPACITY, offsets, length) as window:
            assert window.mapped_bytes == len(pages) * PAGE  # those pages, each once
            writable = sum(hi - lo for lo, hi, perms in maps_of(fd) if "w" in perms)
            assert writable == len(pages) * PAGE
            for i, off in enumerate(offsets):
                window[off : off + length] = np.full(length, i + 1, dtype=np.uint8)
            outside = next((p * PAGE for p in range(CAPACITY // PAGE) if p not in pages), None)
            if outside is not None:
                with pytest.raises(InvalidArgument):
                    window[outside : outside + 1] = np.zeros(1, dtype=np.uint8)
        assert maps_of(fd) == []  # closed: nothing left mapped
        view = mmap.mmap(fd, CAPACITY, mmap.MAP_SHARED, mmap.PROT_READ)
        arr = np.frombuffer(view, dtype=np.uint8)
        for i, off in enumerate(offsets):
            assert (arr[off : off + length] == i + 1).all()
        del arr
        view.close()
    finally:
        os.close(fd)


def test_a_client_arena_is_read_only_and_needs_a_write_descriptor_for_a_window() -> None:
    owner = SharedArena.create_memfd(CAPACITY, allow_overcommit=True)
    try:
        client = ArenaMapping.from_fd(owner.read_only_fd(), CAPACITY, name="test")
        try:
            assert not client.writable and not client.can_write
            with pytest.raises(ValueError):
                client.view[0] = 1  # a read-only array over a read-only mapping
            with pytest.raises(Unavailable):
                client.put_window([0], 16)
            with pytest.raises(Unavailable):  # a read-only descriptor is not a write descriptor
                client.adopt_write_fd(owner.read_only_fd())
            client.adopt_write_fd(os.open(f"/proc/self/fd/{owner.fd}", os.O_RDWR))
            with client.put_window([PAGE], 16) as window:
                window[PAGE : PAGE + 16] = np.arange(16, dtype=np.uint8)
            assert list(client.view[PAGE : PAGE + 16]) == list(range(16))
            assert not client.writable
        finally:
            client.close()
    finally:
        owner.close()
