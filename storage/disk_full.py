"""Telling a full disk from a failing one.

A write that fails with ENOSPC or EDQUOT, or any disk-tier failure (a data write, an
``fdatasync``, an LMDB commit, which can surface a full filesystem as EIO) while the
filesystem has almost no space left, is a ``DiskFull``: the message names the path and the
free space, and the hint says to free space, not to read dmesg. The tier keeps serving what
it has and the host tier keeps every block it holds.
"""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import time

from kvpool.core.errors import StorageFault

#: a filesystem with less than this left is full for the disk tier (below one slab write)
FULL_BELOW_BYTES = 1 << 20

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}

#: while the disk stays full, one log line per this long (every failure is still counted)
FULL_LOG_INTERVAL_S = 10.0


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


class FaultLog:
    """Logs the disk tier's write faults. A full disk fails every batch until space is
    freed, so its lines are spaced ``FULL_LOG_INTERVAL_S`` apart, each saying how many
    failures were not logged; other faults are logged every time."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._full_logged_s = -FULL_LOG_INTERVAL_S
        self._full_unlogged = 0

    def log(self, fault: StorageFault) -> None:
        if isinstance(fault, DiskFull):
            now = time.monotonic()
            if now - self._full_logged_s < FULL_LOG_INTERVAL_S:
                self._full_unlogged += 1
                return
            self._full_logged_s = now
            if self._full_unlogged:
                self._log.error("%s (and %d more disk-full failures since the last line)", fault, self._full_unlogged)
                self._full_unlogged = 0
                return
        self._log.error("%s", fault)
