"""The NIXL data plane (``nixl-cu12``): control over the TCP connection, bytes by one-sided NIXL READ.

NIXL is the transfer library vLLM's NixlConnector, Dynamo and SGLang move KV with; under its
UCX backend it picks RDMA (verbs), shared memory (cma) or TCP, and GPU memory where CUDA is.

Node side (``NixlDataServer``, a ``TcpDataServer``): at ``start`` one NIXL agent (UCX backend,
progress thread) registers the node's whole host arena **once**; its agent metadata (backend
connection info and the arena's memory keys) becomes ``transport_metadata``, which the node
publishes in its directory registration record (``NodeInfo.transport_metadata``). Per read the
server does no NIXL work at all: ``OP_NIXL_READ`` leases the blocks exactly like ``READ`` (same
namespace check, same whole-block verification of byte ranges) and answers each item's
(length, checksum, arena address); it then holds the lease until the reader's ``OP_NIXL_DONE``
(or the connection drops, or ``done_timeout_s`` passes), so a slot cannot be evicted and reused
while it is being pulled.

Reader side (``NixlTransport``, a ``TcpTransport``): each connection owns its own NIXL agent
(no progress thread: only the thread using the connection drives it) and, after AUTH, asks the
server's agent name (``OP_NIXL_HELLO``) and loads that agent's metadata, from the directory
(``learn_peer``) or, when it has none or a stale one, from the server on the same
authenticated connection. A read is one request on the connection and **one batched NIXL READ**
with a descriptor per item (a whole prompt's blocks, or one layer range of each):

- *direct* (the default on a host without RDMA devices): the caller's rows are registered with
  the connection's agent for this read (``register_spans``: UCX only records the ranges there,
  ~0.25 ms per 128 MiB) and the READ lands in them; each row is then checksummed in place, and
  ``ok`` counts only the leading rows that verified. No staging buffer, no second copy.
- *staged* (a host with RDMA devices, or rows that are not a few contiguous spans): the READ
  lands in a registered buffer the connection owns, is checksummed there and only then copied
  into the rows (``copy_verified``).

No byte lands in the caller's rows after ``read`` returns. NIXL 1.5.1 cannot cancel a running
READ (releasing it returns success while the RMA goes on), so a READ still running at the
deadline is never released: its connection, agent and buffers are *retired* — kept alive, never
driven again — and the read is a miss. Without RDMA every byte of a UCX transfer (tcp, cma,
shared memory) is moved inside a progress call of the reader's own agent, so an agent nobody
drives writes nothing more; with RDMA a NIC could, which is why such hosts stage (late bytes
can then only reach the retired connection's staging buffer). A peer that dies mid-transfer
fails it (UCX endpoint error): a miss. Writes stay on the TCP path.

Peers that do not speak NIXL (a ``--transport tcp`` / ``ucx`` node answers NIXL_HELLO "unknown
op") are read over the plain TCP path, so a cluster can mix transports.

Loopback: UCX opens a TCP listener on every interface it may use. When the peer (or the
listen address) is on loopback and the operator has not set ``UCX_NET_DEVICES``, the agent is
created with ``UCX_NET_DEVICES=lo`` so it listens on 127.0.0.1 only (``ucx_overrides``).

Installing: ``pip install 'kvpool[nixl]'`` (nixl-cu12 with torch pinned to the project's
``torch==2.13.0``), or ``pip install --no-deps nixl-cu12==1.5.1`` beside any torch. Alone, its
metadata's unpinned torch resolves to the newest CUDA build (5.7 GB); NIXL needs no torch for
host memory.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpool.core.auth import Credentials
from kvpool.core.errors import InvalidArgument, Unauthenticated, Unavailable
from kvpool.transport import wire
from kvpool.transport.base import BlockStore
from kvpool.transport.nixl_agent import (
    STATE_BUSY,
    STATE_ERROR,
    Agent,
    has_rdma,
    is_loopback,
    nixl_available,
    nixl_plugins,
    ucx_overrides,
    usable_backends,
)
from kvpool.transport.runs import row_spans
from kvpool.transport.tcp import DEFAULT_TIMEOUT_S, TcpTransport, split_address
from kvpool.transport.tcp_server import TcpDataServer
from kvpool.transport.verify import copy_verified, verify_in_place

__all__ = [
    "NixlDataServer",
    "NixlTransport",
    "nixl_available",
    "nixl_plugins",
    "require_nixl",
    "row_spans",
    "ucx_overrides",
    "usable_backends",
]

log = logging.getLogger("kvpool.transport")

NIXL_REQUIREMENT = "nixl-cu12==1.5.1"
INSTALL_HINT = (
    f"pip install 'kvpool[nixl]', or pip install --no-deps {NIXL_REQUIREMENT} (alone, its unpinned torch "
    "requirement pulls a CUDA torch; NIXL needs no torch for host memory), or use --transport tcp / ucx"
)
STAGING_KEEP_BYTES = 256 << 20  # a connection keeps a staging buffer up to this size between reads
WINDOW_BYTES = 512 << 20  # one NIXL_READ request (and a staging buffer) moves at most this much
MAX_AGENT_NAME_BYTES = 256
#: retired connections (a READ still running at its deadline) are kept for the process's life;
#: past this many the transport logs an error on each new one (a peer that keeps stalling)
RETIRED_WARN_COUNT = 16
#: rows in more contiguous pieces than this are read staged (registering them would cost more
#: than the copy out of the staging buffer)
MAX_DIRECT_SPANS = 64


class NixlDataServer(TcpDataServer):
    """``TcpDataServer`` whose arena is registered with a NIXL agent, serving ``OP_NIXL_READ``."""

    def __init__(
        self,
        store: BlockStore,
        listen: str,
        credentials: Credentials | None = None,
        done_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(store, listen, credentials=credentials)
        self.done_timeout_s = done_timeout_s
        self._agent: Agent | None = None
        self._regs: Any = None
        self.transport_metadata = b""

    def start(self) -> None:
        host, _ = split_address(self._listen)
        agent = Agent(f"kvpool-{secrets.token_hex(8)}", progress_thread=True, loopback=is_loopback(host))
        arena = self._store.arena()
        self._regs = agent.register(arena)  # once: every block of the arena is now readable by pull
        self._agent = agent
        self.transport_metadata = agent.metadata()
        super().start()
        log.info("data plane: NIXL agent %s registered the %d-byte arena", agent.name, arena.nbytes)

    def stop(self) -> None:
        super().stop()
        if self._agent is not None and self._regs is not None:
            self._agent.deregister(self._regs)
            self._regs = None

    def _serve_other(
        self, conn: socket.socket, op: int, count: int, namespace: bytes, state: dict[str, object]
    ) -> bool:
        if op == wire.OP_NIXL_HELLO:
            assert self._agent is not None
            name = self._agent.name.encode()
            metadata = self.transport_metadata if count else b""
            conn.sendall(wire.pack_reply(wire.STATUS_OK, len(name)) + name + wire.U64.pack(len(metadata)) + metadata)
            return True
        if op == wire.OP_NIXL_READ:
            self._serve_read_nixl(conn, count, namespace)
            return True
        return False

    def _serve_read_nixl(self, conn: socket.socket, count: int, namespace: bytes) -> None:
        leased = self._lease_for_read(conn, count, namespace)
        if leased is None:
            return
        lease_id, views, metas, offsets = leased
        try:
            origin = self._store.arena().ctypes.data
            addresses = [wire.NIXL_ADDRESS.pack(origin + offset) for offset in offsets]
            conn.sendall(wire.pack_reply(wire.STATUS_OK, len(views)) + b"".join(metas) + b"".join(addresses))
            if not views:
                return
            # the reader pulls now; the lease protects the slots until it says it is done
            op, served, _ = wire.unpack_header(
                wire.recv_exact(conn, wire.HEADER.size, time.monotonic() + self.done_timeout_s)
            )
            if op != wire.OP_NIXL_DONE or served != len(views):
                raise InvalidArgument(f"expected NIXL_DONE for {len(views)} items, got op {op} count {served}")
            self.bytes_sent += sum(len(v) for v in views)
        except TimeoutError:
            raise InvalidArgument(f"no NIXL_DONE within {self.done_timeout_s} s: lease released") from None
        finally:
            conn.settimeout(self._idle_timeout_s)  # the DONE wait armed a shorter one
            if lease_id:
                self._store.release(lease_id)


@dataclass
class _Conn:
    """One reader connection's NIXL state: its own agent, the server's agent name, its staging."""

    agent: Agent
    remote: str
    staging: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint8))
    staging_regs: Any = None
    retired: bool = False  # a READ was still running at its deadline: never driven or freed again


class NixlTransport(TcpTransport):
    """Reads by NIXL READ (one batched transfer per request), writes over TCP."""

    name = "nixl"
    read_op = wire.OP_NIXL_READ
    one_sided = True

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, direct: bool | None = None, streams: int = 0) -> None:
        """``direct``: READ straight into the caller's rows (see the module docstring); None =
        where the host has no RDMA devices. ``streams``: as ``TcpTransport`` (each stream's
        connection has its own agent and its own batched READ)."""
        super().__init__(timeout_s, streams)  # AUTH runs on the TCP connection before NIXL_HELLO
        self.direct = not has_rdma() if direct is None else direct
        self._known: dict[str, bytes] = {}  # peer -> agent metadata (the directory's, or the peer's own)
        self._from_directory: set[str] = set()  # peers whose known metadata the directory published
        self._plain: set[str] = set()  # peers that do not speak NIXL: read over TCP
        self._conns: dict[socket.socket, _Conn] = {}
        self._retired: list[_Conn] = []  # kept alive, never driven: see the module docstring
        self.counters = {
            "nixl_reads": 0,  # batched NIXL READs that completed
            "direct_reads": 0,  # ... of them straight into the caller's rows
            "staged_reads": 0,  # ... through the connection's staging buffer
            "retired_connections": 0,  # READs still running at their deadline
            "metadata_from_directory": 0,  # peer agents loaded from what the directory published
            "metadata_from_peer": 0,  # ... fetched over the data connection (none published, or stale)
            "tcp_peers": 0,  # peers that do not speak NIXL, read over TCP
        }

    def learn_peer(self, peer: str, metadata: bytes) -> None:
        if metadata and len(metadata) <= wire.MAX_NIXL_METADATA:
            with self._lock:
                if self._known.get(peer) != metadata:
                    self._known[peer] = metadata
                    self._from_directory.add(peer)

    def _read_op(self, peer: str) -> int:
        return wire.OP_READ if peer in self._plain else wire.OP_NIXL_READ

    def _windows(self, peer: str, dst: Sequence[np.ndarray]) -> list[tuple[int, int]]:
        """Requests of at most ``MAX_ITEMS`` items and ``WINDOW_BYTES`` (what one staging buffer holds)."""
        windows: list[tuple[int, int]] = []
        start, nbytes = 0, 0
        for i, row in enumerate(dst):
            if i > start and (i - start >= wire.MAX_ITEMS or nbytes + row.nbytes > WINDOW_BYTES):
                windows.append((start, i))
                start, nbytes = i, 0
            nbytes += row.nbytes
        if start < len(dst):
            windows.append((start, len(dst)))
        return windows

    def _hello(self, sock: socket.socket, peer: str, want_metadata: bool, deadline: float) -> tuple[str, bytes]:
        wire.send_all(sock, wire.pack_header(wire.OP_NIXL_HELLO, int(want_metadata), bytes(16)), deadline)
        status, count, message = wire.recv_reply(sock, deadline)
        if status == wire.STATUS_BAD_REQUEST:  # "unknown op": a tcp / ucx node
            raise _NotNixl(f"peer {peer} does not serve NIXL reads: {message}")
        if status == wire.STATUS_UNAUTHENTICATED:
            raise Unauthenticated(
                f"data plane at {peer} refused NIXL_HELLO: {message}",
                hint="give the transport a ticket from the node's Hello (use_tickets)",
            )
        if status != wire.STATUS_OK:
            raise InvalidArgument(f"peer {peer} refused NIXL_HELLO (status {status}): {message}")
        if count > MAX_AGENT_NAME_BYTES:
            raise InvalidArgument(f"peer {peer} names a {count}-byte NIXL agent")
        name = wire.recv_exact(sock, count, deadline).decode("utf-8", "replace")
        (length,) = wire.U64.unpack(wire.recv_exact(sock, wire.U64.size, deadline))
        if length > wire.MAX_NIXL_METADATA:
            raise InvalidArgument(f"peer {peer} sends {length} bytes of NIXL metadata")
        return name, wire.recv_exact(sock, length, deadline)

    def _take(self, peer: str, deadline: float | None = None, fresh: bool = False) -> tuple[socket.socket, bool]:
        sock, pooled = super()._take(peer, deadline, fresh)
        if sock in self._conns or peer in self._plain:
            return sock, pooled
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        try:
            name, _ = self._hello(sock, peer, False, deadline)
            host, _ = split_address(peer)
            agent = Agent(f"kvpool-reader-{secrets.token_hex(8)}", False, is_loopback(host))
            with self._lock:
                known = self._known.get(peer, b"")
                published = peer in self._from_directory
            if known and agent.load_remote(peer, known) == name:
                self.counters["metadata_from_directory" if published else "metadata_from_peer"] += 1
            else:  # none published, or stale (the node restarted with a new agent)
                _, metadata = self._hello(sock, peer, True, deadline)
                if agent.load_remote(peer, metadata) != name:
                    raise InvalidArgument(f"peer {peer}'s NIXL metadata names another agent than {name}")
                with self._lock:
                    self._known[peer] = metadata
                    self._from_directory.discard(peer)
                self.counters["metadata_from_peer"] += 1
        except _NotNixl as exc:
            sock.close()  # the server closes after an unknown op
            log.warning("%s: reading it over TCP", exc)
            with self._lock:
                self._plain.add(peer)
            self.counters["tcp_peers"] += 1
            return super()._take(peer, deadline, fresh=True)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self._conns[sock] = _Conn(agent, name)
        return sock, pooled

    def _staging_for(self, conn: _Conn, nbytes: int) -> np.ndarray:
        if conn.staging.nbytes < nbytes:
            if conn.staging_regs is not None:
                conn.agent.deregister(conn.staging_regs)
                conn.staging_regs = None
            conn.staging = np.empty(0, dtype=np.uint8)
            buffer = np.empty(nbytes, dtype=np.uint8)
            conn.staging_regs = conn.agent.register(buffer)
            conn.staging = buffer
        return conn.staging[:nbytes]

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
            conn = self._conns.get(sock)
        if conn is None:  # a plain TCP peer
            return super()._receive(sock, peer, metas, dst, progress, deadline)
        if not metas:
            return -1
        raw = wire.recv_exact(sock, len(metas) * wire.NIXL_ADDRESS.size, deadline)
        rows = dst[: len(metas)]
        lengths = np.array([length for length, _ in metas], dtype=np.uint64)
        remote = np.zeros((len(metas), 3), dtype=np.uint64)
        remote[:, 0] = np.frombuffer(raw, dtype="<u8")
        remote[:, 1] = lengths
        local = np.zeros((len(metas), 3), dtype=np.uint64)
        local[:, 1] = lengths
        regs = self._register_rows(conn, rows) if self.direct else None
        if regs is not None:
            local[:, 0] = [row.ctypes.data for row in rows]
        else:
            starts = np.concatenate(([0], np.cumsum(lengths))).astype(np.uint64)
            staging = self._staging_for(conn, int(starts[-1]))
            local[:, 0] = staging.ctypes.data + starts[:-1]
        self._pull(conn, local, remote, peer, deadline)  # a timeout retires conn: regs stay as they are
        try:
            if regs is not None:
                conn.agent.deregister(regs)  # the READ has ended: nothing writes into the rows any more
                self.counters["direct_reads"] += 1
                bad = verify_in_place(rows, metas, progress)
            else:
                self.counters["staged_reads"] += 1
                bad = copy_verified(staging, [int(x) for x in starts], metas, dst, progress)
            self.bytes_received += sum(length for length, _ in metas[: progress[0]])
            return bad
        finally:
            # the server holds its lease until this: sent after the checks, so a failure here
            # (the server died just now) still leaves every verified block counted
            wire.send_all(sock, wire.pack_header(wire.OP_NIXL_DONE, len(metas), bytes(16)), deadline)
            if conn.staging.nbytes > STAGING_KEEP_BYTES and conn.staging_regs is not None:
                conn.agent.deregister(conn.staging_regs)
                conn.staging_regs, conn.staging = None, np.empty(0, dtype=np.uint8)

    def _register_rows(self, conn: _Conn, rows: Sequence[np.ndarray]) -> Any:
        """Register the caller's rows for one direct READ; None = read staged instead."""
        spans = row_spans(rows, MAX_DIRECT_SPANS)
        if spans is None:
            return None
        try:
            return conn.agent.register_spans(spans)
        except Exception as exc:  # overlapping rows, or memory NIXL will not take: stage
            log.info("nixl: registering %d row spans failed (%s): reading staged", len(spans), exc)
            return None

    def _pull(self, conn: _Conn, local: np.ndarray, remote: np.ndarray, peer: str, deadline: float) -> None:
        """Post one batched READ and poll it to its end (polling progresses the connection's
        agent: nothing else does). Past the deadline the connection is retired, not released."""
        handle = conn.agent.read(local, remote, conn.remote)
        polls = 0
        while True:
            state = conn.agent.state(handle)
            if state != STATE_BUSY:
                break
            if time.monotonic() > deadline:
                self._retire(conn, peer)
                raise TimeoutError(f"the NIXL READ from {peer} did not complete in time")
            polls += 1
            if polls % 1024 == 0:
                time.sleep(0)  # let other threads (and their transfers) run
        conn.agent.release(handle)  # ended: done, or failed with the peer's endpoint
        if state == STATE_ERROR:
            raise ConnectionError(f"the NIXL READ from {peer} failed (peer gone?)")
        self.counters["nixl_reads"] += 1

    def _retire(self, conn: _Conn, peer: str) -> None:
        conn.retired = True
        with self._lock:
            self._retired.append(conn)
            count = len(self._retired)
        self.counters["retired_connections"] += 1
        log.log(
            logging.ERROR if count > RETIRED_WARN_COUNT else logging.WARNING,
            "nixl: a READ from %s was still running at its deadline: its connection and agent are retired "
            "(kept, never driven again: no late byte reaches the caller); %d retired so far",
            peer,
            count,
        )

    def _discard(self, sock: socket.socket) -> None:
        with self._lock:
            conn = self._conns.pop(sock, None)
        if conn is not None and not conn.retired and conn.staging_regs is not None:
            conn.agent.deregister(conn.staging_regs)
            conn.staging_regs = None
        sock.close()

    def close(self) -> None:
        super().close()
        with self._lock:
            left = len(self._retired)
        if left:
            log.warning("nixl: %d connections retired after a stalled READ stay allocated", left)


class _NotNixl(Unavailable):
    """The peer answered NIXL_HELLO with an error: it is a tcp / ucx node."""


def require_nixl() -> None:
    """Raise ``Unavailable`` naming the install command when NIXL cannot be imported."""
    why = nixl_available()
    if why:
        raise Unavailable(f"the nixl data plane is not installed here ({why})", hint=INSTALL_HINT)
