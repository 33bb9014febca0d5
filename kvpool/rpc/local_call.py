"""Same-host unary calls over a Unix socket: the wire format, the daemon's proof of identity,
and the handler context the daemon's side gives the service (the client's connections:
``kvpool.rpc.local_channel``; the daemon's: ``kvpool.daemon.local_calls``).

Why: a unary gRPC call costs 0.5-1.4 ms on a 2-core host when calls are spaced (its core's
poller threads on both sides wake one another through a chain of hand-offs), the latency a
serving engine pays on every prefix lookup and lease before the first token. A blocking Unix
socket with one daemon thread per connection answers the same call in a third of that
(``tools/bench_pool.py``). The daemon runs **the same handlers** (``kvpool.rpc.serving``):
the same decoding and size limits, the same ``principal_of`` on the same bearer token, the
same tenant gate; only the framing differs. Block bytes never cross this socket (they move
through the mapped arena, as with gRPC).

Who is listening: the socket's name comes from the daemon's ``HelloReply.local_socket``,
with a key made for that one ``Hello`` (``local_key_id``, ``local_key`` = HMAC of the
daemon's secret of this start over the id). A connection opens with the key id and a fresh
nonce; the daemon answers with ``HMAC(key, nonce)``; only then does the client send its
token. So a process that binds the name after the daemon stopped (``/dev/shm`` is writable
by every user) gets no token and cannot answer calls: it knows no key, and another tenant's
``Hello`` gave that tenant a key of its own, not this client's.

Wire (every integer little-endian; a frame is a ``u32`` body length and the body):

    client hello   MAGIC + key id (16 bytes) + nonce (16 bytes)
    proof          b"K" + HMAC-SHA256(key, PROOF_LABEL + nonce) + u32 largest call frame + node id
                   | b"E" + reason (connection closed after)
    client token   token (UTF-8, at most MAX_TOKEN_BYTES; empty without one)
    admitted       b"K" | b"E" + reason (connection closed after)
    call           u8 n + method name (n ASCII bytes) + request (serialized protobuf)
    call reply     b"K" + reply (protobuf)  | b"E" + u8 n + error wire name + u16 m + message + u16 h + hint

Bounds: the hello and the token within one deadline; a call frame at most the service's
request limit plus ``CALL_FRAME_OVERHEAD`` (the proof tells the client, which sends a larger
request over gRPC instead); a frame past it, a malformed frame or an unknown method closes
the connection. The socket file is 0600 in the arena directory (``--arena-socket-mode``
widens it), so by default only the daemon's uid can connect; with credentials a connection
also needs a token the daemon knows.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from collections.abc import Sequence

import grpc

from kvpool.core.auth import MAX_TOKEN_BYTES
from kvpool.core.errors import ErrorCode, InvalidArgument, KVPoolError, Unavailable, error_from_code
from kvpool.rpc.auth import Metadata
from kvpool.rpc.errors import CODE_KEY, HINT_KEY

MAGIC = b"KVPL1\0"
OK, ERR = b"K", b"E"
KEY_ID_BYTES = NONCE_BYTES = 16
PROOF_BYTES = 32
KEY_LABEL = b"kvpool-local-key-v1|"
PROOF_LABEL = b"kvpool-local-proof-v1|"
HELLO_BYTES = len(MAGIC) + KEY_ID_BYTES + NONCE_BYTES
#: room in a call frame besides the request: the method name and its length byte
CALL_FRAME_OVERHEAD = 256
#: longest hello reason / error message / hint sent back, in bytes (the rest is cut)
MAX_TEXT_BYTES = 4096
#: a frame of the daemon's during the hello: the proof, the frame limit and a node id, or a reason
MAX_PROOF_FRAME_BYTES = 1 + PROOF_BYTES + 4 + MAX_TEXT_BYTES
#: frames longer than this are read as their bytes arrive, not into one buffer of the announced size
READ_CHUNK_BYTES = 64 << 10

_LEN = struct.Struct("<I")
_LIMIT = struct.Struct("<I")


class LocalCallClosed(Unavailable):
    """No local call could be made, or its connection broke. ``sent``: whether the request
    had been handed to the kernel (then the daemon may have run it: not safe to send again);
    ``gone``: the socket is not there or not the daemon's (its name is stale: the client
    stops using it until its next ``Hello``), as against a passing refusal (busy) or a
    failure of this connection alone."""

    def __init__(self, message: str, sent: bool, gone: bool = False, refused: bool = False) -> None:
        super().__init__(message, hint="the client uses gRPC instead; check that the daemon is running")
        self.sent = sent
        self.gone = gone
        self.refused = refused  # the daemon refused this client's token: asking again will not help


class LocalCallKeys:
    """The daemon's side of the proof: a secret made at start, a key per ``Hello``."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else os.urandom(32)

    def issue(self) -> tuple[bytes, bytes]:
        """(key id, key) for one ``HelloReply``."""
        key_id = os.urandom(KEY_ID_BYTES)
        return key_id, self.key_of(key_id)

    def key_of(self, key_id: bytes) -> bytes:
        return hmac.new(self._secret, KEY_LABEL + key_id, hashlib.sha256).digest()


