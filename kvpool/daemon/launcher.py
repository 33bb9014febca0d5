"""Start, watch and stop the processes of a cluster on 127.0.0.1: etcd, directory
instances, node daemons (and, for ``kvpool demo``, engines and the router), each on free
ports, each stopped by its PID.

One implementation for everything that starts a local cluster: ``kvpool cluster up``,
``kvpool demo``, the loopback tests and the cluster benchmark. What it guarantees:

* every child logs to ``<workdir>/<name>.log`` and is waited for until it answers (a child
  that exits while starting raises ``ChildExited`` with the tail of its log, never a hang);
* ``crashed()`` names the children that exited since; a supervisor polls it;
* ``stop()`` ends every child (SIGTERM, then SIGKILL) in reverse start order and removes the
  shared-memory arena of a node that could not remove it itself: no process and no arena
  file are left behind;
* with ``die_with_parent`` (the CLI), children get SIGTERM from the kernel when the
  supervisor dies, even by SIGKILL (``PR_SET_PDEATHSIG``, Linux), and run in their own
  process group, so a terminal's Ctrl-C reaches only the supervisor.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from kvpool.core.errors import InvalidArgument, Unavailable
from kvpool.proto import directory_pb2, directory_pb2_grpc, pool_pb2, pool_pb2_grpc
from kvpool.rpc.auth import make_channel

#: the lowest port ``free_port`` draws from; it draws below the kernel's ephemeral range
FREE_PORT_FLOOR = 10_000
FREE_PORT_TRIES = 64


def _ephemeral_floor() -> int:
    """The first port of the kernel's ephemeral range (Linux default 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a server about to be started on it.

    Drawn at random *below* the kernel's ephemeral range: a port the kernel picked (``bind`` to
    port 0) comes from the range every outgoing connection and every other port-0 server of the
    host also draws from, so between this call and the server's own ``bind`` it can be taken by
    one of them -- and a process that then probes "its" port may find another process's server
    there (seen in parallel test runs). Ports below the range are taken only by explicit binds.
    Falls back to a kernel-picked port when that range is too small to draw from."""
    top = _ephemeral_floor()
    if top - FREE_PORT_FLOOR >= 1_000:
        for _ in range(FREE_PORT_TRIES):
            port = FREE_PORT_FLOOR + secrets.randbelow(top - FREE_PORT_FLOOR)
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))  # no SO_REUSEADDR: a port in TIME_WAIT is not free either
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the TCP socket listening on ``port`` (True where this host
    cannot tell: no /proc). A readiness probe that only asks "does something answer on the port"
    can be answered by another process that took the port first (``free_port`` reserves nothing):
    then ours has failed to bind and is exiting, and the caller must not talk to the other one."""
    if not os.path.isdir("/proc/net"):
        return True
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as fh:
            next(fh, None)
            for line in fh:  # local_address (hex ip:port), state (0A = LISTEN), inode
                fields = line.split()
                if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return False  # nothing listens on the port yet
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False  # the process is gone
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(os.path.join(fd_dir, fd)) in inodes:
                return True
    return False


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll ``check`` until it holds or ``timeout_s`` passes; its last answer. For state that
    converges asynchronously (events, heartbeats) in tests and demos: the caller asserts it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


LOG_TAIL_BYTES = 4000  # of a crashed child's log, shown in the error


class ChildExited(Unavailable):
    """A child process of the cluster exited (while starting, or later)."""


def log_tail(path: str, limit_bytes: int = LOG_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - limit_bytes))
            return fh.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def wait_until(
    check: Callable[[], bool],
    timeout_s: float,
    what: str,
    proc: subprocess.Popen[bytes] | None = None,
    log_path: str = "",
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_tail(log_path) if log_path else ""
            raise ChildExited(
                f"{what}: process exited with {proc.returncode}" + (f"; end of {log_path}:\n{tail}" if tail else ""),
                hint=f"read {log_path}" if log_path else "",
            )
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.05)
    raise Unavailable(f"{what} not ready after {timeout_s} s")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    address: str
    log_path: str
    extra: dict[str, str] = field(default_factory=dict)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(10)
        arena = self.extra.get("arena_path", "")
        if arena and self.popen.poll() is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(arena)  # a SIGKILLed node cannot remove its shared-memory arena itself

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def describe(self) -> dict[str, object]:
        """What ``kvpool cluster status`` and ``down`` need: JSON-able."""
        return {"name": self.name, "pid": self.popen.pid, "address": self.address, "log": self.log_path, **self.extra}


