"""A reply's rows received from a socket and checksummed in one pass (the native path of
``TcpTransport``'s receive).

Why: a TCP read is the kernel's copy into the caller's rows plus our xxh3 pass over them.
Received by Python one ``recv_into`` at a time and hashed row by row afterwards, a 4 MiB row
is out of the core's cache before it is hashed, and each wake-up finds only a few segments.
``kvpool.core._xxh3copy.recv_rows`` receives without the GIL, waits (``SO_RCVLOWAT``) until a
``RECV_PIECE_BYTES`` piece has arrived, and folds each 1,024-byte block into the row's digest
right after it lands. Two-process C check on loopback, 256 KiB pieces: ~5 GB/s received and
hashed, against ~3.6 GB/s for the Python loop (docs/benchmarks.md).

A signal that interrupts a wait runs Python's handlers there (Ctrl-C stops a read at once, as
with ``recv_into``; the caller then drops the connection, whose stream is out of step).

The digest is exactly ``checksum64`` of the row (tests/property/test_recv_rows.py). Rows of at
most 240 bytes, TLS sockets (the bytes are decrypted in Python's ``ssl``) and installs without
the native module take ``receive_portable``: ``recv_into`` and a checksum per row, with the
same result.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence

import numpy as np

from kvpool.core.checksum import checksum64
from kvpool.transport import wire

try:  # built with kvpool (pyproject.toml, ext-modules); optional
    from kvpool.core import _xxh3copy as _native
except ImportError:  # pragma: no cover - an install without a C compiler
    _native = None  # type: ignore[assignment]

#: how many bytes a wake-up waits for (less at a row's end): large enough that a wake-up
#: receives a piece, small enough that the piece is still in L2 when it is hashed
RECV_PIECE_BYTES = 256 * 1024
#: the wait without a deadline (the portable path then waits on the socket's own timeout)
_NO_DEADLINE_S = 365 * 24 * 3600.0

_CLOSED, _TIMEOUT, _ERROR = 1, 2, 3


def usable(sock: socket.socket, rows: Sequence[np.ndarray]) -> bool:
    """Whether ``receive`` can take these rows from this socket."""
    return (
        _native is not None
        and not isinstance(sock, ssl.SSLSocket)
        and all(row.nbytes >= _native.MIN_BLOCK_BYTES and row.flags.c_contiguous for row in rows)
    )


def receive(
    sock: socket.socket, rows: Sequence[np.ndarray], deadline: float | None
) -> tuple[list[int], OSError | None]:
    """Fill ``rows`` in order from ``sock``; returns the digests of the rows received whole and,
    if it stopped early, why (``wire.PeerClosed``, ``TimeoutError`` or the ``OSError``): the
    caller verifies those rows before it gives up on the rest."""
    left = wire.time_left(deadline)
    timeout_s = _NO_DEADLINE_S if left is None else left
    digests, status, errno = _native.recv_rows(sock.fileno(), rows, timeout_s, RECV_PIECE_BYTES)
    failure: OSError | None = None
    if status == _CLOSED:
        failure = wire.PeerClosed(f"peer closed after {len(digests)} of {len(rows)} rows")
    elif status == _TIMEOUT:
        failure = TimeoutError("the transfer ran past its deadline")
    elif status == _ERROR:
        failure = OSError(errno, f"receive failed after {len(digests)} of {len(rows)} rows")
    return digests, failure


def receive_portable(
    sock: socket.socket, rows: Sequence[np.ndarray], deadline: float | None
) -> tuple[list[int], OSError | None]:
    """``receive`` by ``recv_into`` and a checksum per row, right after it landed."""
    digests: list[int] = []
    try:
        for row in rows:
            wire.recv_into_exact(sock, memoryview(row).cast("B"), deadline)  # type: ignore[arg-type]
            digests.append(checksum64(row))
    except OSError as exc:  # PeerClosed, TimeoutError, socket errors: the caller raises it
        return digests, exc
    return digests, None
