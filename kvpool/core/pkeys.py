"""Memory protection keys (x86 PKU / AMD since Zen 3, Linux 4.9+, glibc 2.27+), through libc.

A page tagged with a key (``pkey_mprotect``) is reachable only by threads whose own rights
register (PKRU) allows that key; switching a thread's rights is one unprivileged instruction
(``pkey_set``), with no page-table change and no TLB flush. A client's put uses it to keep its
writable mapping of the arena closed to every thread but the one copying a put's bytes in, and
to that thread only for the copy (``kvpool.core.arena_map.WriteMapping``): the same guard as
switching the pages with ``mprotect`` per put, without its cost (4 MiB puts on 4 KiB pages
0.73-0.79x of a plain copy against 0.55-0.69x with ``mprotect``, measured interleaved:
docs/benchmarks.md).

Threads that exist when a key is allocated, and threads started later by a thread that does
not hold the key open, have no access to it (Linux starts a process with every key but 0
denied, and a new thread copies its creator's rights). stdlib only, like the rest of core.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

PKEY_DISABLE_ACCESS = 1
MAX_KEYS = 16  # x86 PKU: keys 0-15, key 0 the default of every page


def linux_libc() -> ctypes.CDLL | None:
    """The C library through ctypes (errno kept), on Linux; None elsewhere or where it cannot
    be loaded (the callers then fall back: no keys here, no ``mprotect`` windows there)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None


class _Pkeys:
    """libc's ``pkey_*`` functions, or ``usable`` False where they are missing."""

    def __init__(self) -> None:
        self.usable = False
        libc = linux_libc()
        if libc is None:
            return
        try:
            self.alloc, self.free, self.protect = libc.pkey_alloc, libc.pkey_free, libc.pkey_mprotect
            self.get, self.set = libc.pkey_get, libc.pkey_set
        except AttributeError:  # glibc before 2.27, or another libc
            return
        self.alloc.argtypes = [ctypes.c_uint, ctypes.c_uint]
        self.free.argtypes = [ctypes.c_int]
        self.protect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
        self.get.argtypes = [ctypes.c_int]
        self.set.argtypes = [ctypes.c_int, ctypes.c_uint]
        for function in (self.alloc, self.free, self.protect, self.get, self.set):
            function.restype = ctypes.c_int
        # this thread's rights to the other keys when the first key was allocated: what the
        # kernel starts every thread with (init_pkru). Read then, not here: reading them
        # (RDPKRU) is an illegal instruction on a CPU without keys, where pkey_alloc fails first
        self.started: dict[int, int] | None = None
        self.usable = True


_pkeys = _Pkeys()


class ProtectionKey:
    """One protection key of this process, denied to every thread except inside ``open``
    (the calling thread, for the ``with`` block). ``OSError`` where the CPU or kernel has no
    keys, or all 15 are taken; ``free`` gives it back once nothing is tagged with it."""

    def __init__(self) -> None:
        if not _pkeys.usable:
            raise OSError("no pkey_* functions in this C library")
        key = _pkeys.alloc(0, PKEY_DISABLE_ACCESS)  # this thread denied too, like every other
        if key < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pkey_alloc: {os.strerror(err)}")
        self.key = key
        if _pkeys.started is None:  # the first key of this process (its own rights were just set)
            _pkeys.started = {k: _pkeys.get(k) for k in range(1, MAX_KEYS) if k != key}
        if any(rights < 0 or not rights & PKEY_DISABLE_ACCESS for rights in _pkeys.started.values()):
            # threads start with this key allowed here (an init_pkru of 0): the other threads
            # of this process could write the tagged pages, so the key guards nothing
            self.free()
            raise OSError("threads start with protection keys allowed on this kernel (init_pkru)")

    def tag(self, address: int, length: int, prot: int) -> None:
        """Set ``[address, address + length)`` to ``prot`` and tag it with this key."""
        if _pkeys.protect(address, length, prot, self.key) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pkey_mprotect: {os.strerror(err)}")

    @contextmanager
    def open(self) -> Iterator[None]:
        """Let the calling thread read and write pages of this key for the block; its rights
        before are restored after (denied, unless an outer block holds the key open)."""
        before = _pkeys.get(self.key)
        if before < 0:
            raise OSError(f"pkey_get of key {self.key} failed")
        _set_rights(self.key, 0)
        try:
            yield
        finally:
            _set_rights(self.key, before)

    def free(self) -> None:
        if self.key >= 0:
            _pkeys.free(self.key)
            self.key = -1


def _set_rights(key: int, rights: int) -> None:
    """This thread's rights to ``key``; ``OSError`` if they could not be set (never a key
    silently left open, nor a copy into pages it would fault on)."""
    if _pkeys.set(key, rights) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pkey_set of key {key}: {os.strerror(err)}")


def allocate_key() -> ProtectionKey | None:
    """A new key, or None where keys cannot be had here (no PKU, no kernel support, or the
    process holds all 15): the caller then guards its pages with ``mprotect``."""
    try:
        return ProtectionKey()
    except OSError:
        return None


__all__ = ["PKEY_DISABLE_ACCESS", "ProtectionKey", "allocate_key"]
