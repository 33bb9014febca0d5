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

Reader side (``NixlTransport``, a ``TcpTransport``): each connection, after AUTH, asks the
server's agent name (``OP_NIXL_HELLO``) and loads that agent's metadata, from the directory
(``learn_peer``) or, when it has none or a stale one, from the server on the same
authenticated connection. A read is one request on the connection and **one batched NIXL READ**
with a descriptor per item (a whole prompt's blocks, or one layer range of each), pulled into a
staging buffer the connection owns (registered with the reader's agent), checksummed there and
only then copied into the caller's rows. A failed, errored or timed-out transfer is a miss.
After a timeout the transfer is cancelled (``releaseXferReq``); one that cannot be cancelled
keeps its staging buffer alive (never freed, never reused) until it finishes, so a late byte
never lands in memory anyone uses. Writes stay on the TCP path.

Peers that do not speak NIXL (a ``--transport tcp`` / ``ucx`` node answers NIXL_HELLO "unknown
op") are read over the plain TCP path, so a cluster can mix transports.

Loopback: UCX opens a TCP listener on every interface it may use. When the peer (or the
listen address) is on loopback and the operator has not set ``UCX_NET_DEVICES``, the agent is
created with ``UCX_NET_DEVICES=lo`` so it listens on 127.0.0.1 only (``ucx_overrides``).

Installing: ``pip install --no-deps nixl-cu12==1.5.1``. Its metadata asks for an unpinned
torch, which pip resolves to a CUDA build (5.7 GB); NIXL needs no torch for host memory.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.core.auth import Credentials
from kvpool.core.errors import InvalidArgument, Unauthenticated, Unavailable
from kvpool.transport import wire
from kvpool.transport.base import BlockStore
from kvpool.transport.tcp import DEFAULT_TIMEOUT_S, TcpDataServer, TcpTransport, copy_verified, split_address

log = logging.getLogger("kvpool.transport")

NIXL_REQUIREMENT = "nixl-cu12==1.5.1"
INSTALL_HINT = (
    f"pip install --no-deps {NIXL_REQUIREMENT}  (--no-deps: its unpinned torch requirement pulls a CUDA "
    "torch; NIXL needs no torch for host memory), or use --transport tcp / ucx"
)
#: the progress thread of the node's agent sleeps this long when idle: 0 (NIXL's Python default)
#: spins a core per daemon; 100 us still cost ~40% of a core; 1000 us measured as fast here
PROGRESS_DELAY_US = 1000
STAGING_KEEP_BYTES = 256 << 20  # a connection keeps a staging buffer up to this size between reads
WINDOW_BYTES = 512 << 20  # one NIXL_READ request (and its staging buffer) moves at most this much
MAX_AGENT_NAME_BYTES = 256
STATE_DONE, STATE_BUSY, STATE_ERROR = "done", "busy", "error"
RDMA_SYSFS = "/sys/class/infiniband"  # one entry per RDMA device (verbs: InfiniBand, RoCE, EFA)

_env_lock = threading.Lock()


def nixl_available() -> str:
    """'' when the NIXL bindings import, else why not."""
    try:
        import nixl_cu12._bindings  # noqa: F401
    except Exception as exc:  # ImportError, or a shared library that does not load
        return f"{type(exc).__name__}: {exc}"
    return ""


def nixl_plugins() -> list[str]:
    """The backend plugins this NIXL build ships (UCX, POSIX, GDS, OBJ, ...); [] without NIXL.
    Shipping a plugin is not being usable: ``usable_backends`` tries to instantiate each."""
    if nixl_available():
        return []
    agent = _make_agent(f"kvpool-probe-{secrets.token_hex(4)}", progress_thread=False, loopback=True, backend="")
    return sorted(str(p) for p in agent.getAvailPlugins())


def usable_backends(
    candidates: Sequence[str] = ("UCX", "POSIX", "OBJ", "GDS", "GDS_MT", "LIBFABRIC"),
) -> dict[str, str]:
    """Each candidate backend -> "" when an agent can instantiate it here, else why not."""
    why = nixl_available()
    if why:
        return {name: why for name in candidates}
    plugins = set(nixl_plugins())
    result: dict[str, str] = {}
    for name in candidates:
        if name not in plugins:
            result[name] = "plugin not shipped"
            continue
        try:
            _make_agent(f"kvpool-probe-{secrets.token_hex(4)}", progress_thread=False, loopback=True, backend=name)
            result[name] = ""
        except Exception as exc:  # a backend whose library or device is missing refuses here
            result[name] = f"{type(exc).__name__}: {exc}"
    return result


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def ucx_overrides(loopback: bool, environ: Mapping[str, str], rdma_sysfs: str = RDMA_SYSFS) -> dict[str, str]:
    """The UCX settings an agent is created with, beyond what the operator set in ``environ``.

    - ``UCX_NET_DEVICES=lo`` when every peer is on loopback: UCX's TCP transport otherwise
      listens on every interface.
    - ``UCX_MODULES=^ib`` on a host without RDMA devices: nixl-cu12 1.5.1 bundles its own libnl,
      and its InfiniBand module loads the system's verbs providers, which link the system libnl;
      with both loaded the process segfaults at exit (in ``rtnl_tc_unregister``), after every
      test passed. Without RDMA hardware that module has nothing to drive anyway."""
    overrides: dict[str, str] = {}
    if loopback and "UCX_NET_DEVICES" not in environ:
        overrides["UCX_NET_DEVICES"] = "lo"
    has_rdma = os.path.isdir(rdma_sysfs) and bool(os.listdir(rdma_sysfs))
    if not has_rdma and "UCX_MODULES" not in environ:
        overrides["UCX_MODULES"] = "^ib"
    return overrides


def _make_agent(name: str, progress_thread: bool, loopback: bool, backend: str = "UCX") -> Any:
    """A NIXL agent (bindings level: the Python wrapper fixes the progress thread's delay at 0),
    created with ``ucx_overrides`` in the environment: UCX reads it once, when the backend's
    context is made, so the variables are set for that call only."""
    from nixl_cu12 import _bindings as nixl  # type: ignore[import-untyped]

    config = nixl.nixlAgentConfig()
    config.useProgThread = progress_thread
    config.useListenThread = False  # metadata travels through the directory / the data connection
    config.pthrDelay = PROGRESS_DELAY_US if progress_thread else 0
    config.syncMode = nixl.NIXL_THREAD_SYNC_RW  # reads of several peers run on several threads
    config.captureTelemetry = False
    with _env_lock:
        overrides = ucx_overrides(loopback, os.environ)
        os.environ.update(overrides)
        try:
            agent = nixl.nixlAgent(name, config)
            if backend:
                agent.createBackend(backend, {})
        finally:
            for key in overrides:
                os.environ.pop(key, None)
    return agent


def _descs(nixl: Any, rows: np.ndarray) -> Any:
    return nixl.nixlXferDList(nixl.DRAM_SEG, rows)


class _Agent:
    """One NIXL agent with the UCX backend: the few calls kvpool makes, typed, errors mapped."""

    def __init__(self, name: str, progress_thread: bool, loopback: bool) -> None:
        from nixl_cu12 import _bindings as nixl

        self._nixl = nixl
        self.name = name
        self._agent = _make_agent(name, progress_thread, loopback)
        self._lock = threading.Lock()
        self._remotes: dict[str, str] = {}  # peer -> loaded remote agent name

    def register(self, buffer: np.ndarray) -> Any:
        regs = self._nixl.nixlRegDList(self._nixl.DRAM_SEG, [(buffer.ctypes.data, buffer.nbytes, 0, "")])
        self._agent.registerMem(regs, [])
        return regs

    def deregister(self, regs: Any) -> None:
        try:
            self._agent.deregisterMem(regs, [])
        except Exception as exc:  # the agent is being torn down: nothing left to protect
            log.debug("nixl: deregistering failed: %s", exc)

    def metadata(self) -> bytes:
        return bytes(self._agent.getLocalMD())

    def remote(self, peer: str) -> str:
        with self._lock:
            return self._remotes.get(peer, "")

    def load_remote(self, peer: str, metadata: bytes) -> str:
        """Load a peer's agent metadata; returns its agent name (replacing an older one of ``peer``)."""
        if not metadata or len(metadata) > wire.MAX_NIXL_METADATA:
            raise InvalidArgument(f"NIXL metadata of {peer} is {len(metadata)} bytes")
        loaded = self._agent.loadRemoteMD(metadata)
        name = loaded.decode("utf-8", "replace") if isinstance(loaded, bytes) else str(loaded)
        with self._lock:
            old = self._remotes.get(peer)
            self._remotes[peer] = name
        if old and old != name:
            self._forget(old)
        return name

    def drop_remote(self, peer: str) -> None:
        with self._lock:
            name = self._remotes.pop(peer, "")
        if name:
            self._forget(name)

    def _forget(self, name: str) -> None:
        try:
            self._agent.invalidateRemoteMD(name)
        except Exception as exc:  # already gone
            log.debug("nixl: invalidating %s failed: %s", name, exc)

    def read(self, local: np.ndarray, remote: np.ndarray, remote_name: str) -> int:
        """Post one batched READ (rows of (address, length, 0)); returns its handle."""
        nixl = self._nixl
        handle = int(
            self._agent.createXferReq(nixl.NIXL_READ, _descs(nixl, local), _descs(nixl, remote), remote_name, "", [])
        )
        status = self._agent.postXferReq(handle, "")
        if status not in (nixl.NIXL_SUCCESS, nixl.NIXL_IN_PROG):
            self.release(handle)
            raise ConnectionError(f"NIXL refused to post the READ ({status})")
        return handle

    def state(self, handle: int) -> str:
        nixl = self._nixl
        try:
            status = self._agent.getXferStatus(handle)
        except Exception:  # nixlRemoteDisconnectError and friends: the peer is gone
            return STATE_ERROR
        if status == nixl.NIXL_SUCCESS:
            return STATE_DONE
        return STATE_BUSY if status == nixl.NIXL_IN_PROG else STATE_ERROR

    def release(self, handle: int) -> bool:
        """Release a transfer (cancelling it if it still runs); False = NIXL could not, it may still write."""
        try:
            status = self._agent.releaseXferReq(handle)
        except Exception as exc:
            log.debug("nixl: releasing transfer %x failed: %s", handle, exc)
            return False
        return bool(status == self._nixl.NIXL_SUCCESS)


@dataclass
class _Staging:
    """A connection's registered receive buffer, and the transfer that may still write into it."""

    buffer: np.ndarray
    regs: Any
    handle: int = 0  # a transfer that was not released: the buffer must outlive it


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
        self._agent: _Agent | None = None
        self._regs: Any = None
        self.transport_metadata = b""

    def start(self) -> None:
        host, _ = split_address(self._listen)
        agent = _Agent(f"kvpool-{secrets.token_hex(8)}", progress_thread=True, loopback=_is_loopback(host))
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
        lease_id, views, metas = leased
        try:
            addresses = [wire.NIXL_ADDRESS.pack(np.frombuffer(view, dtype=np.uint8).ctypes.data) for view in views]
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


class NixlTransport(TcpTransport):
    """Reads by NIXL READ (one batched transfer per request), writes over TCP."""

    name = "nixl"
    read_op = wire.OP_NIXL_READ

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, token: str = "") -> None:
        super().__init__(timeout_s, token)  # AUTH runs on the TCP connection before NIXL_HELLO
        self._agent: _Agent | None = None
        self._agent_lock = threading.Lock()
        self._offered: dict[str, bytes] = {}  # peer -> metadata from the directory, not loaded yet
        self._plain: set[str] = set()  # peers that do not speak NIXL: read over TCP
        self._staging: dict[socket.socket, _Staging] = {}
        self._stuck: list[_Staging] = []  # staging of transfers NIXL could not cancel (yet)
        self.counters = {
            "nixl_reads": 0,  # batched NIXL READs that completed
            "metadata_from_directory": 0,  # peer agents loaded from what the directory published
            "metadata_from_peer": 0,  # ... fetched over the data connection (none published, or stale)
            "tcp_peers": 0,  # peers that do not speak NIXL, read over TCP
        }

    def learn_peer(self, peer: str, metadata: bytes) -> None:
        if metadata and len(metadata) <= wire.MAX_NIXL_METADATA:
            with self._lock:
                self._offered[peer] = metadata

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

    def _local_agent(self, peer: str) -> _Agent:
        with self._agent_lock:
            if self._agent is None:
                host, _ = split_address(peer)
                self._agent = _Agent(f"kvpool-reader-{secrets.token_hex(8)}", False, _is_loopback(host))
            return self._agent

    def _hello(self, sock: socket.socket, peer: str, want_metadata: bool, deadline: float) -> tuple[str, bytes]:
        wire.send_all(sock, wire.pack_header(wire.OP_NIXL_HELLO, int(want_metadata), bytes(16)), deadline)
        status, count, message = wire.recv_reply(sock, deadline)
        if status == wire.STATUS_BAD_REQUEST:  # "unknown op": a tcp / ucx node
            raise _NotNixl(f"peer {peer} does not serve NIXL reads: {message}")
        if status == wire.STATUS_UNAUTHENTICATED:
            raise Unauthenticated(f"data plane at {peer} refused NIXL_HELLO: {message}", hint="pass token=")
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
        if sock in self._staging or peer in self._plain:
            return sock, pooled
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        try:
            agent = self._local_agent(peer)
            name, _ = self._hello(sock, peer, False, deadline)
            if agent.remote(peer) != name:
                with self._lock:
                    offered = self._offered.pop(peer, b"")
                if offered and agent.load_remote(peer, offered) == name:
                    self.counters["metadata_from_directory"] += 1
                else:  # none published, or stale (the node restarted with a new agent)
                    _, metadata = self._hello(sock, peer, True, deadline)
                    if agent.load_remote(peer, metadata) != name:
                        raise InvalidArgument(f"peer {peer}'s NIXL metadata names another agent than {name}")
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
            self._staging[sock] = _Staging(np.empty(0, dtype=np.uint8), None)
        return sock, pooled

    def _staging_for(self, agent: _Agent, staging: _Staging, nbytes: int) -> np.ndarray:
        if staging.buffer.nbytes < nbytes:
            if staging.regs is not None:
                agent.deregister(staging.regs)
                staging.regs = None
            staging.buffer = np.empty(0, dtype=np.uint8)
            buffer = np.empty(nbytes, dtype=np.uint8)
            staging.regs = agent.register(buffer)
            staging.buffer = buffer
        return staging.buffer[:nbytes]

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
            staging = self._staging.get(sock)
        if staging is None:  # a plain TCP peer
            return super()._receive(sock, peer, metas, dst, progress, deadline)
        if not metas:
            return -1
        agent = self._local_agent(peer)
        raw = wire.recv_exact(sock, len(metas) * wire.NIXL_ADDRESS.size, deadline)
        lengths = np.array([length for length, _ in metas], dtype=np.uint64)
        starts = np.concatenate(([0], np.cumsum(lengths))).astype(np.uint64)
        buffer = self._staging_for(agent, staging, int(starts[-1]))
        local = np.zeros((len(metas), 3), dtype=np.uint64)
        local[:, 0] = buffer.ctypes.data + starts[:-1]
        local[:, 1] = lengths
        remote = np.zeros((len(metas), 3), dtype=np.uint64)
        remote[:, 0] = np.frombuffer(raw, dtype="<u8")
        remote[:, 1] = lengths
        staging.handle = agent.read(local, remote, agent.remote(peer))
        self._wait(agent, staging, peer, deadline)
        self.counters["nixl_reads"] += 1
        try:
            bad = copy_verified(buffer, [int(x) for x in starts], metas, dst, progress)
            self.bytes_received += int(starts[progress[0]])
            return bad
        finally:
            # the server holds its lease until this: sent after the copies, so a failure here
            # (the server died just now) still leaves every verified block counted
            wire.send_all(sock, wire.pack_header(wire.OP_NIXL_DONE, len(metas), bytes(16)), deadline)
            if staging.buffer.nbytes > STAGING_KEEP_BYTES and staging.regs is not None:
                agent.deregister(staging.regs)
                staging.regs, staging.buffer = None, np.empty(0, dtype=np.uint8)

    def _wait(self, agent: _Agent, staging: _Staging, peer: str, deadline: float) -> None:
        """Poll the transfer to its end (polling also progresses the reader's UCX worker)."""
        polls = 0
        while True:
            state = agent.state(staging.handle)
            if state != STATE_BUSY:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the NIXL READ from {peer} did not complete in time")
            polls += 1
            if polls % 1024 == 0:
                time.sleep(0)  # let other threads (and their transfers) run
        handle, staging.handle = staging.handle, 0
        if not agent.release(handle):
            staging.handle = handle  # finished but not released: retried when the connection goes
        if state == STATE_ERROR:
            agent.drop_remote(peer)  # a dead or restarted peer: load its agent again next time
            raise ConnectionError(f"the NIXL READ from {peer} failed (peer gone?)")

    def _discard(self, sock: socket.socket) -> None:
        with self._lock:
            staging = self._staging.pop(sock, None)
        if staging is not None and self._agent is not None:
            self._retire(self._agent, staging)
        sock.close()

    def _retire(self, agent: _Agent, staging: _Staging) -> None:
        """Free a connection's staging buffer, unless a transfer may still write into it."""
        if staging.handle and not agent.release(staging.handle):
            with self._lock:
                self._stuck.append(staging)  # kept alive, never reused: see the module docstring
            log.warning("nixl: a cancelled READ is still running; its staging buffer is kept until it ends")
            return
        staging.handle = 0
        if staging.regs is not None:
            agent.deregister(staging.regs)
            staging.regs = None
        with self._lock:
            stuck, self._stuck = self._stuck, []
        for old in stuck:
            if agent.release(old.handle):
                old.handle = 0
                if old.regs is not None:
                    agent.deregister(old.regs)
            else:
                with self._lock:
                    self._stuck.append(old)

    def close(self) -> None:
        super().close()
        with self._lock:
            left = len(self._stuck)
        if left:
            log.warning("nixl: %d cancelled READs never ended; their staging buffers stay allocated", left)


class _NotNixl(Unavailable):
    """The peer answered NIXL_HELLO with an error: it is a tcp / ucx node."""


def require_nixl() -> None:
    """Raise ``Unavailable`` naming the install command when NIXL cannot be imported."""
    why = nixl_available()
    if why:
        raise Unavailable(f"the nixl data plane is not installed here ({why})", hint=INSTALL_HINT)
