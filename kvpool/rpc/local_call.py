"""Same-host unary calls over a Unix socket: the wire format, the client's channel and the
handler context the daemon's side gives the service.

Why: a unary gRPC call costs 0.5-1.4 ms on a 2-core host when calls are spaced (its core's
poller threads on both sides wake one another through a chain of hand-offs), the latency a
serving engine pays on every prefix lookup and lease before the first token. A blocking Unix
socket with one daemon thread per connection answers the same call in ~0.1 ms paced
(``tools/bench_pool.py``). The daemon runs **the same handlers** (``kvpool.rpc.serving``):
the same decoding and size limits, the same ``principal_of`` on the same bearer token, the
same tenant gate; only the framing differs. Block bytes never cross this socket (they move
through the mapped arena, as with gRPC).

Wire (every integer little-endian; a frame is a ``u32`` body length and the body):

    client hello   b"KVPL1\\0" + token (UTF-8, at most MAX_TOKEN_BYTES)
    hello reply    b"K" + node id           | b"E" + reason (connection closed after)
    call           u8 n + method name (n ASCII bytes) + request (serialized protobuf)
    call reply     b"K" + reply (protobuf)  | b"E" + u8 n + error wire name + u16 m + message + u16 h + hint

Bounds: a call frame is at most the service's request limit plus ``CALL_FRAME_OVERHEAD``; a
frame past it, a bad hello, an unknown method or a malformed frame closes the connection
(the client gets ``Unavailable`` and its later calls go through gRPC). The socket file is
0600 in the arena directory (``--arena-socket-mode`` widens it), so by default only the
daemon's uid can connect; with credentials a connection also needs a token the daemon knows.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from kvpool.core.auth import MAX_TOKEN_BYTES
from kvpool.core.errors import (
    DeadlineExceeded,
    ErrorCode,
    InvalidArgument,
    KVPoolError,
    Unavailable,
    error_from_code,
)
from kvpool.core.unix_path import socket_address
from kvpool.rpc.auth import Metadata
from kvpool.rpc.errors import CODE_KEY, HINT_KEY

HELLO_MAGIC = b"KVPL1\0"
OK, ERR = b"K", b"E"
#: room in a call frame besides the request: the method name and its length byte
CALL_FRAME_OVERHEAD = 256
#: a hello frame: the magic and the longest token
MAX_HELLO_BYTES = len(HELLO_MAGIC) + MAX_TOKEN_BYTES
#: longest hello reason / error message / hint sent back, in bytes (the rest is cut)
MAX_TEXT_BYTES = 4096
#: idle connections a client keeps open for later calls (one per concurrent call in flight)
CLIENT_POOL_CONNECTIONS = 8
#: how long a client waits for the daemon's answer to its hello
HELLO_TIMEOUT_S = 5.0

_LEN = struct.Struct("<I")


class LocalCallClosed(Unavailable):
    """The local connection broke. ``sent``: whether the call's request had been handed to
    the kernel before it broke (then the daemon may have run it; before, it surely did not)."""

    def __init__(self, message: str, sent: bool) -> None:
        super().__init__(message, hint="the client goes back to gRPC; check that the daemon is running")
        self.sent = sent


def recv_exact(conn: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes, or ConnectionError if the peer closes first."""
    data = conn.recv(size, socket.MSG_WAITALL) if size else b""
    if len(data) == size:
        return data
    chunks = [data]
    got = len(data)
    while got < size:
        chunk = conn.recv(size - got)
        if not chunk:
            raise ConnectionError(f"peer closed after {got} of {size} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(conn: socket.socket, max_bytes: int) -> bytes | None:
    """The next frame's body; None when the peer closed between frames; ValueError when the
    frame is larger than ``max_bytes`` (the caller drops the connection without reading it)."""
    head = conn.recv(_LEN.size, socket.MSG_WAITALL)
    if not head:
        return None
    if len(head) != _LEN.size:
        raise ConnectionError("peer closed inside a frame header")
    (size,) = _LEN.unpack(head)
    if size > max_bytes:
        raise ValueError(f"a {size}-byte frame; the limit is {max_bytes}")
    return recv_exact(conn, size)


def send_frame(conn: socket.socket, *parts: bytes) -> None:
    conn.sendmsg([_LEN.pack(sum(len(p) for p in parts)), *parts])


def _text(value: str, width: str) -> bytes:
    raw = value.encode("utf-8", "replace")[:MAX_TEXT_BYTES]
    return struct.pack("<" + width, len(raw)) + raw


def pack_error(err: KVPoolError) -> bytes:
    return ERR + _text(err.code.wire_name, "B") + _text(err.message, "H") + _text(err.hint, "H")


def unpack_error(body: bytes) -> KVPoolError:
    """The typed error a reply frame carries (InvalidArgument if it is malformed)."""
    try:
        at, fields = 1, []
        for width in ("B", "H", "H"):
            (size,) = struct.unpack_from("<" + width, body, at)
            at += struct.calcsize(width)
            if at + size > len(body):
                raise struct.error("field past the frame")
            fields.append(body[at : at + size].decode("utf-8", "replace"))
            at += size
        return error_from_code(ErrorCode.from_wire_name(fields[0]), fields[1], fields[2])
    except struct.error:
        return InvalidArgument(
            "the daemon's local call reply is malformed", hint="use a kvpool client of the same version"
        )


def pack_call(method: str, request: bytes) -> tuple[bytes, bytes]:
    name = method.encode("ascii")
    if not 0 < len(name) < 256:
        raise InvalidArgument(f"method name {method!r} is not 1-255 ASCII bytes")
    return bytes((len(name),)) + name, request


def unpack_call(body: bytes) -> tuple[str, bytes]:
    """(method, request bytes) of a call frame, or ValueError."""
    if not body or len(body) < 1 + body[0] or body[0] == 0:
        raise ValueError("call frame without a method name")
    return body[1 : 1 + body[0]].decode("ascii"), body[1 + body[0] :]


def unpack_hello(body: bytes) -> str:
    """The token of a hello frame, or ValueError."""
    if not body.startswith(HELLO_MAGIC) or len(body) > MAX_HELLO_BYTES:
        raise ValueError("not a kvpool local-call hello")
    return body[len(HELLO_MAGIC) :].decode("utf-8")


class CallAborted(Exception):
    """Raised by ``LocalCallContext.abort``: how a handler's typed error leaves it."""


class LocalCallContext:
    """What a Pool handler needs of ``grpc.ServicerContext`` for one local call: the
    connection's token as call metadata, ``abort`` with the typed error's trailing metadata,
    and the status for the timing metrics. Not a test double: the daemon's local-call
    server runs every handler with one of these."""

    def __init__(self, metadata: Metadata | None) -> None:
        self._metadata = metadata or ()
        self._trailing: dict[str, str] = {}
        self._code: grpc.StatusCode | None = None
        self._details = ""

    def invocation_metadata(self) -> Metadata:
        return self._metadata

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._trailing.update({str(k): str(v) for k, v in metadata})

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details
        raise CallAborted(details)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def is_active(self) -> bool:
        return True

    def peer(self) -> str:
        return "unix:local"

    def error(self) -> KVPoolError:
        """The typed error an aborted call answers with."""
        code = ErrorCode.from_wire_name(self._trailing.get(CODE_KEY, ""))  # unknown: INTERNAL
        return error_from_code(code, self._details, self._trailing.get(HINT_KEY, ""))


class LocalChannel:
    """A client's connections to one daemon's local-call socket: up to
    ``CLIENT_POOL_CONNECTIONS`` kept open, one per call in flight (thread-safe)."""

    def __init__(self, path: str, token: str, node_id: str, timeout_s: float) -> None:
        self.path = path
        self._token = token
        self._node_id = node_id
        self._timeout_s = timeout_s
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()  # a forked child shares these sockets: it must not use them

    @classmethod
    def open(cls, path: str, token: str, node_id: str, timeout_s: float) -> LocalChannel:
        """A channel whose first connection said hello; Unavailable (or the daemon's typed
        refusal) if the socket is not there, not this daemon's, or refuses the token."""
        channel = cls(path, token, node_id, timeout_s)
        channel._release(channel._connect())  # the daemon's typed refusal, or Unavailable
        return channel

    def _connect(self) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(min(self._timeout_s, HELLO_TIMEOUT_S))
            with socket_address(self.path) as address:
                conn.connect(address)
            send_frame(conn, HELLO_MAGIC, self._token.encode())
            body = read_frame(conn, 1 + MAX_TEXT_BYTES + 256)
            if body is None or not body:
                raise ConnectionError("closed during the hello")
            if body[:1] == ERR:
                raise Unavailable(
                    f"the daemon's local-call socket {self.path} refused this client: "
                    f"{body[1:].decode('utf-8', 'replace')}"
                )
            if body[:1] != OK or body[1:].decode("utf-8", "replace") != self._node_id:
                raise Unavailable(f"{self.path} is not the local-call socket of node {self._node_id}")
            conn.settimeout(self._timeout_s)
            return conn
        except (OSError, ValueError) as exc:
            conn.close()
            raise Unavailable(f"cannot open the local-call socket {self.path}: {exc}") from None
        except BaseException:
            conn.close()
            raise

    def _take(self, fresh: bool) -> tuple[socket.socket, bool]:
        """(a connection, whether it was idle in the pool); LocalCallClosed if none can be had."""
        with self._lock:
            if self._closed:
                raise LocalCallClosed("the local channel is closed", sent=False)
            if os.getpid() != self._pid:  # its frames would interleave with the parent's
                raise LocalCallClosed("the local channel was opened by the parent of this process", sent=False)
            if self._idle and not fresh:
                return self._idle.pop(), True
        try:
            return self._connect(), False
        except Unavailable as err:
            raise LocalCallClosed(err.message, sent=False) from None

    def _release(self, conn: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < CLIENT_POOL_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def call(self, method: str, request: Any, reply_cls: Any, max_reply_bytes: int) -> Any:
        """The reply to ``method(request)``; the daemon's typed error; DeadlineExceeded after
        the channel's timeout; LocalCallClosed if the connection broke (``sent`` says whether
        the daemon may have run the call). An idle connection found closed before the request
        left is replaced once."""
        head, payload = pack_call(method, request.SerializeToString())
        for fresh in (False, True):
            conn, reused = self._take(fresh)
            sent = False
            try:
                send_frame(conn, head, payload)
                sent = True
                body = read_frame(conn, max_reply_bytes + 1)
                if not body:
                    raise ConnectionError("the daemon closed the connection before answering")
            except TimeoutError:
                conn.close()  # its answer may still come: the connection is out of step
                raise DeadlineExceeded(
                    f"the kvpool daemon did not answer {method} in {self._timeout_s} s", hint="is it overloaded?"
                ) from None
            except (OSError, ValueError) as exc:
                conn.close()
                if reused and not sent:
                    continue
                raise LocalCallClosed(f"local call {method} failed: {exc}", sent=sent) from None
            except BaseException:
                conn.close()
                raise
            self._release(conn)
            if body[:1] == OK:
                return reply_cls.FromString(body[1:])
            raise unpack_error(body)
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            with contextlib.suppress(OSError):
                conn.close()
