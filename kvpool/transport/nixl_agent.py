"""NIXL agents for kvpool: probing what this host's NIXL build can do, and the few agent calls
the data plane makes (``Agent``), typed and with NIXL's errors mapped.

Kept apart from ``kvpool.transport.nixl`` (the server and the reader) so ``kvpool inspect doctor``
can ask which backends are usable without pulling the data plane in. The bindings are imported
lazily: this module imports without NIXL installed.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvpool.core.errors import InvalidArgument
from kvpool.transport import wire

log = logging.getLogger("kvpool.transport")

#: the progress thread of the node's agent sleeps this long when idle: 0 (NIXL's Python default)
#: spins a core per daemon; 100 us still cost ~40% of a core; 1000 us measured as fast here
PROGRESS_DELAY_US = 1000
STATE_DONE, STATE_BUSY, STATE_ERROR = "done", "busy", "error"
RDMA_SYSFS = "/sys/class/infiniband"  # one entry per RDMA device (verbs: InfiniBand, RoCE, EFA)
#: the backends ``usable_backends`` tries by default (what nixl-cu12 1.5.1 may ship)
CANDIDATE_BACKENDS = ("UCX", "POSIX", "OBJ", "GDS", "GDS_MT", "LIBFABRIC")

_env_lock = threading.Lock()


def has_rdma(rdma_sysfs: str = RDMA_SYSFS) -> bool:
    """Whether this host has RDMA devices (a NIC may then write into registered memory on its
    own, without any progress call of ours)."""
    return os.path.isdir(rdma_sysfs) and bool(os.listdir(rdma_sysfs))


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
    agent = make_agent(f"kvpool-probe-{secrets.token_hex(4)}", progress_thread=False, loopback=True, backend="")
    return sorted(str(p) for p in agent.getAvailPlugins())


def usable_backends(candidates: Sequence[str] = CANDIDATE_BACKENDS) -> dict[str, str]:
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
            make_agent(f"kvpool-probe-{secrets.token_hex(4)}", progress_thread=False, loopback=True, backend=name)
            result[name] = ""
        except Exception as exc:  # a backend whose library or device is missing refuses here
            result[name] = f"{type(exc).__name__}: {exc}"
    return result


def is_loopback(host: str) -> bool:
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
    if not has_rdma(rdma_sysfs) and "UCX_MODULES" not in environ:
        overrides["UCX_MODULES"] = "^ib"
    return overrides


#: what ``import ucxx`` writes into ``os.environ`` (when unset) that NIXL's own UCX must not read:
#: with UCX_RNDV_THRESH=8192 a NIXL READ of 4 MiB blocks on loopback measured 0.2-0.3 GB/s
#: against 3.9-4.5 GB/s without it (bindings only, two processes, same minutes)
UCXX_ENV_DEFAULTS = {"UCX_RNDV_THRESH": "8192"}


def ucxx_injected(environ: Mapping[str, str], modules: Mapping[str, object]) -> list[str]:
    """The variables of ``UCXX_ENV_DEFAULTS`` that ucxx (imported in this process) put in ``environ``
    (a variable holding exactly ucxx's default while ucxx is loaded is taken for its)."""
    if "ucxx" not in modules:
        return []
    return [key for key, value in UCXX_ENV_DEFAULTS.items() if environ.get(key) == value]


def make_agent(name: str, progress_thread: bool, loopback: bool, backend: str = "UCX") -> Any:
    """A NIXL agent (bindings level: the Python wrapper fixes the progress thread's delay at 0),
    created with ``ucx_overrides`` in the environment and without what ucxx put there
    (``ucxx_injected``): UCX reads it once, when the backend's context is made, so the
    variables are changed for that call only."""
    from nixl_cu12 import _bindings as nixl  # type: ignore[import-untyped]

    config = nixl.nixlAgentConfig()
    config.useProgThread = progress_thread
    config.useListenThread = False  # metadata travels through the directory / the data connection
    config.pthrDelay = PROGRESS_DELAY_US if progress_thread else 0
    config.syncMode = nixl.NIXL_THREAD_SYNC_RW  # reads of several peers run on several threads
    config.captureTelemetry = False
    with _env_lock:
        overrides = ucx_overrides(loopback, os.environ)
        hidden = {key: os.environ.pop(key) for key in ucxx_injected(os.environ, sys.modules)}
        os.environ.update(overrides)
        try:
            agent = nixl.nixlAgent(name, config)
            if backend:
                agent.createBackend(backend, {})
        finally:
            for key in overrides:
                os.environ.pop(key, None)
            os.environ.update(hidden)
    return agent


def _descs(nixl: Any, rows: np.ndarray) -> Any:
    return nixl.nixlXferDList(nixl.DRAM_SEG, rows)


class Agent:
    """One NIXL agent with the UCX backend: the few calls kvpool makes, typed, errors mapped."""

    def __init__(self, name: str, progress_thread: bool, loopback: bool) -> None:
        from nixl_cu12 import _bindings as nixl

        self._nixl = nixl
        self.name = name
        self._agent = make_agent(name, progress_thread, loopback)
        self._lock = threading.Lock()
        self._remotes: dict[str, str] = {}  # peer -> loaded remote agent name

    def register(self, buffer: np.ndarray) -> Any:
        return self.register_spans([(buffer.ctypes.data, buffer.nbytes)])

    def register_spans(self, spans: Sequence[tuple[int, int]]) -> Any:
        """Register host memory ((address, bytes) spans) for transfers; one call, one handle.
        Without RDMA devices UCX only records the ranges (~0.25 ms for 128 MiB here)."""
        regs = self._nixl.nixlRegDList(self._nixl.DRAM_SEG, [(address, nbytes, 0, "") for address, nbytes in spans])
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
        """Release a transfer; call it only on one that ended (``state`` not busy). NIXL 1.5.1's UCX
        backend "releases" a running READ too, returning success, but ``ucp_request_cancel`` does
        not stop an RMA get: its bytes may still land. False = NIXL refused."""
        try:
            status = self._agent.releaseXferReq(handle)
        except Exception as exc:
            log.debug("nixl: releasing transfer %x failed: %s", handle, exc)
            return False
        return bool(status == self._nixl.NIXL_SUCCESS)
