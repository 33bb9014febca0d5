"""Block checksums: xxh3-64 over the block's bytes.

Computed by the writer, verified by the daemon at commit and by every reader
after the copy (so the caller's buffer is what was checked, not the source).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash


def checksum64(data: Any) -> int:
    """xxh3-64 of a bytes-like object or a C-contiguous numpy array, as an int."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        data = data.reshape(-1).view(np.uint8)
    return xxhash.xxh3_64_intdigest(data)
