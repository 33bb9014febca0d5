"""The node's side of same-host unary calls over a Unix socket (protocol and why:
``kvpool.rpc.local_call``).

One listening socket in the arena directory (0600 unless ``--arena-socket-mode``), named in
``HelloReply.local_socket``. Each accepted connection gets its own thread, which proves the
daemon to the client (the key of the client's ``Hello``), takes its token (with credentials,
a connection without a known token is refused and closed), then answers calls in order until
the client closes. A call runs the service's own typed handler
(``kvpool.rpc.serving.typed_methods``) with a ``LocalCallContext``: the same request limits,
authentication, namespace checks and tenant gate as over gRPC. Only unary methods are
served (the Events stream stays on gRPC).

Bounded: at most ``max_connections`` connections at once, and with credentials at most
``MAX_TENANT_CONNECTIONS`` of one tenant (a further one is answered "busy" and closed: its
client uses gRPC for that call and asks again on a later one); the hello and the token within one
``HELLO_DEADLINE_S`` however slowly the bytes come; a frame larger than the service's request
limit, a malformed frame or an unknown method closes the connection, logged at most once per
interval. An accept that fails (no descriptors left) is logged and retried, never the end of
the loop. ``stop`` stops reading new calls, lets the calls in flight answer (up to a grace
period, as gRPC's server does), then returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from kvpool.core.auth import MAX_TOKEN_BYTES, Credentials
from kvpool.core.errors import InternalError, KVPoolError
from kvpool.core.supervisor import Supervisor
from kvpool.daemon.arena_handoff import listen_unix, reap_stale_sockets
from kvpool.rpc.auth import Metadata, call_metadata
from kvpool.rpc.errors import RateLimitedLog
from kvpool.rpc.local_call import (
    CALL_FRAME_OVERHEAD,
    HELLO_BYTES,
    OK,
    CallAborted,
    LocalCallContext,
    LocalCallKeys,
    frame,
    pack_error,
    pack_proof,
    read_frame,
    send_frame,
    unpack_call,
    unpack_hello,
    unpack_token,
)
from kvpool.rpc.serving import TypedMethod

log = logging.getLogger("kvpool.local_calls")

#: connections served at once (each holds a thread while open)
MAX_LOCAL_CONNECTIONS = 128
#: connections one tenant may hold (with credentials; a client opens at most 16)
MAX_TENANT_CONNECTIONS = 32
#: a connection must finish its hello and token within this long
HELLO_DEADLINE_S = 2.0
#: after a failed accept (e.g. no descriptors left), wait this long before the next
ACCEPT_RETRY_S = 0.1
REFUSAL_LOG_INTERVAL_S = 10.0

#: wraps a method's handler for the timing metrics: (method name, handler) -> handler
Timer = Callable[[str, Callable[..., Any]], Callable[..., Any]]


def local_socket_path(directory: str) -> str:
    """A fresh socket name in ``directory``: the daemon's pid (for ``reap_stale_sockets``) and 64
    random bits."""
    return str(pathlib.Path(directory) / f"kvpool-{os.getpid()}-{uuid.uuid4().hex[:16]}.sock")


class LocalCallServer:
    def __init__(
        self,
        methods: dict[str, TypedMethod],
        path: str,
        keys: LocalCallKeys,
        credentials: Credentials | None,
        node_id: str,
        max_request_bytes: int,
        socket_mode: int = 0o600,
        timer: Timer | None = None,
        max_connections: int = MAX_LOCAL_CONNECTIONS,
        max_tenant_connections: int = MAX_TENANT_CONNECTIONS,
    ) -> None:
        """``methods``: the service's typed methods (the unary ones are served); ``keys``:
        those the service hands out in ``Hello``; ``timer``: how each call is observed for
        ``/metrics`` (None: not timed)."""
        self._handlers = {
            name: (timer(name, m.handler) if timer is not None else m.handler)
            for name, m in methods.items()
            if not m.server_streaming
        }
        self.path = path
        self._keys = keys
        self._credentials = credentials
        self._node_id = node_id
        self._max_frame_bytes = max_request_bytes + CALL_FRAME_OVERHEAD
        self._socket_mode = socket_mode
        self._max_connections = max_connections
        self._sock: socket.socket | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closing: list[threading.Thread] = []  # the connections' threads when close() began
        self._per_tenant: dict[str, int] = {}  # admitted connections by tenant (credential name)
        self._max_tenant_connections = max_tenant_connections
        self._lock = threading.Lock()
        self._stopping = False
        self._refusals = RateLimitedLog(log, REFUSAL_LOG_INTERVAL_S)
        self.connections_served = 0
        self.refused = 0

    def start(self, supervisor: Supervisor) -> None:
        reap_stale_sockets(str(pathlib.Path(self.path).parent))
        self._sock = listen_unix(self.path, self._socket_mode)
        supervisor.spawn("local-calls", self._accept_loop)

    def close(self) -> None:
        """Stop accepting and reading new calls (a call in flight still answers), remove the
        socket file; ``join`` waits for those calls."""
        with self._lock:
            self._stopping = True
            sock, self._sock = self._sock, None
            conns = list(self._conns)
            # join waits for these even after they leave _conns: a thread that has popped
            # itself is still closing its connection
            self._closing = list(self._conns.values())
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for conn in conns:  # a thread waiting for a call sees the end; one in a call answers it first
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RD)
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the connections' threads (after ``close``)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = self._closing
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def stop(self, grace_s: float = 5.0) -> None:
        """``close``, then ``join`` for up to ``grace_s``."""
        self.close()
        self.join(grace_s)

    def summary(self) -> dict[str, int]:
        """The socket's counters for ``Stats`` and ``/metrics``."""
        with self._lock:
            return {
                "local_connections_open": len(self._conns),
                "local_connections_served": self.connections_served,
                "local_connections_refused": self.refused,
            }

    def _accept_loop(self) -> None:
        while True:
            sock = self._sock
            if sock is None:
                return
            try:
                conn, _ = sock.accept()
            except OSError as exc:
                if self._sock is None:
                    return  # stopped
                self._refusals.emit("accept", f"local calls: accept failed ({exc}); retrying")
                time.sleep(ACCEPT_RETRY_S)
                continue
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        thread = threading.Thread(target=self._connection, args=(conn,), name="kvpool-local", daemon=True)
        with self._lock:  # started under the lock: close() and join() never see an unstarted thread
            refused = (
                "the daemon is stopping"
                if self._stopping
                else f"busy: {self._max_connections} local connections are open"
                if len(self._conns) >= self._max_connections
                else ""
            )
            if not refused:
                try:
                    thread.start()
                    self._conns[conn] = thread
                    return
                except RuntimeError as exc:  # no thread to be had now
                    refused = f"busy: cannot start a thread ({exc})"
        self._refuse(conn, refused)
        conn.close()

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        with self._lock:
            self.refused += 1
        self._refusals.emit("refused", f"local calls: refused a client: {reason}")
        with contextlib.suppress(OSError):
            conn.setblocking(False)  # a refusal never waits on the client
            conn.send(frame(b"E", reason.encode()))

    def _connection(self, conn: socket.socket) -> None:
        tenant: str | None = None
        try:
            tenant, metadata = self._hello(conn)
            if tenant is not None:
                self._serve_calls(conn, metadata)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            self._refusals.emit("bad", f"local calls: dropped a client ({type(exc).__name__}: {exc})")
        finally:
            with self._lock:
                self._conns.pop(conn, None)
                if tenant is not None:
                    self._per_tenant[tenant] -= 1
                    if not self._per_tenant[tenant]:
                        del self._per_tenant[tenant]
            conn.close()

    def _hello(self, conn: socket.socket) -> tuple[str | None, Metadata | None]:
        """Prove the daemon, take the token: (the admitted connection's tenant, or None when
        refused; the token's call metadata). With credentials one tenant holds at most
        ``MAX_TENANT_CONNECTIONS`` connections, so no tenant can take the others' room."""
        deadline = time.monotonic() + HELLO_DEADLINE_S
        body = read_frame(conn, HELLO_BYTES, deadline)
        if body is None:
            return None, None
        key_id, nonce = unpack_hello(body)
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        send_frame(conn, pack_proof(self._keys.key_of(key_id), nonce, self._max_frame_bytes, self._node_id))
        body = read_frame(conn, MAX_TOKEN_BYTES, deadline)
        if body is None:
            return None, None
        token = unpack_token(body)
        tenant = ""  # without credentials every caller is the same anonymous one
        if self._credentials is not None:
            principal = self._credentials.identify(token) if token else None
            if principal is None:
                self._refuse(conn, "unauthenticated: no credential has this token")
                return None, None
            tenant = principal.name
        try:
            metadata = call_metadata(token)
        except KVPoolError as err:
            self._refuse(conn, err.message)
            return None, None
        with self._lock:
            held = self._per_tenant.get(tenant, 0)
            full = self._credentials is not None and held >= self._max_tenant_connections
            if not full:
                self._per_tenant[tenant] = held + 1
                self.connections_served += 1
        if full:
            self._refuse(conn, f"busy: this tenant has {held} local connections open")
            return None, None
        conn.settimeout(None)  # an idle client keeps its connection; stop() ends it
        send_frame(conn, OK)
        return tenant, metadata

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
