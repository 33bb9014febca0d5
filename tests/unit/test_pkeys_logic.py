"""The protection-key logic that needs no keys to test (a fake of libc's ``pkey_*`` records
every call): a key is open to a thread only inside ``open()``, restored on an exception and
when nested, never left open by a failed ``pkey_set``; a kernel whose threads start with keys
allowed gets no key (mprotect windows instead); a put's copy opens the key around the copy
call only; a forked child cannot write through its parent's mapping; a mapping dropped
unclosed gives its key back; the numpy slot check of a put window agrees with a plain reading
of its rule. The real keys, in a real process, are
``test_arena_keys.py`` (where the CPU has them)."""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.client import blocks
from kvpool.core import pkeys
from kvpool.core.arena_map import ArenaMapping, PutWindow, can_protect
from kvpool.core.errors import InvalidArgument, Unavailable

PAGE = mmap.ALLOCATIONGRANULARITY


class FakePkeys:
    """libc's pkey_* for one thread: rights per key, every set recorded."""

    usable = True

    def __init__(self, start_rights: int = pkeys.PKEY_DISABLE_ACCESS, fail_set_to: int | None = None) -> None:
        self.rights = dict.fromkeys(range(1, pkeys.MAX_KEYS), start_rights)
        self.started: dict[int, int] | None = None  # read by ProtectionKey at the first allocation
        self.allocated: set[int] = set()
        self.sets: list[tuple[int, int]] = []
        self.fail_set_to = fail_set_to

    def alloc(self, flags: int, rights: int) -> int:
        key = min(set(self.rights) - self.allocated)
        self.allocated.add(key)
        self.rights[key] = rights
        return key

    def free(self, key: int) -> int:
        self.allocated.discard(key)
        return 0

    def protect(self, address: int, length: int, prot: int, key: int) -> int:
        return 0  # nothing tagged for real: the bookkeeping is what these tests look at

    def get(self, key: int) -> int:
        return self.rights.get(key, -1)

    def set(self, key: int, rights: int) -> int:
        self.sets.append((key, rights))
        if rights == self.fail_set_to:
            return -1
        self.rights[key] = rights
        return 0


