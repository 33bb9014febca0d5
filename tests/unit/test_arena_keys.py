"""A put that copies its own bytes (``put_window(own_copy=True)``) writes through a kept mapping
guarded by a memory protection key (``kvpool.core.pkeys``): only the copying thread, only inside
``window.writing()``, can touch it; every other write is a SIGSEGV, never a changed block.
Skipped where the CPU or kernel has no protection keys (the mprotect windows then serve)."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvpool.core.arena_map import ArenaMapping, ProtectedWindow, can_protect
from kvpool.core.pkeys import allocate_key

PAGE = mmap.ALLOCATIONGRANULARITY
CAPACITY = 64 * PAGE


def keys_here() -> bool:
    key = allocate_key()
    if key is None:
        return False
    key.free()
    return True


needs_keys = pytest.mark.skipif(not (can_protect() and keys_here()), reason="no memory protection keys here")


def client() -> tuple[ArenaMapping, int]:
    fd = os.memfd_create("test-arena", os.MFD_CLOEXEC)
    os.ftruncate(fd, CAPACITY)
    view = mmap.mmap(fd, CAPACITY, prot=mmap.PROT_READ)
    return ArenaMapping(f"/proc/self/fd/{fd}", CAPACITY, os.dup(fd), view, fd), fd


def pkeys_of(fd: int) -> list[tuple[str, int]]:
    """(perms, protection key) of each of this process's mappings of memfd ``fd`` (smaps)."""
    inode, out, current = os.fstat(fd).st_ino, [], None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and parts[0][0] != "-":
                current = parts[1] if len(parts) >= 6 and int(parts[4]) == inode and "test-arena" in line else None
            elif parts[0] == "ProtectionKey:" and current is not None:
                out.append((current, int(parts[1])))
    return out


@needs_keys
def test_own_copy_puts_write_through_one_keyed_mapping_inside_writing_only() -> None:
    arena, fd = client()
    try:
        window = arena.put_window([2 * PAGE, 5 * PAGE], PAGE, own_copy=True)
        assert isinstance(window, ProtectedWindow) and arena._keyed is not None and arena._writer is None
        with window.writing():
            window[2 * PAGE : 3 * PAGE] = np.full(PAGE, 4, dtype=np.uint8)
            window[5 * PAGE : 6 * PAGE] = np.full(PAGE, 5, dtype=np.uint8)
        window.close()
        assert (arena.view[2 * PAGE : 3 * PAGE] == 4).all() and (arena.view[5 * PAGE : 6 * PAGE] == 5).all()
        writable = [(perms, key) for perms, key in pkeys_of(fd) if "w" in perms]
        assert writable and all(key != 0 for _, key in writable)  # the only writable mapping is keyed
        # an engine's fill (own_copy False) still gets pages switched by mprotect, never the keyed mapping
        with arena.put_window([8 * PAGE], PAGE) as engine_window:
            assert engine_window._writer is arena._writer is not None and arena._writer is not arena._keyed
            engine_window[8 * PAGE : 9 * PAGE] = np.full(PAGE, 6, dtype=np.uint8)
        keyed = arena._keyed
    finally:
        arena.close()
    assert keyed is not None and keyed._key is not None and keyed._key.key == -1  # freed with the mapping


@pytest.mark.skipif(not can_protect(), reason="no mprotect here")
def test_without_a_key_own_copy_puts_fall_back_to_mprotect(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvpool.core.arena_map as arena_map

    monkeypatch.setattr(arena_map, "allocate_key", lambda: None)
    arena, _ = client()
    try:
        with arena.put_window([PAGE], PAGE, own_copy=True) as window:
            assert isinstance(window, ProtectedWindow) and arena._keyed is None and window._writer is arena._writer
            with window.writing():
                window[PAGE : 2 * PAGE] = np.full(PAGE, 9, dtype=np.uint8)
        assert (arena.view[PAGE : 2 * PAGE] == 9).all()
    finally:
        arena.close()


WRITER = textwrap.dedent(
    """
    import mmap, os, sys, threading
    import numpy as np
    from kvpool.core.arena_map import ArenaMapping
    PAGE = mmap.ALLOCATIONGRANULARITY
    fd = os.memfd_create("test-arena")
    os.ftruncate(fd, 64 * PAGE)
    arena = ArenaMapping("memfd", 64 * PAGE, os.dup(fd), mmap.mmap(fd, 64 * PAGE, prot=mmap.PROT_READ), fd)
    window = arena.put_window([PAGE], PAGE, own_copy=True)
    raw = arena._keyed.view  # the whole keyed mapping, as a stray pointer would see it
    case = sys.argv[1]
    if case == "inside":
        with window.writing():
            raw[PAGE] = 1
    elif case == "outside":  # the put's own thread, before writing() and after
        raw[PAGE] = 1
    elif case == "after":
        with window.writing():
            raw[PAGE] = 1
        window.close()
        raw[PAGE] = 2
    elif case == "other-thread":  # another thread of the client (an engine's) while the put copies
        go = threading.Event()
        t = threading.Thread(target=lambda: (go.wait(), raw.__setitem__(3 * PAGE, 1)))
        t.start()
        with window.writing():
            go.set()
            t.join()
    print("wrote", flush=True)
    """
)


@needs_keys
@pytest.mark.parametrize(
    ("case", "dies"), [("inside", False), ("outside", True), ("after", True), ("other-thread", True)]
)
def test_a_write_outside_the_copying_thread_and_its_copy_is_a_sigsegv(case: str, dies: bool) -> None:
    proc = subprocess.run([sys.executable, "-c", WRITER, case], capture_output=True, text=True, timeout=60)
    if dies:
        assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr[-2000:])
    else:
        assert proc.returncode == 0 and "wrote" in proc.stdout, proc.stderr[-2000:]
