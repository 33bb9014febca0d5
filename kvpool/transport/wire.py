"""The data plane's framing: fixed little-endian headers, then raw block bytes.

    READ   request : Header(op=READ, count=n, namespace) + n x (key16, range_offset u64, range_length u64)
           reply   : ReplyHeader(status, count=m, message_len) + message + m x (length u64, checksum u64)
                     + the m byte ranges back to back
    WRITE  request : Header(op=WRITE, count=n, namespace) + block_bytes u64 + n x (key16, checksum u64)
                     + the n blocks back to back
           reply   : ReplyHeader(status, count=0, message_len) + message + WriteCounts

    AUTH   challenge: Header(op=AUTH, count=0) -> ReplyHeader(OK, count=32) + 32-byte nonce
           proof    : Header(op=AUTH, count=len(ticket id) + 32) + ticket id
                      + HMAC-SHA256(ticket key, context || nonce)
                      -> ReplyHeader(OK) or ReplyHeader(UNAUTHENTICATED) and the connection closes
                      (the ticket and its key come from the node's control plane: HelloReply)

    UCX_HELLO  request : Header(op=UCX_HELLO, count=len(address)) + the reader's UCX worker address
           reply       : ReplyHeader(OK, flags, count=len(address)) + the server's worker address;
                         flags has FLAG_UCX_RUNS where the server serves READ_UCX_RUNS
    READ_UCX   request : as READ (after UCX_HELLO upgraded the connection)
           reply       : as READ's header and metas; the bytes follow as one UCX tag message per item
    READ_UCX_RUNS request : Header(op=READ_UCX_RUNS, count=n) + joins(n) + the n READ items, where
                         joins(n) is a bitmap of ceil(n / 8) bytes (bit i, least significant first:
                         item i's destination starts where item i - 1's ends, so both may share a message)
           reply       : as READ's header and metas, then joins(m): the server's cut (a bit set only
                         where the reader's was and the two blocks also lie end to end in its arena);
                         the bytes follow as one UCX tag message per run of joined items

    NIXL_HELLO request : Header(op=NIXL_HELLO, count=0 | 1)
           reply       : ReplyHeader(OK, count=len(name)) + agent name + metadata length u64 + metadata
                         (metadata only when count was 1; at most ``MAX_NIXL_METADATA`` bytes)
    NIXL_READ  request : as READ
           reply       : as READ's header and metas, then m x address u64 (no bytes follow: the reader
                         pulls them with one batched NIXL READ, then sends Header(op=NIXL_DONE, count=m);
                         the server holds its read lease until then, or until the connection drops)

A server with credentials answers READ / WRITE / READ_UCX(_RUNS) / UCX_HELLO / NIXL_* on a connection that has
not passed AUTH with UNAUTHENTICATED and closes it; one whose namespace the authenticated
credential may not use gets DENIED and is closed (``kvpool.core.tickets``).

A READ or WRITE past its tenant's share of the node's data plane (``kvpool/transport/shares.py``)
is answered BUSY after its request was read and dropped: the connection stays in sync.

A full-block read carries the checksum the writer computed (checked at commit: in full for a
data-plane write, a random sample of a same-host put), so the
check on arrival is end to end. For a byte-range read the server first verifies the WHOLE
block in its arena against that committed checksum (one xxh3 per block; a block that rotted
after commit ends the reply there: it and every later item are misses, logged), then sends
the range with a fresh xxh3 of the range, which covers the wire. ``m`` < ``n`` when the node
holds only a prefix of the keys; the rest are misses.

Everything a peer sends is bounds-checked on arrival: a reply with more items than asked
(``m`` > ``n``), a length that is not the destination's, or write counts beyond the batch is a
protocol error: the reader drops the connection and the request is a miss. A reader's or
writer's ``timeout_s`` is one deadline for the whole request; each recv / send waits only
the time left before it.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.core.errors import InvalidArgument

MAGIC = b"KVPT"
VERSION = 1
OP_READ = 1
OP_WRITE = 2
OP_PING = 3
OP_UCX_HELLO = 4  # payload: worker address (count = its length); reply: the server's worker address
OP_READ_UCX = 5  # like READ, but the bytes travel as UCX tag messages, one per item
OP_AUTH = 6  # count 0: ask for a nonce; count 32: the proof for it
OP_NIXL_HELLO = 7  # count 0: the server's NIXL agent name; 1: its name and agent metadata
OP_NIXL_READ = 8  # like READ, but the reply carries arena addresses: the reader pulls (NIXL READ)
OP_NIXL_DONE = 9  # the reader's pulls of the last NIXL_READ finished: the server releases its lease
OP_READ_UCX_RUNS = 10  # like READ_UCX, but items lying end to end on both sides share one message
#: in the UCX_HELLO reply's flags: this server serves READ_UCX_RUNS (servers before it send 0
#: and are read with READ_UCX)
FLAG_UCX_RUNS = 1
#: the ops that read or write a namespace's blocks: admitted only for a principal that may use it
NAMESPACE_OPS = (OP_READ, OP_WRITE, OP_READ_UCX, OP_READ_UCX_RUNS, OP_NIXL_READ)

STATUS_OK = 0
STATUS_UNKNOWN_NAMESPACE = 1
STATUS_BAD_REQUEST = 2
STATUS_FULL = 3  # capacity exhausted
STATUS_ERROR = 4
STATUS_UNAUTHENTICATED = 5  # no AUTH yet, or a proof no credential made
STATUS_DENIED = 6  # the authenticated credential may not use this namespace
STATUS_BUSY = 7  # the peer's tenant is past its share of this data plane (transport/shares.py): a miss

HEADER = struct.Struct("<4sBBHI16s")  # magic, version, op, flags, count, namespace
REPLY = struct.Struct("<4sBBHII")  # magic, version, status, flags, count, message length
READ_ITEM = struct.Struct("<16sQQ")
READ_META = struct.Struct("<QQ")  # length, checksum
WRITE_ITEM = struct.Struct("<16sQ")  # key, checksum
WRITE_COUNTS = struct.Struct("<IIII")  # stored, already_present, in_flight, checksum_failed
U64 = struct.Struct("<Q")
NIXL_ADDRESS = U64  # per served item of a NIXL_READ: the virtual address of its bytes in the server's arena

MAX_ITEMS = 65_536  # most items one request may carry (also the largest UCX worker address)
MAX_MESSAGE = 4096
MAX_NIXL_METADATA = 1 << 20  # an agent's metadata (its backends' connection info and memory keys)
#: ``send_gathered``: the most bytes and buffers handed to one ``sendmsg`` (well inside IOV_MAX)
GATHER_BYTES = 4 << 20
GATHER_BUFFERS = 64


class PeerClosed(ConnectionError):
    """The peer closed the connection mid-frame."""


def time_left(deadline: float | None, clock: Callable[[], float] = time.monotonic) -> float | None:
    """Seconds left before ``deadline`` (a ``time.monotonic()`` value; None = no deadline).

    Raises ``TimeoutError`` once it has passed: the deadline bounds a whole request, so a
    peer that trickles bytes (each recv well inside the timeout) still runs out of time."""
    if deadline is None:
        return None
    left = deadline - clock()
    if left <= 0:
        raise TimeoutError("the transfer ran past its deadline")
    return left


def arm(sock: socket.socket, deadline: float | None) -> None:
    """Set the socket timeout to the time left before ``deadline`` (no-op without one)."""
    left = time_left(deadline)
    if left is not None:
        sock.settimeout(left)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from the socket (no intermediate copy). With a ``deadline`` each recv
    waits at most the time left before it: the whole fill is bounded, not each recv."""
    got = 0
    total = len(view)
    while got < total:
        arm(sock, deadline)
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise PeerClosed(f"peer closed after {got} of {total} bytes")
        got += n


