"""Unix socket addresses for sockets in directories with long paths.

Why: a Unix socket's address holds at most 107 bytes (``sun_path``), and an arena directory
(``--arena-dir``, a test's temporary folder, a container's mount) can be longer. Linux
resolves ``/proc/self/fd/N/name`` through a descriptor of the directory, so the same file
is bound and reached through a short name; the socket's file still lies in the directory,
with the directory's permissions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

#: the longest path a Unix socket address holds, in bytes (sun_path is 108 with its NUL)
UNIX_PATH_MAX_BYTES = 107


@contextlib.contextmanager
def socket_address(path: str) -> Iterator[str]:
    """``path`` itself when it fits a Unix socket address, else the same file through a
    descriptor of its directory (valid inside the ``with`` block: bind or connect there)."""
    if len(os.fsencode(path)) <= UNIX_PATH_MAX_BYTES:
        yield path
        return
    folder, name = os.path.split(path)
    fd = os.open(folder or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)
