"""``PutWindow``: a client's writable mappings cover the pages of its put's slots and
nothing else (issue 10, item 3); the daemon-side ``SharedArena`` keeps its own view."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.arena_map import ArenaMapping, ProtectedWindow, PutWindow, can_protect
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


def perms_at(address: int) -> str:
    """The permissions of this process's mapping holding ``address`` ("" if none). The kept
    write mapping is not inherited by a forked child (``MADV_DONTFORK``), so a write cannot
    be tried there: ``---s`` is what makes a write a SIGSEGV."""
    with open("/proc/self/maps") as fh:
        for line in fh:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line.split()[1]
    return ""


def writable_bytes(fd: int) -> int:
    return sum(hi - lo for lo, hi, perms in maps_of(fd) if "w" in perms)


@pytest.mark.skipif(not can_protect(), reason="needs mprotect (Linux)")
@settings(max_examples=40, deadline=None)
@given(
    pages=st.lists(st.sets(st.integers(0, 31), min_size=1, max_size=6), min_size=1, max_size=3),
    length=st.integers(1, 2),
)
def test_whole_page_slots_open_only_their_pages_of_one_kept_mapping(pages: list[set[int]], length: int) -> None:
    """Puts whose slots are whole pages open pages of one kept mapping (``ProtectedWindow``):
    while open, exactly their pages are writable; closing one put's window leaves the
    others' open; once all are closed nothing is writable and a raw write is a SIGSEGV."""
    fd = memfd()
    client = ArenaMapping(f"/proc/self/fd/{fd}", CAPACITY, os.dup(fd), mmap.mmap(fd, CAPACITY, prot=mmap.PROT_READ), fd)
    try:
        # disjoint slots per put (as the allocator gives them), `length` pages each
        taken: set[int] = set()
        puts: list[list[int]] = []
        for wanted in pages:
            slots = []
            for p in sorted(wanted):
                span = set(range(p, p + length))
                if p + length <= CAPACITY // PAGE and not taken & span:
                    taken.update(span)
                    slots.append(p)
            if slots:
                puts.append([p * PAGE for p in slots])
        windows = [client.put_window(offsets, length * PAGE) for offsets in puts]
        assert all(isinstance(w, ProtectedWindow) for w in windows)
        assert writable_bytes(fd) == len(taken) * PAGE
        for i, (window, offsets) in enumerate(zip(windows, puts, strict=True)):
            for off in offsets:
                window[off : off + length * PAGE] = np.full(length * PAGE, i + 1, dtype=np.uint8)
        first = windows.pop(0)
        first.close()
        assert writable_bytes(fd) == (len(taken) - len(puts[0]) * length) * PAGE
        for window in windows:
            window.close()
        assert writable_bytes(fd) == 0
        for i, offsets in enumerate(puts):
            for off in offsets:
                assert (client.view[off : off + length * PAGE] == i + 1).all()  # every byte landed
        writer = client._writer
        assert writer is not None
        assert perms_at(int(writer.view.ctypes.data) + puts[0][0]) == "---s"
    finally:
        client.close()  # closes both descriptors


def test_slots_that_share_pages_get_a_window_of_their_own() -> None:
    """A slot that does not start and end on a page edge may share a page with another
    put's slot; it gets its own mapping (``PutWindow``), which closing unmaps."""
    fd = memfd()
    client = ArenaMapping(f"/proc/self/fd/{fd}", CAPACITY, os.dup(fd), mmap.mmap(fd, CAPACITY, prot=mmap.PROT_READ), fd)
    try:
        with client.put_window([PAGE + 16], PAGE) as window:
            assert not isinstance(window, ProtectedWindow)
            window[PAGE + 16 : 2 * PAGE + 16] = np.ones(PAGE, dtype=np.uint8)
        assert client._writer is None and writable_bytes(fd) == 0
        assert (client.view[PAGE + 16 : 2 * PAGE + 16] == 1).all()
    finally:
        client.close()  # closes both descriptors


def kept_client(fd: int) -> ArenaMapping:
    """A client mapping of memfd ``fd`` holding it as its write descriptor (closes it)."""
    return ArenaMapping(f"/proc/self/fd/{fd}", CAPACITY, os.dup(fd), mmap.mmap(fd, CAPACITY, prot=mmap.PROT_READ), fd)


@pytest.mark.skipif(not can_protect(), reason="needs mprotect (Linux)")
def test_a_page_two_open_puts_cover_stays_writable_until_both_are_done() -> None:
    """A put reclaimed after put_ttl_ms can still be writing a slot the node gave to a new
    put of the same client: the first to finish must not shut the other's pages."""
    fd = memfd()
    client = kept_client(fd)
    try:
        late, fresh = client.put_window([2 * PAGE], PAGE), client.put_window([2 * PAGE], PAGE)
        assert isinstance(late, ProtectedWindow) and isinstance(fresh, ProtectedWindow)
        late.close()
        fresh[2 * PAGE : 3 * PAGE] = np.full(PAGE, 7, dtype=np.uint8)  # no SIGSEGV: still open
        writer = client._writer
        assert writer is not None
        assert perms_at(int(writer.view.ctypes.data) + 2 * PAGE) == "rw-s"
        pid = os.fork()
        if pid == 0:  # a forked child does not get the kept mapping, open pages or not
            os._exit(0 if perms_at(int(writer.view.ctypes.data) + 2 * PAGE) == "" else 1)
        assert os.waitpid(pid, 0)[1] == 0
        fresh.close()
        assert writable_bytes(fd) == 0
        assert perms_at(int(writer.view.ctypes.data) + 2 * PAGE) == "---s"
    finally:
        client.close()


@pytest.mark.skipif(not can_protect(), reason="needs mprotect (Linux)")
def test_closing_the_mapping_during_a_put_refuses_new_puts_and_unmaps_after_the_last() -> None:
    """A re-Hello closes the old mapping while a put of another thread writes through it:
    that put finishes, nothing new opens, and the kept mapping goes with the last window."""
    fd = memfd()
    client = kept_client(fd)
    writer = None
    try:
        window = client.put_window([0, PAGE], PAGE)
        writer = client._writer
        assert writer is not None
        client.close()
        window[0:PAGE] = np.ones(PAGE, dtype=np.uint8)  # the put in flight still writes
        with pytest.raises(Unavailable):
            writer.open(4 * PAGE, 5 * PAGE)
        address = int(writer.view.ctypes.data)
        assert perms_at(address) == "rw-s"  # still mapped, for the put in flight
        window.close()
        assert writer.view.size == 0 and perms_at(address) == ""  # unmapped with the last window
    finally:
        client.close()


@pytest.mark.skipif(not can_protect(), reason="needs mprotect (Linux)")
def test_a_kept_mapping_that_cannot_be_made_falls_back_to_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvpool.core.arena_map as arena_map

    monkeypatch.setattr(arena_map._libc, "mprotect", lambda *args: -1)
    fd = memfd()
    client = kept_client(fd)
    try:
        with client.put_window([PAGE], PAGE) as window:
            assert not isinstance(window, ProtectedWindow)
            window[PAGE : 2 * PAGE] = np.full(PAGE, 3, dtype=np.uint8)
        assert client._writer is None and client._writer_failed
        assert (client.view[PAGE : 2 * PAGE] == 3).all()
        assert writable_bytes(fd) == 0  # the failed kept mapping was not left behind
    finally:
        client.close()
