"""The node's side of the arena hand-off (protocol: ``kvpool.transport.arena_handoff``).

Why: an arena file under /dev/shm can be opened by every process of the daemon's uid,
token or not. A memfd has no name; its descriptor reaches a client only here, after the
client presented a token the credentials know (any caller on a node without credentials),
read-only unless the client names a put it holds. What this does not stop (a process of
the same uid can ptrace the daemon or a client, or open ``/proc/PID/fd/N``) is written
down in docs/security.md.

With a per-tenant arena (``kvpool.storage.arena_segments``) a client asks for one segment
at a time and gets it only while the segment's owner is one of its token's tenant groups
(``Credentials.arena_owners``): a lease or put names the offsets, and a client maps the
segments they lie in when it first needs them.

Bounded: one request line of at most 1 KiB per connection, a 2 s deadline per connection,
connections served one at a time by one supervised thread (a client that stalls delays
others by at most that deadline).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import socket
import uuid
from collections.abc import Callable

from kvpool.core.auth import ANONYMOUS, ArenaOwners, Credentials
from kvpool.core.errors import InvalidArgument, PermissionDenied
from kvpool.core.supervisor import Supervisor
from kvpool.core.unix_path import socket_address
from kvpool.rpc.errors import RateLimitedLog
from kvpool.storage.arena import SharedArena, _pid_alive
from kvpool.storage.arena_segments import SegmentedArena
from kvpool.transport.arena_handoff import MAX_REASON_BYTES, MAX_REQUEST_BYTES, pack_reply, unpack_request

log = logging.getLogger("kvpool.arena_handoff")

CONNECTION_DEADLINE_S = 2.0
REFUSAL_LOG_INTERVAL_S = 10.0


def listen_unix(path: str, mode: int, backlog: int = 64) -> socket.socket:
    """A listening Unix socket at ``path`` whose file is created 0600 (no moment in which
    another uid could connect), then given ``mode`` (``--arena-socket-mode``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        with socket_address(path) as address:
            sock.bind(address)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    if mode != 0o600:
        os.chmod(path, mode)
    sock.listen(backlog)
    return sock


def reap_stale_sockets(directory: str) -> None:
    """Remove the sockets (arena hand-off, local calls) of daemons that died without cleaning up."""
    for path in pathlib.Path(directory).glob("kvpool-*-*.sock"):
        parts = path.name.split("-")
        if len(parts) == 3 and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            with contextlib.suppress(OSError):
                path.unlink()


class ArenaHandoff:
    def __init__(
        self,
        arena: SharedArena,
        directory: str,
        credentials: Credentials | None,
        put_pending: Callable[[int], bool],
        socket_mode: int = 0o600,
    ) -> None:
        """``socket_mode``: the socket file's mode (``--arena-socket-mode``); 0o600 admits the
        daemon's uid only, a wider one lets clients of other uids connect (each still needs
        a token the credentials know)."""
        self._arena = arena
        self._socket_mode = socket_mode
        self._credentials = credentials
        self._put_pending = put_pending
        self.path = str(pathlib.Path(directory) / f"kvpool-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock")
        self._segmented = isinstance(arena, SegmentedArena)
        self._ro_fd = -1 if self._segmented else arena.read_only_fd()
        self._owners = ArenaOwners({}) if credentials is None else credentials.arena_owners()
        self._sock: socket.socket | None = None
        self._refusals = RateLimitedLog(log, REFUSAL_LOG_INTERVAL_S)
        self.handed_ro = 0
        self.handed_rw = 0
        self.refused = 0

    def start(self, supervisor: Supervisor) -> None:
        reap_stale_sockets(str(pathlib.Path(self.path).parent))
        self._sock = listen_unix(self.path, self._socket_mode)
        supervisor.spawn("arena-handoff", self._accept_loop)

    def stop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            self._sock = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        if self._ro_fd >= 0:
            os.close(self._ro_fd)
            self._ro_fd = -1

    def _accept_loop(self) -> None:
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # stopped
            with conn:
                try:
                    conn.settimeout(CONNECTION_DEADLINE_S)
                    self._serve(conn)
                except (OSError, InvalidArgument, ValueError) as exc:
                    self.refused += 1
                    self._refusals.emit("bad", f"arena hand-off: dropped a client ({type(exc).__name__}: {exc})")

    def _read_line(self, conn: socket.socket) -> bytes:
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(MAX_REQUEST_BYTES - len(data))
            if not chunk:
                raise InvalidArgument("client closed before a full request")
            data += chunk
            if len(data) >= MAX_REQUEST_BYTES and not data.endswith(b"\n"):
                raise InvalidArgument(f"request longer than {MAX_REQUEST_BYTES} bytes")
        return data

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        self.refused += 1
        self._refusals.emit("refused", f"arena hand-off: refused a client: {reason}")
        conn.sendall(b"E" + reason.encode()[:MAX_REASON_BYTES])

    def _serve(self, conn: socket.socket) -> None:
        mode, put_id, segment, token = unpack_request(self._read_line(conn))
        principal = ANONYMOUS if self._credentials is None else self._credentials.identify(token)
        if principal is None:
            self._refuse(conn, "unauthenticated: no credential has this token")
            return
        if mode == "w" and not self._put_pending(put_id):
            self._refuse(conn, f"put {put_id} is not in flight: a writable arena is handed only to a put's holder")
            return
        if self._segmented:
            assert isinstance(self._arena, SegmentedArena)
            try:
                fd, generation = self._arena.segment_fd(segment, mode == "w", self._owners.owners_of(principal))
            except (PermissionDenied, InvalidArgument) as err:
                self._refuse(conn, err.message)
                return
            try:
                socket.send_fds(conn, [pack_reply(generation)], [fd])
            finally:
                os.close(fd)  # a descriptor per request: the client has its own now
        elif segment != 0:
            self._refuse(conn, f"segment {segment}: this arena is one piece (segment 0)")
            return
        else:
            socket.send_fds(conn, [pack_reply(0)], [self._arena.fd if mode == "w" else self._ro_fd])
        if mode == "w":
            self.handed_rw += 1
        else:
            self.handed_ro += 1