def test_open_restores_the_rights_on_an_exception_and_when_nested(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakePkeys()
    monkeypatch.setattr(pkeys, "_pkeys", fake)
    key = pkeys.ProtectionKey()
    assert fake.rights[key.key] == pkeys.PKEY_DISABLE_ACCESS
    with pytest.raises(RuntimeError), key.open():
        assert fake.rights[key.key] == 0
        raise RuntimeError("the copy failed")
    assert fake.rights[key.key] == pkeys.PKEY_DISABLE_ACCESS
    with key.open():
        with key.open():
            assert fake.rights[key.key] == 0
        assert fake.rights[key.key] == 0  # the outer block still holds it open
    assert fake.rights[key.key] == pkeys.PKEY_DISABLE_ACCESS
    key.free()
    assert key.key == -1 and not fake.allocated


def test_a_failed_pkey_set_raises_instead_of_copying_or_leaving_the_key_open(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakePkeys(fail_set_to=0)  # opening fails
    monkeypatch.setattr(pkeys, "_pkeys", fake)
    key = pkeys.ProtectionKey()
    ran = []
    with pytest.raises(OSError, match="pkey_set"), key.open():
        ran.append(1)
    assert not ran and fake.rights[key.key] == pkeys.PKEY_DISABLE_ACCESS
    fake.fail_set_to = pkeys.PKEY_DISABLE_ACCESS  # shutting fails: said, not ignored
    with pytest.raises(OSError, match="pkey_set"), key.open():
        pass


def test_threads_that_start_with_keys_allowed_get_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakePkeys(start_rights=0)  # an init_pkru of 0: every thread may use every key
    monkeypatch.setattr(pkeys, "_pkeys", fake)
    with pytest.raises(OSError, match="init_pkru"):
        pkeys.ProtectionKey()
    assert not fake.allocated  # given back
    assert pkeys.allocate_key() is None  # so puts use the mprotect windows


def test_a_put_opens_the_key_around_each_copy_call_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Python of ours runs with the key open: the slots are checked and sliced first."""
    state = {"open": False}
    events: list[tuple[str, bool]] = []
    arena = np.zeros(16 * 64, dtype=np.uint8)

    class KeyedWindow(PutWindow):
        def __init__(self) -> None:  # no mapping: the bookkeeping of a window over `arena`
            self.segment_bytes = 0

        def writing(self, start: int = -1, stop: int = -1) -> Any:
            window = self

            class Open:
                def __enter__(self) -> None:
                    assert not state["open"], "nested"
                    state["open"] = True
                    events.append(("open", True))

                def __exit__(self, *exc: object) -> None:
                    state["open"] = False
                    events.append(("shut", False))

            del window
            return Open()

        def view_of(self, start: int, stop: int) -> np.ndarray:
            events.append(("view_of", state["open"]))
            return arena[start:stop]

    copy = blocks.copy_checksum_rows

    def recording_copy(*args: Any, **kwargs: Any) -> list[int]:
        events.append(("copy", state["open"]))
        return copy(*args, **kwargs)

    monkeypatch.setattr(blocks, "copy_checksum_rows", recording_copy)
    monkeypatch.setattr(blocks, "COPY_RUN_BYTES", 128)  # runs of two 64-byte blocks
    rows = np.arange(6 * 64, dtype=np.uint64).astype(np.uint8).reshape(6, 64)
    offsets = [0, 64, 128, 192, 512, 576]
    checksums = blocks.write_rows(KeyedWindow(), rows, list(range(6)), offsets)
    assert len(checksums) == 6
    assert [e for e in events if e[0] == "view_of"] == [("view_of", False)] * 3
    assert [e for e in events if e[0] == "copy"] == [("copy", True)] * 3
    assert events[:3] == [("view_of", False)] * 3  # every slot checked before the first byte is written
    for i, offset in enumerate(offsets):
        np.testing.assert_array_equal(arena[offset : offset + 64], rows[i])


def test_slot_offsets_and_rows_of_different_lengths_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="slot offsets"):
        blocks.adjacent_runs([0, 64, 128], [0, 1], 64)


@pytest.mark.skipif(not can_protect(), reason="no mprotect here")
def test_a_forked_child_cannot_open_its_parents_write_mapping() -> None:
    capacity = 8 * PAGE
    fd = os.memfd_create("test-arena-fork", os.MFD_CLOEXEC)
    os.ftruncate(fd, capacity)
    arena = ArenaMapping("memfd", capacity, os.dup(fd), mmap.mmap(fd, capacity, prot=mmap.PROT_READ), fd)
    try:
        with arena.put_window([PAGE], PAGE):  # the parent's mapping exists and works
            pass
        pid = os.fork()
        if pid == 0:  # the child: refused with a typed error, nothing written
            try:
                arena.put_window([2 * PAGE], PAGE)
            except Unavailable:
                os._exit(0)
            except BaseException:
                os._exit(2)
            os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with arena.put_window([3 * PAGE], PAGE) as window:  # the parent still can
            window[3 * PAGE : 4 * PAGE] = np.full(PAGE, 5, dtype=np.uint8)
        assert (arena.view[3 * PAGE : 4 * PAGE] == 5).all()
    finally:
        arena.close()


def slots_rule(slots: set[int], length: int, start: int, stop: int) -> bool:
    """A put window's slot rule, read plainly: one slot or a prefix of one, or whole slots
    that follow one another."""
    if stop <= start:
        return False
    if stop - start <= length:
        return start in slots
    if (stop - start) % length:
        return False
    return all(start + k * length in slots for k in range((stop - start) // length))


@settings(max_examples=300, deadline=None)
@given(
    length=st.sampled_from([16, 64, 96]),
    slot_units=st.lists(st.integers(0, 40), max_size=12),
    start_unit=st.integers(0, 44),
    shift=st.integers(-20, 20),
    span_slots=st.integers(0, 5),
    extra=st.integers(-20, 20),
)
def test_the_window_slot_check_is_the_plain_rule(
    length: int, slot_units: list[int], start_unit: int, shift: int, span_slots: int, extra: int
) -> None:
    slots = sorted({u * length for u in slot_units})
    window = PutWindow.__new__(PutWindow)  # the slot bookkeeping alone: one run over everything
    capacity = 48 * length
    window._slots = np.asarray(slots, dtype=np.int64)
    window._length = length
    window._starts = [0]
    window._runs = [(0, capacity, None, np.zeros(capacity, dtype=np.uint8))]
    start = max(0, start_unit * length + shift % 3 * (shift // 7))
    stop = min(capacity, start + span_slots * length + extra)
    allowed = bool(slots) and slots_rule(set(slots), length, start, stop)
    if allowed:
        assert window.view_of(start, stop).nbytes == stop - start
    else:
        with pytest.raises(InvalidArgument):
            window.view_of(start, stop)


def test_a_keyed_mapping_dropped_without_close_gives_its_key_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """15 keys per process: a client dropped unclosed must not keep one (the key is freed once
    the mapping's pages are gone, never before)."""
    import gc

    from kvpool.core.arena_map import WriteMapping

    fake = FakePkeys()
    monkeypatch.setattr(pkeys, "_pkeys", fake)
    fd = os.memfd_create("test-arena-keyed", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 4 * PAGE)
        mapping = WriteMapping(fd, 4 * PAGE, PAGE, pkeys.ProtectionKey())
        assert len(fake.allocated) == 1
        del mapping
        gc.collect()
        assert not fake.allocated
        closed = WriteMapping(fd, 4 * PAGE, PAGE, pkeys.ProtectionKey())
        closed.close()  # the usual way: freed at the unmap, and only once
        gc.collect()
        assert not fake.allocated
    finally:
        os.close(fd)
