"""The plain TCP-socket data plane: the fallback when ucxx is not installed, and the
transport between hosts without UCX.

Server: one accept thread and one thread per connection (bounded); a READ leases the
leading present keys in the node's store, sends one header with every (length, checksum)
and then the bytes straight out of the mapped arena (``sendall`` of a memoryview, no
copy in Python), and releases the lease. Client: a small pool of persistent connections
per peer; bytes are received straight into the caller's buffer (``recv_into``) and each
item is checksummed right after it lands, while the kernel keeps receiving the next
(pipelined). A pooled connection found dead before the reply (the peer restarted) is
retried once on a fresh one; any other failure is a miss logged with the peer's address.

Streams: a large read is cut into up to ``streams`` parts of about equal bytes, each read
on a connection of its own at the same time (the first by the calling thread, the rest by
the transport's small thread pool), each part verified by the thread that received it.
One stream is bound by one core: on the one-sided data planes (UCX, NIXL over cma) the
reader's kernel walks and copies the holder's pages, ~2-4 GB/s per thread here, and two
streams read a 128 MiB batch 1.4-1.7x faster (docs/benchmarks.md); on RDMA the same parts
go out on separate queue pairs. Those default to one stream per core (``one_sided``); plain
TCP defaults to one stream, as each stream also keeps a sending thread of the node busy (on
loopback here two streams read 32 x 1 MiB 0.7x as fast as one). The result is still "the
leading rows that verified".
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext

import numpy as np

from kvpool.core.auth import ANONYMOUS, Credentials, Principal
from kvpool.core.checksum import checksum64
from kvpool.core.errors import (
    CapacityExhausted,
    InvalidArgument,
    KVPoolError,
    NotFound,
    TenantBusy,
    Unauthenticated,
    Unavailable,
    UnknownNamespace,
)
from kvpool.core.retry import RetryPolicy, retry_call
from kvpool.core.tickets import MAX_TICKET_ID_BYTES, NONCE_BYTES, PROOF_BYTES, ticket_proof
from kvpool.transport import wire
from kvpool.transport.base import BlockStore, ReadItem, ReadResult, TicketSource, WriteResult
from kvpool.transport.shares import TransferShares
from kvpool.transport.tls import client_tls_context

log = logging.getLogger("kvpool.transport")

SOCKET_BUFFER_BYTES = 4 << 20
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_TIMEOUT_S = 10.0
MAX_IDLE_PER_PEER = 8
#: how long ``TcpDataServer.stop`` waits for its connection workers (a UCX one may be in a
#: transfer with its own deadline)
STOP_JOIN_S = 10.0
#: a pooled connection found dead before the reply header: once more, on a fresh one
DEAD_POOLED_CONNECTION = RetryPolicy(first_delay_ms=0, max_delay_ms=0, max_attempts=2)
#: a read is spread over parallel connections only in parts of at least this many bytes
#: (below it, a second connection's request and thread hand-off cost more than they save)
STREAM_MIN_BYTES = 4 << 20
#: the most parts one read is cut into (``TcpTransport(streams=)``; the default is the
#: host's core count up to this: each stream keeps one core busy)
MAX_STREAMS = 8


def default_streams(one_sided: bool) -> int:
    """Streams per read where none is asked for: one per core, at most 4, for a one-sided data
    plane (the reader does the copying); one for a two-sided one (module docstring)."""
    return max(1, min(4, os.cpu_count() or 1)) if one_sided else 1


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgument(f"data address {address!r} is not HOST:PORT", hint="e.g. 127.0.0.1:7460")
    return host, int(port)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCKET_BUFFER_BYTES:  # 0 = leave the kernel's autotuning on
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


class ProtocolViolation(InvalidArgument):
    """A peer sent something the protocol does not allow (more items than asked, a length
    that is not the destination's, counts beyond the batch): the connection is dropped and
    the request is a miss."""


class TcpDataServer:
    """Serves a node's blocks to peers over TCP. ``address`` is known after ``start``."""

    transport_metadata = b""  # what readers need beyond ``address`` (a NIXL agent's metadata); published

    def __init__(
        self,
        store: BlockStore,
        listen: str,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout_s: float = 300.0,
        credentials: Credentials | None = None,
    ) -> None:
        """``credentials``: admit a connection's requests only after it passed AUTH with a
        token the control plane knows, and only for namespaces that credential may use
        (None: every peer is admitted, the loopback default)."""
        self._store = store
        self._credentials = credentials
        self._listen = listen
        self._max_connections = max_connections
        self._idle_timeout_s = idle_timeout_s
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._accept_thread: threading.Thread | None = None
        # one worker thread per open connection (at most max_connections: the accept loop
        # refuses past that); ``stop`` joins them before it returns, so none touches the store
        # (the arena) after its owner closes it
        self._workers: set[threading.Thread] = set()
        self.address = listen
        self.bytes_sent = 0
        self.bytes_received = 0
        #: TLS for every accepted connection (``server_tls_context``); None = plaintext. Set before ``start``.
        self.tls_context: ssl.SSLContext | None = None
        #: per-tenant shares of READ / WRITE transfers (``shares.py``); None = ungated. Set before ``start``.
        self.shares: TransferShares | None = None

    def start(self) -> None:
        host, port = split_address(self._listen)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise Unavailable(
                f"data plane cannot listen on {self._listen}: {exc}",
                hint="pick a free port with --data-listen 127.0.0.1:PORT",
            ) from exc
        sock.listen(128)
        self._sock = sock
        self.address = f"{host}:{sock.getsockname()[1]}"
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kvpool-data-accept", daemon=True)
        self._accept_thread.start()

    def stop(self) -> None:
        """Stop accepting, shut every connection down and join the workers serving them."""
        self._stopping.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        if self._accept_thread is not None:
            self._accept_thread.join(2.0)  # no connection is added after this
        with self._lock:
            for conn in list(self._conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        # each worker's recv returns on its shut-down socket and it closes it
        deadline = time.monotonic() + STOP_JOIN_S
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        late = [w for w in workers if w.is_alive()]
        if late:
            log.warning("data plane: %d connection workers still busy %.0f s after stop", len(late), STOP_JOIN_S)

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            with self._lock:
                if len(self._conns) >= self._max_connections:
                    log.warning("data plane: refusing %s, %d connections open", peer, len(self._conns))
                    conn.close()
                    continue
                self._conns.add(conn)
            _tune(conn)
            conn.settimeout(self._idle_timeout_s)
            worker = threading.Thread(
                target=self._serve, args=(conn, f"{peer[0]}:{peer[1]}"), daemon=True, name="kvpool-data-conn"
            )
            with self._lock:
                self._workers.add(worker)
            worker.start()

    def _wrap_tls(self, conn: socket.socket) -> socket.socket:
        """The TLS side of an accepted connection (handshake bounded by the idle timeout); the
        wrapped socket replaces the plain one in ``_conns`` (wrapping detaches the plain one)."""
        assert self.tls_context is not None
        with self._lock:
            self._conns.discard(conn)
        wrapped = self.tls_context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        with self._lock:
            self._conns.add(wrapped)
        try:
            wrapped.do_handshake()
        except BaseException:
            with self._lock:
                self._conns.discard(wrapped)
            wrapped.close()
            raise
        return wrapped

    def _serve(self, conn: socket.socket, peer: str) -> None:
        state: dict[str, object] = {}  # per-connection state of subclasses (the UCX endpoint)
        principal: Principal | None = ANONYMOUS if self._credentials is None else None
        nonce = b""
        try:
            if self.tls_context is not None:
                conn = self._wrap_tls(conn)
            while not self._stopping.is_set():
                try:
                    head = wire.recv_exact(conn, wire.HEADER.size)
                except (wire.PeerClosed, TimeoutError, OSError):
                    return
                op, count, namespace = wire.unpack_header(head)
                if op == wire.OP_AUTH:
                    if count == 0:
                        nonce = os.urandom(NONCE_BYTES)
                        conn.sendall(wire.pack_reply(wire.STATUS_OK, len(nonce)) + nonce)
                        continue
                    principal = self._check_proof(conn, count, nonce, peer)
                    nonce = b""  # one proof per nonce
                    if principal is None:
                        return
                    continue
                if op != wire.OP_PING and not self._admitted(conn, principal, op, namespace, peer):
                    return
                if op in (wire.OP_READ, wire.OP_WRITE):
                    assert principal is not None  # _admitted
                    if not self._serve_transfer(conn, principal, op, count, namespace, peer):
                        return
                elif op == wire.OP_PING:
                    conn.sendall(wire.pack_reply(wire.STATUS_OK, 0))
                elif not self._serve_other(conn, op, count, namespace, state):
                    conn.sendall(wire.pack_reply(wire.STATUS_BAD_REQUEST, 0, f"unknown op {op}"))
                    return
        except (OSError, wire.PeerClosed, InvalidArgument) as exc:  # ssl.SSLError is an OSError
            log.warning("data plane: connection from %s dropped: %s", peer, exc)
        except Exception:  # a bug: log it, drop this connection, keep serving others
            log.exception("data plane: internal error serving %s", peer)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._workers.discard(threading.current_thread())
            conn.close()
            self._close_state(state)

    def _check_proof(self, conn: socket.socket, count: int, nonce: bytes, peer: str) -> Principal | None:
        """Read an AUTH proof (a ticket id and its proof for ``nonce``) and answer it: the
        principal, or None (answered, to be closed)."""
        if not PROOF_BYTES < count <= PROOF_BYTES + MAX_TICKET_ID_BYTES or not nonce:
            conn.sendall(
                wire.pack_reply(
                    wire.STATUS_BAD_REQUEST, 0, "AUTH proof without a nonce or a data-plane ticket (kvpool >= tickets)"
                )
            )
            return None
        body = wire.recv_exact(conn, count)
        if self._credentials is None:
            conn.sendall(wire.pack_reply(wire.STATUS_OK, 0))
            return ANONYMOUS
        ticket_id, proof = body[:-PROOF_BYTES], body[-PROOF_BYTES:]
        principal = self._credentials.identify_ticket(ticket_id, nonce, proof, int(time.monotonic() * 1000))
        if principal is None:
            log.warning("data plane: %s failed AUTH", peer)
            conn.sendall(
                wire.pack_reply(
                    wire.STATUS_UNAUTHENTICATED, 0, "no live ticket of this node made this proof: Hello again for one"
                )
            )
            return None
        conn.sendall(wire.pack_reply(wire.STATUS_OK, 0))
        return principal

    def _admitted(self, conn: socket.socket, principal: Principal | None, op: int, namespace: bytes, peer: str) -> bool:
        """Whether this request may run; if not it is answered and the connection is to be
        closed (the request's body was not read, so the stream is out of sync anyway)."""
        if principal is None:
            conn.sendall(
                wire.pack_reply(wire.STATUS_UNAUTHENTICATED, 0, "this node requires AUTH with a kvpool credential")
            )
            return False
        if op in (wire.OP_READ, wire.OP_WRITE, wire.OP_READ_UCX, wire.OP_NIXL_READ) and not principal.may_use(
            namespace
        ):
            log.warning("data plane: %s (%s) may not use namespace %s", peer, principal.name, namespace.hex())
            conn.sendall(wire.pack_reply(wire.STATUS_DENIED, 0, f"credential {principal.name!r} may not use it"))
            return False
        return True

    def _serve_transfer(
        self, conn: socket.socket, principal: Principal, op: int, count: int, namespace: bytes, peer: str
    ) -> bool:
        """A READ or WRITE within its tenant's share (BUSY past it); False = close the connection."""
        name = "READ" if op == wire.OP_READ else "WRITE"
        share: AbstractContextManager[None] = nullcontext()
        if self.shares is not None:
            share = self.shares.admit(self._store, principal, self._credentials is not None, namespace, count, name)
        try:
            with share:
                if op == wire.OP_READ:
                    self._serve_read(conn, count, namespace)
                    return True
                return self._serve_write(conn, count, namespace, peer)
        except TenantBusy as busy:  # raised entering the share: nothing of the request was read yet
            assert self.shares is not None
            return self.shares.refuse(conn, self._store, op, count, namespace, busy.message)

    def _serve_other(
        self, conn: socket.socket, op: int, count: int, namespace: bytes, state: dict[str, object]
    ) -> bool:
        """Ops beyond READ / WRITE / PING (subclasses); False = unknown op."""
        return False

    def _close_state(self, state: dict[str, object]) -> None:
        """Release a connection's subclass state."""

    def _lease_for_read(
        self, conn: socket.socket, count: int, namespace: bytes
    ) -> tuple[int, list[memoryview], list[bytes]] | None:
        """Parse a READ request and lease its blocks: (lease id, views, metas); None if refused."""
        items = wire.unpack_read_items(wire.recv_exact(conn, count * wire.READ_ITEM.size), count)
        try:
            block_bytes = self._store.block_bytes(namespace)
        except UnknownNamespace as err:
            conn.sendall(wire.pack_reply(wire.STATUS_UNKNOWN_NAMESPACE, 0, err.message))
            return None
        for _, off, length in items:
            if off + length > block_bytes or off >= block_bytes:
                conn.sendall(
                    wire.pack_reply(
                        wire.STATUS_BAD_REQUEST,
                        0,
                        f"range [{off}, {off + length}) is outside a {block_bytes}-byte block",
                    )
                )
                return None
        try:
            grant = self._store.lease(namespace, [key for key, _, _ in items])
        except KVPoolError as err:
            # every byte of the request was read: answer (the reader logs why and keeps the
            # connection) instead of dropping it, which a reader could only call "peer closed"
            status = wire.STATUS_FULL if isinstance(err, CapacityExhausted) else wire.STATUS_ERROR
            conn.sendall(wire.pack_reply(status, 0, f"cannot lease the blocks: {err}"))
            return None
        try:
            arena = self._store.arena()
            metas: list[bytes] = []
            views: list[memoryview] = []
            verified: set[int] = set()  # arena offsets of blocks checked whole (several ranges of one block)
            rotten: list[bytes] = []  # found bad here: dropped (re-verified by the store) after the loop
            for i, ((key, off, length), (offset, size, checksum)) in enumerate(zip(items, grant.locations)):
                if length == 0:
                    length = size - off
                chunk = arena[offset + off : offset + off + length]
                whole = off == 0 and length == size
                if not whole and offset not in verified:
                    # the reader cannot check a range against the committed checksum: we check
                    # the whole block here, and a block that rotted after commit is a miss
                    if checksum64(arena[offset : offset + size]) != checksum:
                        log.warning(
                            "data plane: block %s (item %d) no longer matches its committed checksum: "
                            "serving %d of %d items, the rest are misses; the block is dropped",
                            key.hex(),
                            i,
                            i,
                            len(items),
                        )
                        rotten.append(key)
                        break
                    verified.add(offset)
                metas.append(wire.READ_META.pack(length, checksum if whole else checksum64(chunk)))
                views.append(memoryview(chunk))  # type: ignore[arg-type]
        except BaseException:
            if grant.lease_id:
                self._store.release(grant.lease_id)
            raise
        if rotten:
            # the store hides a leased block at once and frees its slot at the last release,
            # so the views of the good blocks before it stay valid
            try:
                self._store.drop_corrupt(namespace, rotten)
            except KVPoolError as err:  # e.g. the namespace was retired meanwhile: still serve the rest
                log.warning("data plane: could not drop rotten block %s: %s", rotten[0].hex(), err)
        return grant.lease_id, views, metas

    def _serve_read(self, conn: socket.socket, count: int, namespace: bytes) -> None:
        leased = self._lease_for_read(conn, count, namespace)
        if leased is None:
            return
        lease_id, views, metas = leased
        try:
            conn.sendall(wire.pack_reply(wire.STATUS_OK, len(views)) + b"".join(metas))
            for view in views:
                conn.sendall(view)
                self.bytes_sent += len(view)
        finally:
            if lease_id:
                self._store.release(lease_id)

    def _serve_write(self, conn: socket.socket, count: int, namespace: bytes, peer: str) -> bool:
        """Returns False when the connection must be closed (stream no longer in sync)."""
        (block_bytes,) = wire.U64.unpack(wire.recv_exact(conn, wire.U64.size))
        raw = wire.recv_exact(conn, count * wire.WRITE_ITEM.size)
        items = [wire.WRITE_ITEM.unpack_from(raw, i * wire.WRITE_ITEM.size) for i in range(count)]
        try:
            expected = self._store.block_bytes(namespace)
            if expected != block_bytes:
                raise InvalidArgument(f"{block_bytes}-byte blocks sent; the namespace holds {expected}-byte blocks")
            slots = self._store.put_start(namespace, [key for key, _ in items])
        except UnknownNamespace as err:
            conn.sendall(wire.pack_reply(wire.STATUS_UNKNOWN_NAMESPACE, 0, err.message))
            return False
        except CapacityExhausted as err:
            conn.sendall(wire.pack_reply(wire.STATUS_FULL, 0, str(err)))
            return False
        except KVPoolError as err:
            conn.sendall(wire.pack_reply(wire.STATUS_BAD_REQUEST, 0, str(err)))
            return False
        slot_of = {index: j for j, (index, _) in enumerate(slots.slots)}
        buffer = np.empty(block_bytes, dtype=np.uint8)  # one block: the only private memory a writer gets
        reclaimed = False
        try:
            for i in range(count):
                wire.recv_into_exact(conn, memoryview(buffer))  # type: ignore[arg-type]
                slot = slot_of.get(i)
                if slot is not None and not reclaimed:
                    # copied under the store lock, only while the put still holds the slot
                    reclaimed = not self._store.write_slot(slots.put_id, slot, buffer)
                self.bytes_received += block_bytes
        except BaseException:
            if slots.put_id:
                self._store.put_abort(slots.put_id)
            raise
        committed, failed = (0, 0)
        if slots.put_id:
            try:
                if reclaimed:
                    raise NotFound(f"put {slots.put_id} was reclaimed (put_ttl_ms) while its blocks arrived")
                committed, failed = self._store.put_commit(slots.put_id, [items[i][1] for i, _ in slots.slots])
            except NotFound as err:
                self._store.put_abort(slots.put_id)
                log.warning("data plane: write from %s was too slow, nothing stored: %s", peer, err)
                conn.sendall(wire.pack_reply(wire.STATUS_ERROR, 0, f"{err}: write the blocks again"))
                return True  # every byte of the request was read: the stream is still in sync
            if failed:
                log.warning("data plane: %d blocks written by %s failed their checksum and were dropped", failed, peer)
        conn.sendall(
            wire.pack_reply(wire.STATUS_OK, 0)
            + wire.WRITE_COUNTS.pack(committed, slots.already_present, slots.in_flight, failed)
        )
        return True


def stream_parts(row_bytes: Sequence[int], streams: int, min_bytes: int = STREAM_MIN_BYTES) -> list[tuple[int, int]]:
    """Cut rows into at most ``streams`` runs ``(start, end)`` of about equal bytes, as many as
    give each ``min_bytes`` on average (one run, ``[(0, n)]``, for a small read or ``streams`` 1)."""
    total = sum(row_bytes)
    count = max(1, min(streams, len(row_bytes), total // max(1, min_bytes)))
    if count == 1:
        return [(0, len(row_bytes))]
    parts: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, nbytes in enumerate(row_bytes):
        acc += nbytes
        # close a part once its share of the bytes is in, leaving a row for each part still to come
        if (
            len(parts) < count - 1
            and acc * count >= total * (len(parts) + 1)
            and len(row_bytes) - i - 1 >= count - len(parts) - 1
        ):
            parts.append((start, i + 1))
            start = i + 1
    parts.append((start, len(row_bytes)))
    return parts


class TcpTransport:
    """Client side of the TCP data plane; thread-safe, connections pooled per peer."""

    name = "tcp"
    #: whether the reader alone moves the bytes (UCX's get rendezvous, NIXL's READ): more
    #: streams by default (``default_streams``)
    one_sided = False

    def __init__(
        self, timeout_s: float = DEFAULT_TIMEOUT_S, streams: int = 0, stream_min_bytes: int = STREAM_MIN_BYTES
    ) -> None:
        """A node with credentials admits a connection with a ticket its control plane issued
        (``use_tickets``): the token itself never travels on the data plane. ``streams``:
        the most connections one read is spread over (module docstring; 0 = the data plane's
        default, ``default_streams``; 1 = every read on one connection), each part at least
        ``stream_min_bytes``."""
        if not 0 <= streams <= MAX_STREAMS:
            raise InvalidArgument(f"streams must be 0 (the default) to {MAX_STREAMS}, not {streams}")
        self.timeout_s = timeout_s
        self.streams = streams or default_streams(self.one_sided)
        self.stream_min_bytes = stream_min_bytes
        self._stream_pool: ThreadPoolExecutor | None = None  # made at the first read that needs it
        self._tickets: TicketSource | None = None
        self._tls: ssl.SSLContext | None = None
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self.bytes_received = 0

    def use_tickets(self, tickets: TicketSource | None) -> None:
        """Prove a ticket from ``tickets`` on each new connection (AUTH); None = no AUTH."""
        self._tickets = tickets

    def use_tls(self, root_certs: bytes | None) -> None:
        """Wrap each new connection in TLS, verifying nodes against ``root_certs`` (PEM); None = plaintext."""
        self._tls = client_tls_context(root_certs) if root_certs else None

    def _take(self, peer: str, deadline: float | None = None, fresh: bool = False) -> tuple[socket.socket, bool]:
        """A connection to ``peer`` and whether it came from the idle pool (``fresh``: never)."""
        if not fresh:
            with self._lock:
                pool = self._idle.get(peer)
                if pool:
                    return pool.pop(), True
        left = wire.time_left(deadline)
        host, port = split_address(peer)
        sock = socket.create_connection((host, port), timeout=self.timeout_s if left is None else left)
        _tune(sock)
        if self._tls is not None:
            try:
                sock = self._tls.wrap_socket(sock, server_hostname=host)
            except BaseException:
                sock.close()
                raise
        if self._tickets is not None:
            try:
                self._authenticate(sock, peer, deadline)
            except BaseException:
                sock.close()
                raise
        return sock, False

    def _authenticate(self, sock: socket.socket, peer: str, deadline: float | None) -> None:
        """The AUTH exchange on a fresh connection, with this client's ticket for ``peer``;
        Unauthenticated if the node refuses (the ticket is forgotten: the next connection gets a new one)."""
        assert self._tickets is not None
        ticket = self._tickets.ticket(peer)
        wire.send_all(sock, wire.pack_header(wire.OP_AUTH, 0, bytes(16)), deadline)
        status, count, message = wire.recv_reply(sock, deadline)
        if status != wire.STATUS_OK or count != NONCE_BYTES:
            raise Unauthenticated(f"data plane at {peer} gave no AUTH nonce ({message or status})")
        nonce = wire.recv_exact(sock, count, deadline)
        body = ticket.ticket_id + ticket_proof(ticket.key, nonce)
        wire.send_all(sock, wire.pack_header(wire.OP_AUTH, len(body), bytes(16)) + body, deadline)
        status, _, message = wire.recv_reply(sock, deadline)
        if status != wire.STATUS_OK:
            self._tickets.forget(peer)
            raise Unauthenticated(
                f"data plane at {peer} refused this client's ticket ({message})",
                hint="the node restarted or the ticket expired: the next connection asks its control plane again",
            )

    def _exchange(
        self, peer: str, deadline: float, send: Callable[[socket.socket], None]
    ) -> tuple[socket.socket, int, int, str]:
        """Send a request and read its reply header: (socket, status, count, message).

        A pooled connection may be dead without our knowing (the peer restarted, or closed it
        idle): a connection error on one taken from the pool, before the reply header has
        arrived, is retried once on a fresh connection. Nothing has been received into the
        caller's buffers at that point, and writes are content-addressed (a block stored
        twice is "already present"), so the retry cannot double anything. A timeout is not
        retried: a slow live peer must not get the request twice. The pool's other idle
        connections to that peer are dropped too (a restarted peer killed them all)."""
        fresh = pooled = False

        def once() -> tuple[socket.socket, int, int, str]:
            nonlocal pooled
            sock, pooled = self._take(peer, deadline, fresh=fresh)
            try:
                send(sock)
                return (sock, *wire.recv_reply(sock, deadline))
            except BaseException:
                self._discard(sock)
                raise

        def dead_pooled(exc: BaseException) -> bool:
            return pooled and isinstance(exc, OSError) and not isinstance(exc, TimeoutError)

        def drop_dead(exc: BaseException) -> None:
            nonlocal fresh
            log.info("data plane: pooled connection to %s was dead (%s): retrying on a fresh one", peer, exc)
            self.drop_peer(peer)
            fresh = True

        return retry_call(once, DEAD_POOLED_CONNECTION, dead_pooled, drop_dead)

    def _give(self, peer: str, sock: socket.socket) -> None:
        with self._lock:
            pool = self._idle.setdefault(peer, [])
            if len(pool) < MAX_IDLE_PER_PEER:
                pool.append(sock)
                return
        self._discard(sock)

    def drop_peer(self, peer: str) -> None:
        with self._lock:
            pool = self._idle.pop(peer, [])
        for sock in pool:
            self._discard(sock)

    def read(self, peer: str, namespace: bytes, items: Sequence[ReadItem], dst: Sequence[np.ndarray]) -> ReadResult:
        if len(items) != len(dst):
            raise InvalidArgument(f"{len(items)} read items for {len(dst)} destinations")
        deadline = time.monotonic() + self.timeout_s  # timeout_s bounds the whole read
        parts = stream_parts([row.nbytes for row in dst], self.streams, self.stream_min_bytes)
        futures: list[Future[ReadResult]] = []
        if len(parts) > 1:
            pool = self._streams_pool()
            futures = [
                pool.submit(self._read_part, peer, namespace, items[a:b], dst[a:b], deadline) for a, b in parts[1:]
            ]
        a, b = parts[0]
        results = [self._read_part(peer, namespace, items[a:b], dst[a:b], deadline)]
        for future in futures:
            try:
                results.append(future.result())
            except Exception as exc:  # _read_part catches what a peer does: this is a bug of ours
                log.exception("stream of a read from %s failed unexpectedly", peer)
                results.append(ReadResult(0, f"transfer from {peer} failed: {exc!r}"))
        done = 0
        for (a, b), result in zip(parts, results, strict=True):
            done += result.ok
            if result.ok < b - a:  # what later parts read is not "leading": a miss like the rest
                corrupt = a + result.corrupt_index if result.corrupt_index >= 0 else -1
                return ReadResult(done, result.reason, corrupt)
        return ReadResult(done)

    def _streams_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._stream_pool is None:  # two threads per extra stream: reads of several callers at once
                self._stream_pool = ThreadPoolExecutor(
                    2 * (self.streams - 1), thread_name_prefix=f"kvpool-{self.name}-stream"
                )
            return self._stream_pool

    def _read_part(
        self, peer: str, namespace: bytes, items: Sequence[ReadItem], dst: Sequence[np.ndarray], deadline: float
    ) -> ReadResult:
        """One stream: the part's requests one after another on one connection at a time."""
        done = 0
        try:
            for start, end in self._windows(peer, dst):
                chunk = items[start:end]
                result = self._read_chunk(peer, namespace, chunk, dst[start:end], deadline)
                done += result.ok
                if result.ok < len(chunk):
                    corrupt = start + result.corrupt_index if result.corrupt_index >= 0 else -1
                    return ReadResult(done, result.reason, corrupt)
        except Exception as exc:  # the outermost boundary: whatever a peer does is a miss
            log.exception("read from %s failed unexpectedly after %d blocks: the rest are misses", peer, done)
            return ReadResult(done, f"transfer from {peer} failed: {exc!r}")
        return ReadResult(done)

    read_op = wire.OP_READ

    def learn_peer(self, peer: str, metadata: bytes) -> None:
        """What the directory published for ``peer`` beyond its address (``NodeInfo.transport_metadata``);
        the TCP and UCX data planes need nothing more."""

    def _windows(self, peer: str, dst: Sequence[np.ndarray]) -> list[tuple[int, int]]:
        """How one read is cut into requests: (start, end) item ranges, each within ``MAX_ITEMS``."""
        return [(start, min(start + wire.MAX_ITEMS, len(dst))) for start in range(0, len(dst), wire.MAX_ITEMS)]

    def _read_op(self, peer: str) -> int:
        return self.read_op

    def _read_chunk(
        self,
        peer: str,
        namespace: bytes,
        items: Sequence[ReadItem],
        dst: Sequence[np.ndarray],
        deadline: float,
    ) -> ReadResult:
        sock: socket.socket | None = None
        progress = [0]  # leading items verified so far (kept up to date for the failure path)
        try:
            request = wire.pack_header(self._read_op(peer), len(items), namespace) + wire.pack_read_items(
                [(it.key, it.range_offset, it.range_length) for it in items]
            )
            sock, status, served, message = self._exchange(
                peer, deadline, lambda s: wire.send_all(s, request, deadline)
            )
            if status != wire.STATUS_OK:
                self._give(peer, sock)  # a refusal is a whole reply: the stream is still in sync
                sock = None
                log.warning("read from %s refused (status %d): %s", peer, status, message)
                return ReadResult(0, f"peer {peer} refused the read: {message}")
            if served > len(items):
                raise ProtocolViolation(f"peer {peer} answers {served} items to a read of {len(items)}")
            metas_raw = wire.recv_exact(sock, served * wire.READ_META.size, deadline)
            metas = [wire.READ_META.unpack_from(metas_raw, i * wire.READ_META.size) for i in range(served)]
            for i, (length, _) in enumerate(metas):
                if dst[i].nbytes != length:
                    raise ProtocolViolation(f"peer {peer} sends {length} bytes for item {i}; expected {dst[i].nbytes}")
            bad = self._receive(sock, peer, metas, dst, progress, deadline)
            self._give(peer, sock)
            sock = None
            ok = progress[0]
            if bad >= 0:
                log.warning("block %d from %s failed its checksum: treated as a miss", bad, peer)
                return ReadResult(ok, f"block {bad} from {peer} failed its checksum", corrupt_index=bad)
            if served < len(items):
                return ReadResult(ok, f"peer {peer} holds only {served} of {len(items)} blocks")
            return ReadResult(ok)
        except Exception as exc:  # a dead, slow or misbehaving peer (or a UCX error): a miss
            why = str(exc) or type(exc).__name__
            expected = isinstance(exc, (OSError, InvalidArgument))  # PeerClosed, TimeoutError are OSErrors
            log.log(
                logging.WARNING if expected else logging.ERROR,
                "read from %s failed after %d verified blocks (%s): the rest are misses",
                peer,
                progress[0],
                why,
                exc_info=not expected,
            )
            return ReadResult(progress[0], f"transfer from {peer} failed: {why}")
        finally:
            if sock is not None:
                self._discard(sock)

    def _receive(
        self,
        sock: socket.socket,
        peer: str,
        metas: list[tuple[int, int]],
        dst: Sequence[np.ndarray],
        progress: list[int],
        deadline: float,
    ) -> int:
        """Receive each item into its destination and verify it; returns the first bad index or -1."""
        bad = -1
        for i, (length, checksum) in enumerate(metas):
            target = dst[i]
            wire.recv_into_exact(sock, memoryview(target).cast("B"), deadline)  # type: ignore[arg-type]
            if bad < 0:
                if checksum64(target) != checksum:
                    bad = i
                else:
                    progress[0] = i + 1
            self.bytes_received += length
        return bad

    def _discard(self, sock: socket.socket) -> None:
        """Close a connection that is not returned to the pool."""
        sock.close()

    def write(self, peer: str, namespace: bytes, keys: Sequence[bytes], rows: np.ndarray) -> WriteResult:
        if rows.ndim != 2 or rows.dtype != np.uint8 or rows.shape[0] != len(keys):
            raise InvalidArgument("rows must be a [n, block_bytes] uint8 array, one row per key")
        deadline = time.monotonic() + self.timeout_s  # timeout_s bounds the whole write
        totals = [0, 0, 0, 0]
        for start in range(0, len(keys), wire.MAX_ITEMS):
            result = self._write_chunk(
                peer, namespace, keys[start : start + wire.MAX_ITEMS], rows[start : start + wire.MAX_ITEMS], deadline
            )
            for j, v in enumerate((result.stored, result.already_present, result.in_flight, result.checksum_failed)):
                totals[j] += v
            if result.reason:
                return WriteResult(totals[0], totals[1], totals[2], totals[3], reason=result.reason)
        return WriteResult(totals[0], totals[1], totals[2], totals[3])

    def _write_chunk(
        self, peer: str, namespace: bytes, keys: Sequence[bytes], rows: np.ndarray, deadline: float
    ) -> WriteResult:
        sock: socket.socket | None = None
        try:
            block_bytes = rows.shape[1]
            items = b"".join(wire.WRITE_ITEM.pack(k, checksum64(rows[i])) for i, k in enumerate(keys))
            head = wire.pack_header(wire.OP_WRITE, len(keys), namespace) + wire.U64.pack(block_bytes) + items

            def send(s: socket.socket) -> None:
                wire.send_all(s, head, deadline)
                for i in range(len(keys)):
                    wire.send_all(s, memoryview(rows[i]), deadline)  # type: ignore[arg-type]

            sock, status, _, message = self._exchange(peer, deadline, send)
            if status != wire.STATUS_OK:
                return WriteResult(0, 0, 0, 0, reason=f"peer {peer} refused the write: {message}")
            counts = wire.WRITE_COUNTS.unpack(wire.recv_exact(sock, wire.WRITE_COUNTS.size, deadline))
            if sum(counts) > len(keys):
                raise ProtocolViolation(f"peer {peer} reports {counts} outcomes for a write of {len(keys)} blocks")
            self._give(peer, sock)
            sock = None
            return WriteResult(*counts)
        except Exception as exc:  # the outermost boundary of a write: a failure is "not stored"
            if isinstance(exc, (OSError, InvalidArgument)):
                log.warning("write to %s failed (%s): nothing of this batch is known to be stored", peer, exc)
            else:
                log.exception("write to %s failed unexpectedly: nothing of this batch is known to be stored", peer)
            return WriteResult(0, 0, 0, 0, reason=f"transfer to {peer} failed: {exc or type(exc).__name__}")
        finally:
            if sock is not None:
                self._discard(sock)

    def close(self) -> None:
        with self._lock:
            stream_pool, self._stream_pool = self._stream_pool, None
        if stream_pool is not None:
            stream_pool.shutdown(wait=True)  # each part ends by its deadline
        with self._lock:
            pools, self._idle = self._idle, {}
        for pool in pools.values():
            for sock in pool:
                self._discard(sock)
