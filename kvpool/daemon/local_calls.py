"""The node's side of same-host unary calls over a Unix socket (protocol and why:
``kvpool.rpc.local_call``).

One listening socket in the arena directory (0600 unless ``--arena-socket-mode``), named in
``HelloReply.local_socket``. Each accepted connection gets its own thread, which reads the
client's hello (token checked against the credentials: a connection without a known token is
refused and closed), then answers calls in order until the client closes. A call runs the
service's own typed handler (``kvpool.rpc.serving.typed_methods``) with a
``LocalCallContext``: the same request limits, authentication, namespace checks and tenant
gate as over gRPC. Only unary methods are served (the Events stream stays on gRPC).

Bounded: at most ``max_connections`` connections at once (a further one is answered "busy"
and closed: its client uses gRPC); the hello within ``HELLO_DEADLINE_S``; a frame larger than
the service's request limit, a malformed frame or an unknown method closes the connection,
logged at most once per interval. Calls are not queued behind one another across
connections; the tenant gate bounds one tenant's calls in flight as it does for gRPC.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

from kvpool.core.auth import Credentials
from kvpool.core.errors import InternalError, KVPoolError
from kvpool.core.supervisor import Supervisor
from kvpool.daemon.arena_handoff import ArenaHandoff, listen_unix
from kvpool.rpc.auth import Metadata, call_metadata
from kvpool.rpc.errors import RateLimitedLog
from kvpool.rpc.local_call import (
    CALL_FRAME_OVERHEAD,
    MAX_HELLO_BYTES,
    OK,
    CallAborted,
    LocalCallContext,
    pack_error,
    read_frame,
    send_frame,
    unpack_call,
    unpack_hello,
)
from kvpool.rpc.serving import TypedMethod

log = logging.getLogger("kvpool.local_calls")

#: connections served at once (each holds a thread while open)
MAX_LOCAL_CONNECTIONS = 128
#: a connection must say hello within this long
HELLO_DEADLINE_S = 2.0
REFUSAL_LOG_INTERVAL_S = 10.0

#: wraps a method's handler for the timing metrics: (method name, handler) -> handler
Timer = Callable[[str, Callable[..., Any]], Callable[..., Any]]


def local_socket_path(directory: str) -> str:
    """A fresh socket name in ``directory``: the daemon's pid (for ``reap_stale``) and 64
    random bits, so a client cannot mistake another daemon's socket for this one's."""
    return str(pathlib.Path(directory) / f"kvpool-{os.getpid()}-{uuid.uuid4().hex[:16]}.sock")


class LocalCallServer:
    def __init__(
        self,
        methods: dict[str, TypedMethod],
        path: str,
        credentials: Credentials | None,
        node_id: str,
        max_request_bytes: int,
        socket_mode: int = 0o600,
        timer: Timer | None = None,
        max_connections: int = MAX_LOCAL_CONNECTIONS,
    ) -> None:
        """``methods``: the service's typed methods (the unary ones are served); ``timer``:
        how each call is observed for ``/metrics`` (None: not timed)."""
        self._handlers = {
            name: (timer(name, m.handler) if timer is not None else m.handler)
            for name, m in methods.items()
            if not m.server_streaming
        }
        self._credentials = credentials
        self._node_id = node_id.encode()
        self._max_frame_bytes = max_request_bytes + CALL_FRAME_OVERHEAD
        self._socket_mode = socket_mode
        self._max_connections = max_connections
        self.path = path
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._refusals = RateLimitedLog(log, REFUSAL_LOG_INTERVAL_S)
        self.connections_served = 0
        self.refused = 0

    def start(self, supervisor: Supervisor) -> None:
        ArenaHandoff.reap_stale(str(pathlib.Path(self.path).parent))
        self._sock = listen_unix(self.path, self._socket_mode)
        supervisor.spawn("local-calls", self._accept_loop)

    def stop(self) -> None:
        """Stop accepting, end every connection (their threads see the peer close), remove the file."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _accept_loop(self) -> None:
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # stopped
            with self._lock:
                full = len(self._conns) >= self._max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                self._refuse(conn, f"busy: {self._max_connections} local connections are open (use gRPC)")
                conn.close()
                continue
            threading.Thread(target=self._connection, args=(conn,), name="kvpool-local", daemon=True).start()

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        self.refused += 1
        self._refusals.emit("refused", f"local calls: refused a client: {reason}")
        with contextlib.suppress(OSError):
            send_frame(conn, b"E", reason.encode())

    def _connection(self, conn: socket.socket) -> None:
        try:
            admitted, metadata = self._hello(conn)
            if admitted:
                self.connections_served += 1
                self._serve_calls(conn, metadata)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            self._refusals.emit("bad", f"local calls: dropped a client ({type(exc).__name__}: {exc})")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _hello(self, conn: socket.socket) -> tuple[bool, Metadata | None]:
        """(admitted, the call metadata of the connection's token)."""
        conn.settimeout(HELLO_DEADLINE_S)
        body = read_frame(conn, MAX_HELLO_BYTES)
        if body is None:
            return False, None
        token = unpack_hello(body)
        if self._credentials is not None and (not token or self._credentials.identify(token) is None):
            self._refuse(conn, "unauthenticated: no credential has this token")
            return False, None
        try:
            metadata = call_metadata(token)
        except KVPoolError as err:
            self._refuse(conn, err.message)
            return False, None
        conn.settimeout(None)  # an idle client keeps its connection; stop() ends it
        send_frame(conn, OK, self._node_id)
        return True, metadata

    def _serve_calls(self, conn: socket.socket, metadata: Metadata | None) -> None:
        while True:
            body = read_frame(conn, self._max_frame_bytes)
            if body is None:
                return
            method, raw = unpack_call(body)
            handler = self._handlers.get(method)
            if handler is None:
                raise ValueError(f"no unary method {method[:64]!r}")
            context = LocalCallContext(metadata)
            try:
                reply = handler(raw, context)
            except CallAborted:
                send_frame(conn, pack_error(context.error()))
                continue
            except Exception as exc:  # a handler outside typed_handler: answer, keep serving
                log.exception("local call %s failed", method)
                send_frame(conn, pack_error(InternalError(f"{type(exc).__name__}: {exc}", hint="see the daemon log")))
                continue
            send_frame(conn, OK, reply.SerializeToString())
