"""Block checksums: xxh3-64 over the block's bytes.

Computed by the writer, verified by the daemon at commit and by every reader after the copy
(so the caller's buffer is what was checked, not the source).

Two implementations of the same digest (exactly ``XXH3_64bits``, what every store, disk file
and peer holds):

- **native** (``kvpool.core._xxh3copy``, built from ``_xxh3copy.c`` when kvpool is installed;
  AVX2 where the CPU has it): a copy and its checksum in one pass, each 64-byte stripe loaded
  once, stored and hashed from the same registers, with the GIL released. A verified read
  runs at the speed of a plain copy (docs/benchmarks.md).
- **portable** (no compiler at install time, or a short block): numpy copies in
  ``COPY_PIECE_BYTES`` pieces, each hashed by the xxhash package right after its copy while it
  is in cache.

``tests/property/test_checksum_native.py`` holds both to the xxhash package's digest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

try:  # built by setuptools from _xxh3copy.c (pyproject.toml, ext-modules; optional)
    from kvpool.core import _xxh3copy as _native
except ImportError:  # pragma: no cover - an install without a C compiler
    _native = None  # type: ignore[assignment]

#: bytes copied per piece on the portable path: a piece is hashed right after its copy, on
#: bytes still in the core's cache (L2 is 1-2 MiB per core on the hosts we measured). Large
#: enough that the Python cost per piece (~2 us) is small next to its copy (~40 us).
COPY_PIECE_BYTES = 256 * 1024

#: blocks of at most this many bytes take XXH3's short-input paths, which only the xxhash
#: package implements (the native kernel does the long path).
_NATIVE_MIN_BYTES = 241

#: a copy of a batch at least this large stores past the cache (``copy_checksum_rows(stream=)``):
#: its first bytes are evicted by its last before anyone reads them, and plain stores would
#: read every destination line into the cache first. Half the bench host's 16 MiB last-level
#: cache; measured there: 8.8 GB/s streamed vs 6.8-7.1 GB/s stored, out of a 4 KiB-page arena
#: (docs/benchmarks.md). Smaller batches keep their bytes in cache for the reader after us.
STREAM_MIN_BYTES = 8 << 20


def native_kernel() -> str | None:
    """The one-pass kernel in use: ``"avx2"``, ``"scalar"`` (a CPU without AVX2), or None
    when the native module was not built (``kvpool inspect doctor`` reports it)."""
    return None if _native is None else str(_native.KERNEL)


def _flat(data: np.ndarray) -> np.ndarray:
    if not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    return data.reshape(-1).view(np.uint8)


def checksum64(data: Any) -> int:
    """xxh3-64 of a bytes-like object or a numpy array (copied first if not contiguous), as an int."""
    if isinstance(data, np.ndarray):
        data = _flat(data)
    size = memoryview(data).nbytes
    if _native is not None and size >= _NATIVE_MIN_BYTES:
        return int(_native.hash_blocks(data, size)[0])
    return xxhash.xxh3_64_intdigest(data)


def _check_rows(rows: np.ndarray, what: str) -> None:
    if rows.ndim != 2 or rows.itemsize != 1:
        raise ValueError(f"{what} must be [n, block_bytes] bytes (uint8), not {rows.dtype} {rows.shape}")


def checksum_rows(rows: np.ndarray) -> list[int]:
    """xxh3-64 of each row of a C-contiguous uint8 array ``[n, block_bytes]``."""
    _check_rows(rows, "rows")
    n, block_bytes = rows.shape
    if n == 0:
        return []
    if _native is not None and block_bytes >= _NATIVE_MIN_BYTES and rows.flags.c_contiguous:
        return _native.hash_blocks(rows, block_bytes)
    return [xxhash.xxh3_64_intdigest(rows[k]) for k in range(n)]


def checksum_at(buffer: np.ndarray, offsets: Sequence[int], block_bytes: int) -> list[int]:
    """xxh3-64 of the ``block_bytes``-byte blocks of the flat uint8 ``buffer`` at ``offsets``,
    in their order; blocks that follow one another are hashed by one call (the daemon's
    verification of a put's slots, which the allocator places side by side)."""
    digests: list[int] = []
    k = 0
    while k < len(offsets):
        start = int(offsets[k])
        count = 1
        while k + count < len(offsets) and int(offsets[k + count]) == start + count * block_bytes:
            count += 1
        digests.extend(checksum_rows(buffer[start : start + count * block_bytes].reshape(count, block_bytes)))
        k += count
    return digests


def copy_checksum_rows(dst: np.ndarray, src: np.ndarray, portable: bool = False, stream: bool = False) -> list[int]:
    """Copy ``src`` into ``dst`` (both C-contiguous uint8 ``[n, block_bytes]``) and return the
    xxh3-64 of each row, computed in the same pass over the bytes (module docstring).
    ``stream``: store past the cache (a batch of ``STREAM_MIN_BYTES`` or more; the native AVX2
    kernel does it where ``dst`` is 32-byte aligned). ``portable`` forces the numpy + xxhash
    path (tests hold both to one digest)."""
    _check_rows(src, "src")
    _check_rows(dst, "dst")
    n, block_bytes = src.shape
    if dst.shape != src.shape:
        raise ValueError(f"copy of {src.shape} rows into {dst.shape}")
    if n == 0:
        return []
    if (
        not portable
        and _native is not None
        and block_bytes >= _NATIVE_MIN_BYTES
        and dst.flags.c_contiguous
        and src.flags.c_contiguous
    ):
        return _native.copy_blocks(dst, src, block_bytes, False, stream)
    return _copy_checksum_rows_portable(dst, src)


def _copy_checksum_rows_portable(dst: np.ndarray, src: np.ndarray) -> list[int]:
    """Numpy copies of at most ``COPY_PIECE_BYTES``, each hashed right after (still in
    cache): small rows a group at a time, a large row piece by piece into a streaming
    xxh3-64 (exact: equal to the one-shot digest)."""
    n, block_bytes = src.shape
    digests: list[int] = []
    if block_bytes < COPY_PIECE_BYTES:
        per_piece = max(1, COPY_PIECE_BYTES // max(1, block_bytes))
        for first in range(0, n, per_piece):
            rows = dst[first : first + per_piece]
            np.copyto(rows, src[first : first + per_piece])
            digests.extend(xxhash.xxh3_64_intdigest(rows[k]) for k in range(rows.shape[0]))
        return digests
    for k in range(n):
        state = xxhash.xxh3_64()
        for start in range(0, block_bytes, COPY_PIECE_BYTES):
            piece = dst[k, start : start + COPY_PIECE_BYTES]
            np.copyto(piece, src[k, start : start + COPY_PIECE_BYTES])
            state.update(piece.data)
        digests.append(state.intdigest())
    return digests
