"""Shared test helpers: start a real ``kvpool serve`` daemon as a subprocess on loopback.

``start_daemon`` is a plain function (usable from fixtures of any scope, or from a test
that needs two daemons or a restart); ``pool_daemon`` is the function-scoped fixture
most tests want. Every daemon binds 127.0.0.1 on a free port, keeps its arena in a
private temporary directory (under /dev/shm when it exists), writes stderr to a temp
file, and is stopped by PID (SIGTERM, then SIGKILL) in teardown.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import pytest

from kvpool.core import invariants

# Debug invariants on for every store and directory a test builds in this process: each
# checks its own rules after each operation (kvpool/core/invariants.py). Set before anything
# imports the stores: the checks are attached when their classes are. Every process a test
# starts (daemons, directories, ``kvpool cluster up`` and its children) inherits
# KVPOOL_DEBUG_INVARIANTS=sampled: they check too, at a bounded share of their time (a full
# walk after every operation over a daemon's thousands of blocks would make a bulk test
# quadratic); KVPOOL_DEBUG_INVARIANTS=1 in a test's env makes one check every operation.
invariants.set_enabled(True)
os.environ[invariants.ENV_VAR] = "sampled"

from kvpool.daemon.cluster_local import LocalCluster, free_port  # noqa: E402  (after the switch, on purpose)
from kvpool.daemon.launcher import listens_on  # noqa: E402

__all__ = ["free_port"]  # tests import it from here

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PYTHON = sys.executable
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
_LIVE: list[DaemonHandle] = []  # every daemon started in this session, cleaned up at its end


@dataclass
class DaemonHandle:
    """A running ``kvpool serve`` subprocess."""

    address: str
    port: int
    proc: subprocess.Popen[bytes]
    arena_dir: str
    stderr_path: str
    argv: list[str] = field(default_factory=list)
    _stderr_file: object = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        """Everything the daemon wrote to stderr so far."""
        try:
            return pathlib.Path(self.stderr_path).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def arena_files(self) -> list[str]:
        """Arena files currently in the daemon's arena directory."""
        folder = pathlib.Path(self.arena_dir)
        return sorted(str(p) for p in folder.glob("*.arena")) if folder.is_dir() else []

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM by PID, wait, then SIGKILL if it did not exit. Returns the exit code."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> int | None:
        """SIGKILL by PID (no cleanup: the arena file stays until ``cleanup``)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)
        return self.proc.returncode

    def cleanup(self) -> None:
        """Stop the daemon and remove its temporary directory and stderr file."""
        self.stop()
        fh = self._stderr_file
        if fh is not None:
            with contextlib.suppress(Exception):
                fh.close()  # type: ignore[attr-defined]
        shutil.rmtree(self.arena_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.stderr_path)


def _arena_parent() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _probe(address: str, tls_root_certs: bytes | None = None, pid: int = 0) -> bool:
    """True once the daemon answers a real Stats call (a daemon with credentials answers
    this token-less call UNAUTHENTICATED: that is an answer too). With ``pid``, only an answer
    from a socket process ``pid`` listens on counts (``listens_on``): under parallel runs
    another test's daemon could hold the port ours failed to bind, and a test must not talk to
    it (ours exits, and the caller reports why)."""
    import grpc

    from kvpool.proto import pool_pb2, pool_pb2_grpc

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            pass
    except OSError:
        return False
    if tls_root_certs is not None:
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=tls_root_certs))
    else:
        channel = grpc.insecure_channel(address)
    try:
        pool_pb2_grpc.PoolStub(channel).Stats(pool_pb2.StatsRequest(), timeout=2.0)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
            return False
    finally:
        channel.close()
    return not pid or listens_on(pid, int(port))


def start_daemon(
    *extra_args: str,
    capacity: str = "64MiB",
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    tls_root_certs: bytes | None = None,
) -> DaemonHandle:
    """Start ``kvpool serve`` on 127.0.0.1 and wait until it answers a Stats call.

    ``extra_args`` are appended to the command line (e.g. ``"--lease-ttl-ms", "300"``);
    ``env`` is added to a copy of the current environment. Pass ``port`` to restart a
    daemon on the same address. Raises RuntimeError with the daemon's stderr when it
    exits or does not answer within ``ready_timeout_s``. Call ``cleanup()`` when done.
    ``tls_root_certs`` (PEM): probe a daemon that serves TLS.
    """
    port = port or free_port()
    address = f"127.0.0.1:{port}"
    arena_dir = tempfile.mkdtemp(prefix="kvpool-test-", dir=_arena_parent())
    fd, stderr_path = tempfile.mkstemp(prefix="kvpool-daemon-", suffix=".stderr")
    stderr_file = os.fdopen(fd, "wb")
    argv = [
        PYTHON, "-m", "kvpool.cli.main", "serve",
        "--listen", address,
        "--capacity-bytes", capacity,
        "--arena-dir", arena_dir,
        *extra_args,
    ]  # fmt: skip
    full_env = dict(os.environ)
    for key in [k for k in full_env if k.startswith("KVPOOL_")]:
        del full_env[key]  # the developer's own settings must not leak into tests
    full_env[invariants.ENV_VAR] = "sampled"  # the daemon checks its invariants too (above)
    full_env.update(env or {})
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=full_env, stdout=subprocess.DEVNULL, stderr=stderr_file)
    handle = DaemonHandle(address, port, proc, arena_dir, stderr_path, argv, stderr_file)
    _LIVE.append(handle)
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if proc.poll() is not None:
            text = handle.stderr()
            handle.cleanup()
            raise RuntimeError(f"kvpool daemon on {address} exited with {proc.returncode} at start:\n{text}")
        if _probe(address, tls_root_certs, proc.pid):
            return handle
        if time.monotonic() > deadline:
            text = handle.stderr()
            handle.cleanup()
            raise RuntimeError(f"kvpool daemon on {address} not ready after {ready_timeout_s} s; stderr:\n{text}")
        time.sleep(0.05)


@pytest.fixture(scope="session", autouse=True)
def _stop_leftover_daemons() -> Iterator[None]:
    """Safety net: a daemon a test forgot to clean up is stopped (by PID) when the session ends."""
    yield
    for handle in _LIVE:
        handle.cleanup()


@pytest.fixture
def pool_daemon() -> Iterator[DaemonHandle]:
    """A fresh daemon (64 MiB arena) for one test, stopped by PID afterwards."""
    handle = start_daemon()
    try:
        yield handle
    finally:
        handle.cleanup()


@pytest.fixture
def daemon_factory() -> Iterator[object]:
    """``daemon_factory(*args, capacity=..., env=...)`` -> DaemonHandle; all are cleaned up afterwards."""
    started: list[DaemonHandle] = []

    def make(*extra_args: str, capacity: str = "64MiB", env: Mapping[str, str] | None = None,
             port: int | None = None, tls_root_certs: bytes | None = None) -> DaemonHandle:  # fmt: skip
        handle = start_daemon(*extra_args, capacity=capacity, env=env, port=port, tls_root_certs=tls_root_certs)
        started.append(handle)
        return handle

    try:
        yield make
    finally:
        for handle in reversed(started):
            handle.cleanup()


def writable_arena(client: object) -> object:
    """A writable numpy view of a same-host client's arena, made the way any process of the
    daemon's uid can (reopening the client's descriptor through /proc read-write): for tests
    that damage bytes after commit, since a client's own mapping is read-only (docs/security.md)."""
    import mmap

    import numpy as np

    arena = client._arena  # type: ignore[attr-defined]
    fd = os.open(f"/proc/self/fd/{arena.fd}", os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, arena.capacity_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return np.frombuffer(mapping, dtype=np.uint8)


@pytest.fixture
def three_nodes(tmp_path: pathlib.Path) -> Iterator[tuple[str, list[str]]]:
    """A real 3-node cluster on loopback (a directory and node-a, node-b, node-c, no etcd):
    (directory address, node addresses); stopped when the test ends."""
    with LocalCluster(str(tmp_path)) as cluster:
        directory = cluster.start_directory(etcd=False)
        nodes = [cluster.start_node(name, [directory.address], etcd=False) for name in ("node-a", "node-b", "node-c")]
        yield directory.address, [n.address for n in nodes]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The real-vLLM files first (minutes each: engines start slowly on a CPU). Under
    pytest-xdist (``tools/dev.sh test`` runs ``-n 3 --dist loadfile``) each starts on a worker
    of its own at once instead of last, where it would be the whole run's tail; the other
    files fill the workers around them. A stable sort: every other order is kept."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("vllm") else 1)
