"""Mapping files at a fixed place inside a reserved address range (Linux, through libc):
what lets one arena be made of several memfds (``segments``) that still read as one flat
array, so that a block is ``arena[offset]`` everywhere (docs/security.md, "Per-tenant arenas").

``Reservation`` takes an address range with Python's ``mmap`` (private, anonymous, nothing
committed), aligned to ``ALIGN_BYTES`` (2 MiB: a huge-page segment must start on one);
``map_segment`` puts a file over a part of it (``MAP_FIXED | MAP_SHARED``), replacing what
was there at once, and ``protect`` makes a part of it inaccessible (``PROT_NONE``: a touch
is a SIGSEGV, never a read). Python's ``mmap`` object owns the whole range: closing it
unmaps the segments too. stdlib + numpy only, like the rest of core.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from kvpool.core.errors import StorageFault

#: segments start on this boundary (the huge page size of x86-64; a multiple of 4 KiB)
ALIGN_BYTES = 2 << 20
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
PROT_NONE = 0

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


class Reservation:
    """``length`` bytes of address space, ``ALIGN_BYTES``-aligned, as a flat uint8 ``view``:
    writable (``writable=True``, the daemon: segments are mapped over all of it) or read-only
    and inaccessible until segments are mapped in (a client)."""

    def __init__(self, length: int, writable: bool) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._mmap = mmap.mmap(
            -1, length + ALIGN_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, prot=prot
        )
        whole = np.frombuffer(self._mmap, dtype=np.uint8)
        start = whole.ctypes.data
        pad = -start % ALIGN_BYTES
        self.address = start + pad
        self.length = length
        self.view = whole[pad : pad + length]
        if not writable:
            protect(start, length + ALIGN_BYTES)  # nothing readable until a segment is mapped

    def close(self) -> None:
        """Unmap the range and every segment in it (views handed out must be dropped first:
        while one lives, the range stays mapped and dies with it)."""
        self.view = np.empty(0, dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass


def map_segment(address: int, length: int, fd: int, writable: bool) -> None:
    """Map ``length`` bytes of ``fd`` (from its start) at ``address``, over what was there."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    got = _libc.mmap(address, length, prot, mmap.MAP_SHARED | MAP_FIXED, fd, 0)
    if got == _MAP_FAILED or got != address:
        err = ctypes.get_errno()
        raise StorageFault(f"cannot map an arena segment at {address:#x} ({length} bytes): {os.strerror(err)}")


def protect(address: int, length: int) -> None:
    """Make ``[address, address + length)`` inaccessible (``PROT_NONE``)."""
    if _libc.mprotect(address, length, PROT_NONE) != 0:
        err = ctypes.get_errno()
        raise StorageFault(f"cannot protect {length} bytes at {address:#x}: {os.strerror(err)}")


__all__ = ["ALIGN_BYTES", "Reservation", "map_segment", "protect"]