def prove(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, PROOF_LABEL + nonce, hashlib.sha256).digest()


def recv_exact(conn: socket.socket, size: int, deadline: float | None = None) -> bytes:
    """Exactly ``size`` bytes, or ConnectionError if the peer closes first; with a
    ``deadline`` (``time.monotonic()``), TimeoutError once it passes, however the bytes trickle."""
    if deadline is None and size <= READ_CHUNK_BYTES:
        data = conn.recv(size, socket.MSG_WAITALL) if size else b""
        if len(data) == size:
            return data
        got, chunks = len(data), [data]
    else:
        got, chunks = 0, []
    while got < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the hello took too long")
            conn.settimeout(left)
        chunk = conn.recv(min(size - got, READ_CHUNK_BYTES))
        if not chunk:
            raise ConnectionError(f"peer closed after {got} of {size} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(conn: socket.socket, max_bytes: int, deadline: float | None = None) -> bytes | None:
    """The next frame's body; None when the peer closed between frames; ValueError when the
    frame is larger than ``max_bytes`` (the caller drops the connection without reading it)."""
    if deadline is None:
        head = conn.recv(_LEN.size, socket.MSG_WAITALL)
        if not head:
            return None
        if len(head) != _LEN.size:
            raise ConnectionError("peer closed inside a frame header")
    else:
        try:
            head = recv_exact(conn, _LEN.size, deadline)
        except ConnectionError:
            return None
    (size,) = _LEN.unpack(head)
    if size > max_bytes:
        raise ValueError(f"a {size}-byte frame; the limit is {max_bytes}")
    return recv_exact(conn, size, deadline)


def frame(*parts: bytes) -> bytes:
    return _LEN.pack(sum(len(p) for p in parts)) + b"".join(parts)


def send_frame(conn: socket.socket, *parts: bytes) -> None:
    """All of the frame (``sendall``: a request larger than the socket buffer goes out whole)."""
    conn.sendall(frame(*parts))


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


def unpack_hello(body: bytes) -> tuple[bytes, bytes]:
    """(key id, nonce) of a client's hello frame, or ValueError."""
    if len(body) != HELLO_BYTES or not body.startswith(MAGIC):
        raise ValueError("not a kvpool local-call hello")
    return body[len(MAGIC) : len(MAGIC) + KEY_ID_BYTES], body[len(MAGIC) + KEY_ID_BYTES :]


def pack_proof(key: bytes, nonce: bytes, max_call_frame_bytes: int, node_id: str) -> bytes:
    return OK + prove(key, nonce) + _LIMIT.pack(max_call_frame_bytes) + node_id.encode()[:MAX_TEXT_BYTES]


def check_proof(body: bytes, key: bytes, nonce: bytes, node_id: str, path: str) -> int:
    """The daemon's largest call frame, once its proof and node id check; else LocalCallClosed
    (``gone``: not the daemon that issued the key), or a passing refusal (``E``)."""
    if body[:1] == ERR:
        check_admitted(body, path)
    proof, rest = body[1 : 1 + PROOF_BYTES], body[1 + PROOF_BYTES :]
    if body[:1] != OK or len(rest) < _LIMIT.size or not hmac.compare_digest(proof, prove(key, nonce)):
        raise LocalCallClosed(f"{path} is not the local-call socket of the daemon that said hello", False, True)
    if rest[_LIMIT.size :].decode("utf-8", "replace") != node_id:
        raise LocalCallClosed(f"{path} answers for another node than {node_id}", sent=False, gone=True)
    (limit,) = _LIMIT.unpack_from(rest)
    return int(limit)


def check_admitted(body: bytes | None, path: str) -> None:
    """LocalCallClosed unless the daemon's answer to the token admits the connection."""
    if not body:
        raise LocalCallClosed(f"{path} closed before admitting the token", sent=False)
    if body[:1] != OK:
        reason = body[1:].decode("utf-8", "replace")
        raise LocalCallClosed(f"{path} refused this client: {reason}", False, refused=not reason.startswith("busy"))


def unpack_token(body: bytes) -> str:
    """The token frame's token, or ValueError."""
    if len(body) > MAX_TOKEN_BYTES:
        raise ValueError("token longer than a token may be")
    return body.decode("utf-8")


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

    def error(self) -> KVPoolError:
        """The typed error an aborted call answers with."""
        code = ErrorCode.from_wire_name(self._trailing.get(CODE_KEY, ""))  # unknown: INTERNAL
        return error_from_code(code, self._details, self._trailing.get(HINT_KEY, ""))
