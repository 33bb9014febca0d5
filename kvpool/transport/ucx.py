"""The UCX data plane (``ucxx``): control over the TCP connection, bytes over UCX.

Each TCP data connection is upgraded once: the client sends its UCX *worker address*,
the server creates an endpoint to it (endpoint error handling off, which is what lets
UCX pick shared memory - sm/cma/posix - between processes of one host, and RDMA where
the build has verbs) and answers with its own worker address, and whether it serves runs
(``FLAG_UCX_RUNS``). Reads then go as ``OP_READ_UCX_RUNS`` (``OP_READ_UCX`` to a node before
runs): the request, the reply header and every (length, checksum) travel on the TCP
connection; the block bytes travel as UCX tag messages, all posted at once (pipelined), one
per run of blocks that lie end to end in the node's arena and in the reader's array
(``kvpool.transport.runs``; one per block for a node before runs). The server holds its store
read lease until every send has completed.

Where the bytes land. A receive UCX has matched cannot be cancelled, so after a timeout
bytes may still arrive; they must never reach rows already reported as a miss.
- *direct* (a host without RDMA devices, the default): the receives are posted on the
  caller's rows and each row is checksummed in place once all completed (``verify_in_place``).
  Rendezvous is by *get* (``CONTEXT_CONFIG``), so every byte lands inside a progress call of
  the reader's own worker; a read past its deadline *retires* its link: never progressed,
  waited on or closed again, so nothing more lands.
- *staged* (RDMA devices present, where a NIC writes on its own, or ``direct=False``): the
  receives land in a staging buffer the connection owns, checksummed there and only then
  copied into the rows; a timeout cancels the receives and drops the connection, its worker
  and its staging buffer: a late byte can only land in that buffer.

Each connection owns its own UCX worker, driven by the one thread that uses the
connection at a time: the reader polls (the fastest way to complete a transfer), the
server waits in the worker's epoll (blocking progress mode), so two spinning threads do
not fight over the cores; on this 2-core machine that took 4 MiB reads from ~1 to ~3.5
GB/s. Writes stay on the TCP path.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ucxx._lib.libucxx as ucx_api  # type: ignore[import-untyped]
from ucxx._lib.arr import Array  # type: ignore[import-untyped]

from kvpool.core.auth import Credentials
from kvpool.core.errors import InvalidArgument
from kvpool.transport import wire
from kvpool.transport.base import BlockStore
from kvpool.transport.nixl_agent import has_rdma
from kvpool.transport.runs import row_joins, run_bounds, server_runs, span, writable_rows
from kvpool.transport.tcp import DEFAULT_TIMEOUT_S, ProtocolViolation, TcpTransport
from kvpool.transport.tcp_server import TcpDataServer
from kvpool.transport.verify import copy_verified, verify_in_place

log = logging.getLogger("kvpool.transport")

BLOCKING_WAIT_MS = 5  # a blocking-mode worker re-checks its deadline at least this often
CLOSE_DRAIN_S = 0.2  # how long closing a link progresses its worker so cancelled requests finish
STAGING_KEEP_BYTES = (
    256 << 20
)  # a connection keeps a staging buffer up to this size between reads (a 32 x 4 MiB batch fits)
#: rendezvous by *get*: the receiver pulls a large message (cma, or RDMA READ), so on a host
#: without RDMA every byte lands inside a progress call of the receiving worker, never pushed
#: by the sender (``put_zcopy``) while the receiver has given up on it
CONTEXT_CONFIG = {"RNDV_SCHEME": "get_zcopy"}
_context_lock = threading.Lock()
_contexts: list[Any] = []


def _context() -> Any:
    """One UCX context per process (created on first use, shared by every worker)."""
    with _context_lock:
        if not _contexts:
            _contexts.append(
                ucx_api.UCXContext(
                    config_dict=dict(CONTEXT_CONFIG), feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP)
                )
            )
        return _contexts[0]


class _Link:
    """One side's UCX worker and endpoint of one TCP connection, plus the tag counter."""

    def __init__(self, peer_address: bytes | None = None, blocking: bool = False) -> None:
        self.worker = ucx_api.UCXWorker(_context())
        self.blocking = blocking
        if blocking:
            self.worker.init_blocking_progress_mode()
        self.endpoint: Any = None
        self.runs = False  # the reader's side: the server said it serves READ_UCX_RUNS (UCX_HELLO)
        self.asked: list[bool] = []  # the reader's side: the joins its current request offered
        self.retired = False  # a direct receive was still posted at its deadline: never progressed again
        self.next_tag = 1
        self._staging = np.empty(0, dtype=np.uint8)
        self._posted: list[Any] = []
        if peer_address is not None:
            self.connect(peer_address)

    @property
    def address(self) -> bytes:
        return bytes(self.worker.address)

    def connect(self, peer_address: bytes) -> None:
        addr = ucx_api.UCXAddress.create_from_buffer(peer_address)
        self.endpoint = ucx_api.UCXEndpoint.create_from_worker_address(self.worker, addr, False)

    def staging(self, nbytes: int) -> np.ndarray:
        """The link's private receive buffer, at least ``nbytes`` long.

        Staged reads land here, not in the caller's rows: a receive UCX has already
        matched cannot be cancelled (``ucp_request_cancel`` has no effect on it), and
        ``cancel_inflight_requests`` only schedules the cancels, so after a timeout bytes
        may still arrive. They then land in memory this link owns and that nobody reads
        again (a timed-out link is dropped with it), not in rows reported as a miss. A
        buffer beyond ``STAGING_KEEP_BYTES`` is let go after the read (``trim_staging``)."""
        if self._staging.nbytes < nbytes:
            self._staging = np.empty(nbytes, dtype=np.uint8)
        return self._staging[:nbytes]

    def trim_staging(self) -> None:
        """Drop an oversized staging buffer; only once every receive into it has completed."""
        if self._staging.nbytes > STAGING_KEEP_BYTES:
            self._staging = np.empty(0, dtype=np.uint8)

    def take_tag_base(self) -> int:
        base = self.next_tag << 20
        self.next_tag += 1
        return base

    def wait(self, requests: list[Any], deadline: float) -> None:
        self._posted = requests  # kept with the staging buffer they write to, for close()
        worker = self.worker
        while not all(r.completed for r in requests):
            if self.blocking:  # sleep in epoll instead of spinning (the server side)
                if not worker.progress_once():
                    worker.progress_worker_event(BLOCKING_WAIT_MS)
            else:
                worker.progress()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sum(not r.completed for r in requests)} UCX transfers did not complete in time")
        self._posted = []  # all finished: nothing writes to (or reads from) their buffers any more
        for request in requests:
            request.check_error()

    def close(self) -> None:
        """Cancel what is still posted, then progress the worker (up to ``CLOSE_DRAIN_S``)
        until those requests have finished.

        ucxx tracks a request made through an endpoint on that *endpoint*:
        ``worker.cancel_inflight_requests`` does not see it (it returns 0 and the receive stays
        posted); ``endpoint.close_blocking`` cancels it (completes with ``UCXXCanceledError``).
        A receive UCX has already matched cannot be cancelled and finishes (or not) on its
        own: its bytes land in the staging buffer, never in the caller's rows."""
        endpoint, self.endpoint = self.endpoint, None
        try:
            if endpoint is not None:
                endpoint.close_blocking()
            self.worker.cancel_inflight_requests(0, 3)
            deadline = time.monotonic() + CLOSE_DRAIN_S
            while not all(r.completed for r in self._posted) and time.monotonic() < deadline:
                self.worker.progress()
        except Exception:  # already torn down
            pass


