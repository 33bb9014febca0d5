"""The plain TCP-socket data plane, server side (the reader is ``tcp.TcpTransport``; the UCX
and NIXL servers extend this one).

One accept thread and one thread per connection (bounded); a READ leases the leading present
keys in the node's store, sends one header with every (length, checksum) and then the bytes
straight out of the mapped arena (``sendmsg`` of memoryviews, several blocks per call, no copy
in Python), and releases the lease. A WRITE receives into slots the store reserves and commits only the blocks
whose checksum matches.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple

import numpy as np

from kvpool.core.auth import ANONYMOUS, Credentials, Principal
from kvpool.core.checksum import checksum64
from kvpool.core.errors import (
    CapacityExhausted,
    InvalidArgument,
    KVPoolError,
    NotFound,
    TenantBusy,
    Unavailable,
    UnknownNamespace,
)
from kvpool.core.tickets import MAX_TICKET_ID_BYTES, NONCE_BYTES, PROOF_BYTES
from kvpool.transport import wire
from kvpool.transport.base import BlockStore
from kvpool.transport.shares import TransferShares
from kvpool.transport.tcp import split_address, tune_socket

log = logging.getLogger("kvpool.transport")

DEFAULT_MAX_CONNECTIONS = 256
#: how long ``TcpDataServer.stop`` waits for its connection workers (a UCX one may be in a
#: transfer with its own deadline)
STOP_JOIN_S = 10.0


class LeasedRead(NamedTuple):
    """The blocks of a READ, leased in the node's store until ``lease_id`` is released."""

    lease_id: int
    views: list[memoryview]  # the bytes each item asked for, in the arena
    metas: list[bytes]  # per item: READ_META (length, checksum)
    offsets: list[int]  # per item: where its view starts in the arena (``BlockStore.arena``)


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
            tune_socket(conn)
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
        if op in wire.NAMESPACE_OPS and not principal.may_use(namespace):
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

    def _lease_for_read(self, conn: socket.socket, count: int, namespace: bytes) -> LeasedRead | None:
        """Parse a READ request and lease its blocks; None if refused (answered)."""
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
            offsets: list[int] = []
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
                offsets.append(offset + off)
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
        return LeasedRead(grant.lease_id, views, metas, offsets)

    def _serve_read(self, conn: socket.socket, count: int, namespace: bytes) -> None:
        leased = self._lease_for_read(conn, count, namespace)
        if leased is None:
            return
        try:
            head = wire.pack_reply(wire.STATUS_OK, len(leased.views)) + b"".join(leased.metas)
            self.bytes_sent += wire.send_gathered(conn, [head, *leased.views]) - len(head)
        finally:
            if leased.lease_id:
                self._store.release(leased.lease_id)

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
