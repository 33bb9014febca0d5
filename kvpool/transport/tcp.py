"""The plain TCP-socket data plane, client side (the server is ``tcp_server``): the fallback
when ucxx is not installed, and the transport between hosts without UCX.

A small pool of persistent connections per peer; bytes are received straight into the
caller's buffer and each item is checksummed as it lands, while the kernel keeps receiving
the next (pipelined): natively, piece by piece, without the GIL (``recv_rows``), or by
``recv_into`` and a checksum per item (TLS, short items). A pooled connection found dead before the reply
(the peer restarted) is retried once on a fresh one; any other failure is a miss logged with
the peer's address.

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

import numpy as np

from kvpool.core.checksum import checksum64
from kvpool.core.errors import (
    InvalidArgument,
    Unauthenticated,
)
from kvpool.core.retry import RetryPolicy, retry_call
from kvpool.core.tickets import NONCE_BYTES, ticket_proof
from kvpool.transport import recv_rows, wire
from kvpool.transport.base import ReadItem, ReadResult, TicketSource, WriteResult
from kvpool.transport.tls import client_tls_context

log = logging.getLogger("kvpool.transport")

SOCKET_BUFFER_BYTES = 4 << 20
DEFAULT_TIMEOUT_S = 10.0
MAX_IDLE_PER_PEER = 8
#: a pooled connection found dead before the reply header: once more, on a fresh one
DEAD_POOLED_CONNECTION = RetryPolicy(first_delay_ms=0, max_delay_ms=0, max_attempts=2)
#: a read is spread over parallel connections only in parts of at least this many bytes
#: (below it, a second connection's request and thread hand-off cost more than they save)
STREAM_MIN_BYTES = 4 << 20
#: the most parts one read may be cut into (``TcpTransport(streams=)``); the default
#: (``default_streams``) is 1 for TCP and the core count up to 4 for the one-sided planes
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


def tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCKET_BUFFER_BYTES:  # 0 = leave the kernel's autotuning on
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


class ProtocolViolation(InvalidArgument):
    """A peer sent something the protocol does not allow (more items than asked, a length
    that is not the destination's, counts beyond the batch): the connection is dropped and
    the request is a miss."""


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
        self,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        streams: int = 0,
        stream_min_bytes: int = STREAM_MIN_BYTES,
        native_receive: bool = True,
    ) -> None:
        """A node with credentials admits a connection with a ticket its control plane issued
        (``use_tickets``): the token itself never travels on the data plane. ``streams``:
        the most connections one read is spread over (module docstring; 0 = the data plane's
        default, ``default_streams``; 1 = every read on one connection), each part at least
        ``stream_min_bytes``. ``native_receive=False`` keeps every receive on the portable
        ``recv_into`` path (the benchmark's A/B; tests)."""
        if not 0 <= streams <= MAX_STREAMS:
            raise InvalidArgument(f"streams must be 0 (the default) to {MAX_STREAMS}, not {streams}")
        self.timeout_s = timeout_s
        self.streams = streams or default_streams(self.one_sided)
        self.stream_min_bytes = stream_min_bytes
        self.native_receive = native_receive
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
        tune_socket(sock)
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

    def _read_request(
        self, sock: socket.socket, peer: str, namespace: bytes, packed_items: bytes, dst: Sequence[np.ndarray]
    ) -> bytes:
        """The request of one read on ``sock`` (a connection that passed ``_take``): its
        header and items (subclasses add what the connection's server understands)."""
        count = len(packed_items) // wire.READ_ITEM.size
        return wire.pack_header(self._read_op(peer), count, namespace) + packed_items

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
            packed_items = wire.pack_read_items([(it.key, it.range_offset, it.range_length) for it in items])
            sock, status, served, message = self._exchange(
                peer,
                deadline,
                lambda s: wire.send_all(s, self._read_request(s, peer, namespace, packed_items, dst), deadline),
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
        """Receive each item into its destination and verify it; returns the first bad index or -1.
        The rows received whole are verified (and counted in ``progress``) even when the stream
        stopped early; then the reason it stopped is raised."""
        rows = dst[: len(metas)]
        if self.native_receive and recv_rows.usable(sock, rows):
            digests, failure = recv_rows.receive(sock, rows, deadline)
        else:
            digests, failure = recv_rows.receive_portable(sock, rows, deadline)
        bad = -1
        for i, digest in enumerate(digests):
            length, checksum = metas[i]
            if bad < 0:
                if digest != checksum:
                    bad = i
                else:
                    progress[0] = i + 1
            self.bytes_received += length
        if failure is not None:
            raise failure
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