#: ``python -I -S -c _CHILD_SHIM PARENT_PID CPUS PROGRAM ARGS...``: the child sets its own CPU set
#: and, with a parent pid, SIGTERM on that parent's death (``PR_SET_PDEATHSIG``, kept across
#: ``execve``; a parent that died before the call is caught by the ``getppid`` check), then
#: becomes PROGRAM. Not a ``preexec_fn``: that runs Python between fork and exec in a child of
#: a threaded parent (the supervisor's gRPC probes), where a lock another thread held at the
#: fork can never be released (seen in CI: a node whose log stayed empty for the 120 s of its
#: start). The shim is a fresh isolated interpreter without ``site``: ~15 ms per child; it
#: gives SIGPIPE and SIGXFSZ back their default action before the exec (the interpreter sets
#: them to ignored, and an ignored signal stays ignored across ``execve``).
_CHILD_SHIM = """
import os, signal, sys
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
parent, cpus, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
if cpus:
    os.sched_setaffinity(0, {int(c) for c in cpus.split(',')})
if parent and sys.platform.startswith('linux'):
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM
    if os.getppid() != parent:
        sys.exit(1)
os.execvp(argv[0], argv)
"""


def _child_argv(argv: Sequence[str], cpus: Sequence[int] | None, die_with_parent: bool) -> list[str]:
    """``argv`` behind ``_CHILD_SHIM`` when the child needs a CPU set or to die with its parent."""
    if not cpus and not die_with_parent:
        return list(argv)
    parent = os.getpid() if die_with_parent else 0
    return [sys.executable, "-I", "-S", "-c", _CHILD_SHIM, str(parent), ",".join(map(str, cpus or ())), *argv]


