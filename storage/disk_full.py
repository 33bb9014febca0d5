"""Telling a full disk from a failing one.

A write that fails with ENOSPC or EDQUOT, or any disk-tier failure (a data write, an
``fdatasync``, an LMDB commit, which can surface a full filesystem as EIO) while the
filesystem has almost no space left, is a ``DiskFull``: the message names the path and the
free space, and the hint says to free space, not to read dmesg. The tier keeps serving what
it has and the host tier keeps every block it holds.
"""

from __future__ import annotations

import errno
import os
import pathlib

from kvpool.core.errors import StorageFault

#: a filesystem with less than this left is full for the disk tier (below one slab write)
FULL_BELOW_BYTES = 1 << 20

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


class DiskFull(StorageFault):
    """The disk tier's filesystem has no room: free space (or lower the capacity). The
    blocks already on disk, and every block in host memory, keep being served."""


def space_of(path: pathlib.Path) -> tuple[int, int] | None:
    """(free bytes an unprivileged writer may use, total bytes) of ``path``'s filesystem."""
    try:
        vfs = os.statvfs(path)
    except OSError:
        return None
    return vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize


def is_full(exc: BaseException, path: pathlib.Path) -> bool:
    if getattr(exc, "errno", None) in _FULL_ERRNOS or "No space left" in str(exc):
        return True
    space = space_of(path)
    return space is not None and space[0] < FULL_BELOW_BYTES


def disk_fault(
    exc: BaseException, path: pathlib.Path, what: str, consequence: str, otherwise_hint: str
) -> StorageFault:
    """The typed fault for a failed disk operation: ``DiskFull`` when the disk is full,
    else a ``StorageFault`` carrying the OS error and ``otherwise_hint``."""
    if is_full(exc, path):
        space = space_of(path)
        room = f"{space[0]} of {space[1]} bytes free" if space is not None else "free space unknown"
        return DiskFull(
            f"disk full: {what} on {path} ({room}; the OS said: {exc}); {consequence}",
            hint=f"free space on the filesystem of {path}, or lower --disk-capacity-bytes below what it can hold",
        )
    return StorageFault(f"{what}: {exc}; {consequence}", hint=otherwise_hint)
