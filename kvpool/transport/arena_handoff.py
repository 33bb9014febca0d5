"""The arena hand-off protocol: how a same-host client gets the node's arena descriptor.

With ``--arena-handoff fd`` the arena is an anonymous memfd, not a file any process of the
user can open. A client connects to the node's Unix socket (a 0600 file in the arena
directory, named in ``HelloReply.arena_socket``) and sends one line:

    b"KVPA2 " + mode + b" " + put_id + b" " + segment + b" " + token + b"\\n"   (at most 1 KiB)

``mode`` is ``r`` (a read-only descriptor: the mapping cannot be made writable) or ``w``
(the read-write one, only while ``put_id`` is a put the node has started and not yet
committed, aborted or reclaimed); ``put_id`` and ``segment`` are decimal. ``segment`` names
which memfd of a per-tenant arena (``HelloReply.arena_segment_bytes`` > 0; docs/security.md)
the client asks for: the node hands it only while its owner is one of the token's tenant
groups; a one-piece arena has only segment 0. The node answers ``b"K"`` + the segment's
generation (8 bytes, little-endian) with the descriptor attached (SCM_RIGHTS,
``socket.send_fds``), or ``b"E"`` followed by a reason (at most 256 bytes) and no
descriptor. The token is the one the control plane takes (``""`` on a node without
credentials); it crosses only this local socket. One deadline covers the exchange.
"""

from __future__ import annotations

import os
import socket

from kvpool.core.auth import MAX_TOKEN_BYTES
from kvpool.core.errors import InvalidArgument, PermissionDenied, Unavailable
from kvpool.core.unix_path import socket_address

MAGIC = b"KVPA2"
#: the most segments an arena may have (a bound on the number a client sends)
MAX_SEGMENTS = 1 << 20
MAX_REQUEST_BYTES = 1024
MAX_REASON_BYTES = 256
HANDOFF_TIMEOUT_S = 5.0

assert len(MAGIC) + 32 + MAX_TOKEN_BYTES < MAX_REQUEST_BYTES  # a request with the longest token fits


def pack_request(mode: str, put_id: int, token: str, segment: int = 0) -> bytes:
    if (
        mode not in ("r", "w")
        or not 0 <= put_id < 1 << 64
        or not 0 <= segment < MAX_SEGMENTS
        or any(c in token for c in " \r\n")
    ):
        raise InvalidArgument("bad arena hand-off request (mode, put id, segment or a token with spaces)")
    line = b" ".join((MAGIC, mode.encode(), str(put_id).encode(), str(segment).encode(), token.encode())) + b"\n"
    if len(line) > MAX_REQUEST_BYTES:
        raise InvalidArgument(f"arena hand-off request longer than {MAX_REQUEST_BYTES} bytes")
    return line


def unpack_request(line: bytes) -> tuple[str, int, int, str]:
    """(mode, put id, segment, token) of a request line, or InvalidArgument."""
    parts = line.rstrip(b"\n").split(b" ")
    if (
        len(parts) != 5
        or parts[0] != MAGIC
        or parts[1] not in (b"r", b"w")
        or not parts[2].isdigit()
        or not parts[3].isdigit()
    ):
        raise InvalidArgument("not an arena hand-off request")
    if len(parts[2]) > 20 or len(parts[3]) > 7 or len(parts[4]) > MAX_TOKEN_BYTES:
        raise InvalidArgument("arena hand-off request out of bounds")
    return parts[1].decode(), int(parts[2]), int(parts[3]), parts[4].decode("utf-8", "replace")


def pack_reply(generation: int) -> bytes:
    return b"K" + generation.to_bytes(8, "little")


def receive_arena_fd(socket_path: str, mode: str, put_id: int, token: str) -> int:
    """Ask the node at ``socket_path`` for its (one-piece) arena descriptor; the caller owns the fd."""
    return receive_arena_segment(socket_path, mode, put_id, 0, token)[0]


def receive_arena_segment(socket_path: str, mode: str, put_id: int, segment: int, token: str) -> tuple[int, int]:
    """Ask the node at ``socket_path`` for the descriptor of arena ``segment`` and its
    generation; the caller owns the fd."""
    request = pack_request(mode, put_id, token, segment)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(HANDOFF_TIMEOUT_S)
    try:
        with socket_address(socket_path) as address:
            sock.connect(address)
        sock.sendall(request)
        data, fds, _flags, _addr = socket.recv_fds(sock, 1 + MAX_REASON_BYTES, 1)
    except OSError as exc:
        raise Unavailable(
            f"cannot get the arena from {socket_path}: {exc}",
            hint="the client must run on the daemon's host, as the daemon's user",
        ) from None
    finally:
        sock.close()
    if data[:1] == b"K" and len(data) == 9 and len(fds) == 1:
        return fds[0], int.from_bytes(data[1:9], "little")
    for fd in fds:  # a reply that carries descriptors it should not: close them
        os.close(fd)
    reason = data[1:].decode("utf-8", "replace") or "no reason given"
    raise PermissionDenied(f"the node refused the arena: {reason}", hint="pass the token the operator issued")