class UcxDataServer(TcpDataServer):
    """``TcpDataServer`` that also serves ``OP_READ_UCX`` and ``OP_READ_UCX_RUNS`` on upgraded connections."""

    def __init__(
        self,
        store: BlockStore,
        listen: str,
        send_timeout_s: float = DEFAULT_TIMEOUT_S,
        credentials: Credentials | None = None,
    ) -> None:
        super().__init__(store, listen, credentials=credentials)
        self.send_timeout_s = send_timeout_s
        _context()  # fail at start, not on the first peer, if UCX cannot initialise

    def _serve_other(
        self, conn: socket.socket, op: int, count: int, namespace: bytes, state: dict[str, object]
    ) -> bool:
        if op == wire.OP_UCX_HELLO:
            peer_address = wire.recv_exact(conn, count)
            old = state.pop("ucx", None)
            if isinstance(old, _Link):
                old.close()
            link = _Link(peer_address, blocking=True)
            state["ucx"] = link
            mine = link.address
            conn.sendall(wire.pack_reply(wire.STATUS_OK, len(mine), flags=wire.FLAG_UCX_RUNS) + mine)
            return True
        if op in (wire.OP_READ_UCX, wire.OP_READ_UCX_RUNS):
            asked = None  # READ_UCX: one message per item
            if op == wire.OP_READ_UCX_RUNS:
                asked = wire.unpack_joins(wire.recv_exact(conn, wire.joins_bytes(count)), count)
            upgraded = state.get("ucx")
            if not isinstance(upgraded, _Link):
                wire.recv_exact(conn, count * wire.READ_ITEM.size)  # the whole request: the stream stays in step
                conn.sendall(wire.pack_reply(wire.STATUS_BAD_REQUEST, 0, "READ_UCX before UCX_HELLO"))
                return True
            self._serve_read_ucx(conn, count, namespace, upgraded, asked)
            return True
        return False

    def _serve_read_ucx(
        self, conn: socket.socket, count: int, namespace: bytes, link: _Link, asked: list[bool] | None
    ) -> None:
        leased = self._lease_for_read(conn, count, namespace)
        if leased is None:
            return  # refused: neither side takes a tag base
        lease_id, views, metas, offsets = leased
        base = link.take_tag_base()  # both sides count accepted reads: tags stay in step
        try:
            reply = wire.pack_reply(wire.STATUS_OK, len(views)) + b"".join(metas)
            messages: Sequence[object] = views
            if asked is not None:
                joins, messages = server_runs(self._store.arena(), offsets, [len(v) for v in views], asked)
                reply += wire.pack_joins(joins)
            conn.sendall(reply)
            requests = [
                link.endpoint.tag_send(Array(message), tag=ucx_api.UCXXTag(base | i))
                for i, message in enumerate(messages)
            ]
            link.wait(requests, time.monotonic() + self.send_timeout_s)
            self.bytes_sent += sum(len(v) for v in views)
        finally:
            if lease_id:
                self._store.release(lease_id)  # only now may the slot be reused

    def _close_state(self, state: dict[str, object]) -> None:
        link = state.pop("ucx", None)
        if isinstance(link, _Link):
            link.close()


