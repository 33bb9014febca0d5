"""Checking landed bytes before anyone can use them: every reader of the data plane counts an
item as arrived only after its bytes, where the caller will read them, matched the checksum the
node sent (the writer's, verified at commit; or, for a byte range, the node's fresh one).

Two shapes: ``verify_in_place`` for bytes that landed straight in the caller's rows (TCP's
``recv_into``, a direct NIXL READ, a direct UCX receive), ``copy_verified`` for bytes that landed
in a buffer of the transport's own and are copied out only once checked.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpool.core.checksum import checksum64


def verify_in_place(rows: Sequence[np.ndarray], metas: Sequence[tuple[int, int]], progress: list[int]) -> int:
    """Checksum each landed row against its (length, checksum) meta; ``progress[0]`` counts the
    leading good ones. Returns the first index that failed, or -1."""
    for i, (_, checksum) in enumerate(metas):
        if checksum64(rows[i]) != checksum:
            return i
        progress[0] = i + 1
    return -1


def copy_verified(
    staging: np.ndarray,
    starts: Sequence[int],
    metas: Sequence[tuple[int, int]],
    dst: Sequence[np.ndarray],
    progress: list[int],
) -> int:
    """Check each item landed in ``staging`` (item i at ``[starts[i], starts[i + 1])``) against its
    checksum and only then copy it into ``dst[i]``; ``progress[0]`` counts the leading items copied.
    Returns the first index that failed its checksum, or -1. The UCX and NIXL readers receive into
    a buffer of their own and use this, so a bad or late byte never reaches the caller's rows."""
    for i, (_, checksum) in enumerate(metas):
        landed = staging[int(starts[i]) : int(starts[i + 1])]
        if checksum64(landed) != checksum:
            return i
        memoryview(dst[i]).cast("B")[:] = memoryview(landed)  # type: ignore[arg-type]
        progress[0] = i + 1
    return -1