def send_all(sock: socket.socket, data: bytes | memoryview, deadline: float | None = None) -> None:
    """``sendall`` bounded by ``deadline`` (Python's ``sendall`` timeout covers the whole call)."""
    arm(sock, deadline)
    sock.sendall(data)


def send_gathered(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> int:
    """Send ``buffers`` back to back, several per ``sendmsg`` call (up to ``GATHER_BYTES`` /
    ``GATHER_BUFFERS``); returns the bytes sent.

    Why: loopback TCP here moves 256 KiB items sent one ``send`` each at ~3.3 GB/s and the same
    items gathered 16 to a call at ~4.8 GB/s (a two-process C check, docs/benchmarks.md): the
    cost is per call, not per byte. The stream is the same bytes either way, so a reader sees no
    difference. TLS sockets have no ``sendmsg``: one ``sendall`` per buffer there."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    total = sum(len(v) for v in views)
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            sock.sendall(view)
        return total
    first, done = 0, 0  # the first unsent buffer, and how much of it already went
    while first < len(views):
        batch = [views[first][done:]]
        size = len(batch[0])
        last = first + 1
        while last < len(views) and len(batch) < GATHER_BUFFERS and size < GATHER_BYTES:
            batch.append(views[last])
            size += len(views[last])
            last += 1
        sent = sock.sendmsg(batch)
        while sent:  # advance past what went (a partial send stops inside some buffer)
            rest = len(views[first]) - done
            if sent < rest:
                done += sent
                break
            sent -= rest
            first, done = first + 1, 0
    return total


def pack_header(op: int, count: int, namespace: bytes) -> bytes:
    if len(namespace) != 16:
        raise InvalidArgument(f"namespace digest must be 16 bytes, got {len(namespace)}")
    if not 0 <= count <= MAX_ITEMS:
        raise InvalidArgument(f"{count} items in one transfer; the limit is {MAX_ITEMS}", hint="split the batch")
    return HEADER.pack(MAGIC, VERSION, op, 0, count, namespace)


def unpack_header(data: bytes) -> tuple[int, int, bytes]:
    magic, version, op, _flags, count, namespace = HEADER.unpack(data)
    if magic != MAGIC:
        raise InvalidArgument(f"bad magic {magic!r}: not a kvpool data-plane peer")
    if version != VERSION:
        raise InvalidArgument(f"data-plane version {version} is not {VERSION}", hint="run the same kvpool version")
    if count > MAX_ITEMS:
        raise InvalidArgument(f"{count} items in one transfer; the limit is {MAX_ITEMS}")
    return op, count, namespace


def pack_reply(status: int, count: int, message: str = "", flags: int = 0) -> bytes:
    text = message.encode("utf-8")[:MAX_MESSAGE]
    return REPLY.pack(MAGIC, VERSION, status, flags, count, len(text)) + text


def recv_reply(sock: socket.socket, deadline: float | None = None) -> tuple[int, int, str]:
    status, count, message, _flags = recv_reply_flags(sock, deadline)
    return status, count, message


def recv_reply_flags(sock: socket.socket, deadline: float | None = None) -> tuple[int, int, str, int]:
    """``recv_reply`` and the reply's flags (what the server can do: ``FLAG_*``; 0 from older servers)."""
    magic, version, status, flags, count, msg_len = REPLY.unpack(recv_exact(sock, REPLY.size, deadline))
    if magic != MAGIC or version != VERSION:
        raise InvalidArgument(f"bad reply header {magic!r} v{version}")
    if msg_len > MAX_MESSAGE or count > MAX_ITEMS:
        raise InvalidArgument("reply header out of bounds")
    message = recv_exact(sock, msg_len, deadline).decode("utf-8", "replace") if msg_len else ""
    return status, count, message, flags


def pack_read_items(items: Sequence[tuple[bytes, int, int]]) -> bytes:
    return b"".join(READ_ITEM.pack(k, off, length) for k, off, length in items)


def unpack_read_items(data: bytes, count: int) -> list[tuple[bytes, int, int]]:
    return [READ_ITEM.unpack_from(data, i * READ_ITEM.size) for i in range(count)]


def joins_bytes(count: int) -> int:
    """Size of the joins bitmap of ``count`` items (READ_UCX_RUNS)."""
    return (count + 7) // 8


def pack_joins(joins: Sequence[bool]) -> bytes:
    """Bit i set = item i shares a message with item i - 1 (least significant bit first)."""
    return np.packbits(np.asarray(joins, dtype=bool), bitorder="little").tobytes()


def unpack_joins(data: bytes, count: int) -> list[bool]:
    """Inverse of ``pack_joins``; item 0 never joins (a set bit 0 is a protocol error)."""
    if len(data) != joins_bytes(count):
        raise InvalidArgument(f"a joins bitmap of {count} items is {joins_bytes(count)} bytes, not {len(data)}")
    joins = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count, bitorder="little").astype(bool)
    if count and joins[0]:
        raise InvalidArgument("item 0 cannot join a message before it")
    return [bool(j) for j in joins]