class UcxTransport(TcpTransport):
    """Reads over UCX (worker-address path), writes over TCP."""

    name = "ucx"
    one_sided = True

    def __init__(
        self, timeout_s: float = DEFAULT_TIMEOUT_S, direct: bool | None = None, streams: int = 0, runs: bool = True
    ) -> None:
        """``direct``: receive straight into the caller's rows (module docstring); None = where
        the host has no RDMA devices. ``streams``: as ``TcpTransport`` (each stream's
        connection has its own worker). ``runs``: blocks end to end on both sides move as one
        message (READ_UCX_RUNS, ``kvpool.transport.runs``); False = one message per block
        (READ_UCX: what nodes before runs serve; the benchmark's A/B)."""
        super().__init__(timeout_s, streams)  # AUTH runs on the TCP connection before the UCX upgrade
        self.runs = runs
        self.direct = not has_rdma() if direct is None else direct
        self._links: dict[socket.socket, _Link] = {}
        self._retired: list[_Link] = []  # kept alive, never progressed again
        self.counters = {"direct_reads": 0, "staged_reads": 0, "retired_links": 0, "messages": 0}
        _context()

    def _take(self, peer: str, deadline: float | None = None, fresh: bool = False) -> tuple[socket.socket, bool]:
        sock, pooled = super()._take(peer, deadline, fresh)
        if sock in self._links:
            return sock, pooled
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        try:
            link = _Link()
            mine = link.address
            wire.send_all(sock, wire.pack_header(wire.OP_UCX_HELLO, len(mine), b"\0" * 16) + mine, deadline)
            status, count, message, flags = wire.recv_reply_flags(sock, deadline)
            if status != wire.STATUS_OK:
                raise InvalidArgument(
                    f"peer {peer} refused the UCX upgrade: {message}", hint="run it with --transport ucx"
                )
            link.connect(wire.recv_exact(sock, count, deadline))
            link.runs = self.runs and bool(flags & wire.FLAG_UCX_RUNS)  # a node before runs: READ_UCX
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self._links[sock] = link
        return sock, pooled

    def _receive(
        self,
        sock: socket.socket,
        peer: str,
        metas: list[tuple[int, int]],
        dst: Sequence[np.ndarray],
        progress: list[int],
        deadline: float,
    ) -> int:
        with self._lock:
            link = self._links[sock]
        base = link.take_tag_base()
        starts = [0]
        for length, _ in metas:
            starts.append(starts[-1] + length)
        rows = dst[: len(metas)]
        direct = self._direct(dst)  # decided over the whole request, as _read_request did
        joins = [False] * len(metas)  # READ_UCX: a message per item
        if link.runs:
            joins = wire.unpack_joins(wire.recv_exact(sock, wire.joins_bytes(len(metas)), deadline), len(metas))
        if any(join and not ok for join, ok in zip(joins, link.asked)):
            raise ProtocolViolation(f"peer {peer} joins items into one message where the reader's rows do not allow it")
        bounds = run_bounds(joins)
        if direct:
            targets = [span(rows[start:end]) if end - start > 1 else rows[start] for start, end in bounds]
        else:
            staging = link.staging(starts[-1])  # private: see _Link.staging for why not the caller's rows
            targets = [staging[starts[start] : starts[end]] for start, end in bounds]
        requests = [
            link.endpoint.tag_recv(Array(target), tag=ucx_api.UCXXTag(base | i)) for i, target in enumerate(targets)
        ]
        with self._lock:  # several streams' threads receive at once
            self.counters["messages"] += len(requests)
        try:
            link.wait(requests, deadline)  # the read's one deadline
        except TimeoutError:
            if direct:  # a matched receive cannot be cancelled: never progress this worker again
                link.retired = True
                with self._lock:
                    self._retired.append(link)
                self.counters["retired_links"] += 1
                log.warning("ucx: a read from %s timed out: its link is retired (never progressed again)", peer)
            raise  # -> the caller drops the connection
        try:
            if direct:
                self.counters["direct_reads"] += 1
                bad = verify_in_place(rows, metas, progress)
            else:
                self.counters["staged_reads"] += 1
                bad = copy_verified(staging, starts, metas, dst, progress)
            self.bytes_received += starts[progress[0]]
            return bad
        finally:
            link.trim_staging()  # every receive has completed: the buffer is free

    def _direct(self, rows: Sequence[np.ndarray]) -> bool:
        """Whether a read lands straight in ``rows`` (module docstring), else in staging."""
        return self.direct and writable_rows(rows)

    def _read_request(
        self, sock: socket.socket, peer: str, namespace: bytes, packed_items: bytes, dst: Sequence[np.ndarray]
    ) -> bytes:
        """READ_UCX_RUNS with the rows' joins where the connection's server offers it, else READ_UCX."""
        count = len(packed_items) // wire.READ_ITEM.size
        with self._lock:
            link = self._links[sock]
        if not link.runs:
            link.asked = [False] * count
            return wire.pack_header(wire.OP_READ_UCX, count, namespace) + packed_items
        # which items may share a message with the one before: rows end to end (direct), or
        # any (staged: the staging buffer is one piece); _receive holds the node's cut to it
        rows = dst[:count]
        link.asked = row_joins(rows) if self._direct(rows) else [i > 0 for i in range(count)]
        return wire.pack_header(wire.OP_READ_UCX_RUNS, count, namespace) + wire.pack_joins(link.asked) + packed_items

    def _discard(self, sock: socket.socket) -> None:
        with self._lock:
            link = self._links.pop(sock, None)
        if link is not None and not link.retired:  # closing progresses the worker
            link.close()
        sock.close()