class LocalCluster:
    """Start and stop the processes of a loopback cluster under ``workdir``."""

    def __init__(
        self,
        workdir: str,
        env: dict[str, str] | None = None,
        token: str = "",
        die_with_parent: bool = False,
        tls_root_certs: bytes | None = None,
    ) -> None:
        """``token``: what the readiness probes present to processes started with
        credentials (the cluster token or an admin's); ``tls_root_certs``: the CA they verify
        processes started with TLS against (then every probe dials TLS). ``die_with_parent``:
        see the module docstring (only from the main thread: the kernel signals when the
        forking *thread* ends)."""
        self.workdir = workdir
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._root_certs = tls_root_certs
        self.env = {**os.environ, **(env or {})}
        self.procs: list[Proc] = []
        self.etcd_address = ""
        self.die_with_parent = die_with_parent

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        address: str,
        etcd: bool = False,
        cpus: Sequence[int] | None = None,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """Start ``argv`` logging to ``<workdir>/<name>.log``; ``etcd`` passes ``--etcd`` when
        this cluster runs one; ``cpus`` pins the process (and its threads) to those cores."""
        if etcd and self.etcd_address:
            argv = [*argv, "--etcd", self.etcd_address]
        log_path = os.path.join(self.workdir, f"{name}.log")
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                _child_argv(argv, cpus, self.die_with_parent),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**self.env, **(env or {})},
                # a terminal's Ctrl-C reaches the supervisor alone, which stops children in order
                process_group=0 if self.die_with_parent else None,
            )
        proc = Proc(name, popen, address, log_path)
        if cpus:
            proc.extra["cpus"] = ",".join(map(str, cpus))
        self.procs.append(proc)
        return proc

    def _channel(self, address: str) -> grpc.Channel:
        """A probe's channel: TLS against ``tls_root_certs`` when the cluster was given them."""
        channel: grpc.Channel = make_channel(address, (), self._root_certs)
        return channel

    def wait_ready(self, proc: Proc, check: Callable[[], bool], timeout_s: float) -> None:
        """Wait until ``check`` holds; ``ChildExited`` (with its log's tail) if ``proc`` exits first."""
        wait_until(check, timeout_s, proc.name, proc.popen, proc.log_path)

    def crashed(self) -> list[Proc]:
        """Children that exited (by themselves or killed by someone else)."""
        return [p for p in self.procs if p.popen.poll() is not None]

    def describe(self) -> list[dict[str, object]]:
        return [p.describe() for p in self.procs]

    def start_etcd(self) -> Proc:
        binary = etcd_binary()
        if binary is None:
            raise Unavailable(
                "etcd is not installed (no etcd on PATH): a pool of more than one node needs it",
                hint="apt-get install etcd-server, or start the embedded single-process pool (--nodes 1)",
            )
        client, peer = free_port(), free_port()
        data_dir = os.path.join(self.workdir, f"etcd-{client}")
        argv = [
            binary,
            "--name",
            "kvpool-test",
            "--data-dir",
            data_dir,
            "--listen-client-urls",
            f"http://127.0.0.1:{client}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{client}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"kvpool-test=http://127.0.0.1:{peer}",
            "--log-level",
            "warn",
        ]
        proc = self.spawn("etcd", argv, f"127.0.0.1:{client}")
        self.wait_ready(
            proc, lambda: urllib.request.urlopen(f"http://127.0.0.1:{client}/health", timeout=1).status == 200, 20
        )
        self.etcd_address = proc.address
        return proc

    def start_directory(
        self,
        name: str = "directory",
        data_dir: str = "",
        etcd: bool = True,
        node_ttl_ms: int = 3000,
        port: int = 0,
        wait_leader: bool = True,
        extra: Sequence[str] = (),
    ) -> Proc:
        address = f"127.0.0.1:{port or free_port()}"
        argv = [
            sys.executable,
            "-m",
            "kvpool.cli.main",
            "directory",
            "--listen",
            address,
            "--node-ttl-ms",
            str(node_ttl_ms),
            "--election-ttl-s",
            "1",
            "--log-level",
            "INFO",
            *extra,
        ]
        if data_dir:
            argv += ["--data-dir", data_dir]
        proc = self.spawn(name, argv, address, etcd)

        def ready() -> bool:
            with self._channel(address) as ch:
                reply = directory_pb2_grpc.DirectoryStub(ch).Leader(
                    directory_pb2.LeaderRequest(), timeout=1, metadata=self._metadata
                )
                return bool(reply.is_leader) or not wait_leader

        self.wait_ready(proc, ready, 20)
        return proc

    def start_node(
        self,
        name: str,
        directories: Sequence[str] = (),
        etcd: bool = True,
        host: str = "",
        capacity: str = "256MiB",
        slab: str = "16MiB",
        transport: str = "tcp",
        extra: Sequence[str] = (),
        port: int = 0,
    ) -> Proc:
        address = f"127.0.0.1:{port or free_port()}"
        argv = [
            sys.executable,
            "-m",
            "kvpool.cli.main",
            "serve",
            "--listen",
            address,
            "--node-id",
            name,
            "--capacity-bytes",
            capacity,
            "--slab-bytes",
            slab,
            "--transport",
            transport,
            "--heartbeat-interval-ms",
            "200",
            "--liveness-ttl-s",
            "2",
            "--host-name",
            host or name,
            *extra,
        ]
        if directories:
            argv += ["--directory", ",".join(directories)]
        proc = self.spawn(name, argv, address, etcd)

        def ready() -> bool:
            with self._channel(address) as ch:
                stats = pool_pb2_grpc.PoolStub(ch).Stats(pool_pb2.StatsRequest(), timeout=1, metadata=self._metadata)
            # only our node's answer counts: its arena path is what kill() unlinks after a SIGKILL
            if not listens_on(proc.popen.pid, int(address.rsplit(":", 1)[1])):
                return False
            proc.extra["arena_path"] = json.loads(stats.json).get("arena_path", "")
            return True

        self.wait_ready(proc, ready, 30)
        if directories:  # registration is asynchronous: wait until a directory lists the node

            def registered() -> bool:
                for directory in directories:
                    with self._channel(directory) as ch:
                        try:
                            nodes = directory_pb2_grpc.DirectoryStub(ch).Nodes(
                                directory_pb2.NodesRequest(), timeout=1, metadata=self._metadata
                            )
                        except grpc.RpcError:
                            continue
                        if any(n.node_id == name for n in nodes.nodes):
                            return True
                return False

            wait_until(registered, 30, f"node {name} registered", proc.popen, proc.log_path)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                proc.kill(signal.SIGTERM)
            if proc.popen.poll() is None:
                proc.kill(signal.SIGKILL)
            proc.kill()  # exited: reaps it and removes an arena it left (a crash, a SIGKILL)
        self.procs.clear()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class PoolLayout:
    """What ``start_pool`` starts: ``nodes`` == 1 is the embedded node+directory (no etcd);
    more is etcd + one directory + that many nodes, each its own host name."""

    nodes: int = 1
    capacity_bytes: str = "256MiB"
    slab_bytes: str = "16MiB"
    # TLS on every control plane (the directory's and the nodes'): a certificate for
    # 127.0.0.1, its key, and the CA that signed it ("" = the certificate itself, self-signed)
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise InvalidArgument(f"a pool needs at least one node, got {self.nodes}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise InvalidArgument("TLS needs both --tls-cert-file and --tls-key-file", hint="give both, or neither")

    @property
    def ca_file(self) -> str:
        return self.tls_ca_file or self.tls_cert_file

    def listener_arguments(self) -> list[str]:
        """TLS on a control-plane listener (the directory's or a node's)."""
        if not self.tls_cert_file:
            return []
        return ["--tls-cert-file", self.tls_cert_file, "--tls-key-file", self.tls_key_file]

    def node_arguments(self, with_directory: bool) -> list[str]:
        """A node's TLS flags: its control and data planes (a ``ClusterClient`` given a CA
        dials both over TLS), and the directory's CA when it has one."""
        if not self.tls_cert_file:
            return []
        directory = ["--directory-tls-ca", self.ca_file] if with_directory else []
        return [*self.listener_arguments(), "--data-tls", *directory]

    def directory_arguments(self) -> list[str]:
        """The directory's TLS flags: its listener, and the nodes' CA (forwards)."""
        if not self.tls_cert_file:
            return []
        return [*self.listener_arguments(), "--node-tls-ca", self.ca_file]


@dataclass(frozen=True)
class PoolAddresses:
    nodes: tuple[str, ...]
    directory: str  # "" when embedded (the node is its own directory)
    etcd: str  # "" without etcd


def start_pool(cluster: LocalCluster, layout: PoolLayout) -> PoolAddresses:
    """Start the pool processes of ``layout`` in ``cluster``; ``stop()`` ends them."""
    if layout.nodes == 1:
        node_tls = layout.node_arguments(with_directory=False)
        node = cluster.start_node("node-0", capacity=layout.capacity_bytes, slab=layout.slab_bytes, extra=node_tls)
        return PoolAddresses((node.address,), "", "")
    cluster.start_etcd()
    directory = cluster.start_directory(extra=layout.directory_arguments())
    node_tls = layout.node_arguments(with_directory=True)
    nodes = tuple(
        cluster.start_node(
            f"node-{i}", [directory.address], capacity=layout.capacity_bytes, slab=layout.slab_bytes, extra=node_tls
        ).address
        for i in range(layout.nodes)
    )
    return PoolAddresses(nodes, directory.address, cluster.etcd_address)
