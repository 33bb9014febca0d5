"""A cluster of real processes on 127.0.0.1: etcd, directory instances and node daemons,
each on free ports, each stopped by its PID. Used by the loopback tests, the cluster
benchmark and demos; nothing here is needed in production.
"""

from __future__ import annotations

import contextlib
import json
import os
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

from kvpool.core.errors import Unavailable
from kvpool.proto import directory_pb2, directory_pb2_grpc, pool_pb2, pool_pb2_grpc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def wait_until(
    check: Callable[[], bool], timeout_s: float, what: str, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise Unavailable(f"{what}: process exited with {proc.returncode}")
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


class LocalCluster:
    """Start and stop the processes of a loopback cluster under ``workdir``."""

    def __init__(self, workdir: str, env: dict[str, str] | None = None, token: str = "") -> None:
        """``token``: what the readiness probes present to processes started with
        credentials (the cluster token or an admin's)."""
        self.workdir = workdir
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.env = {**os.environ, **(env or {})}
        self.procs: list[Proc] = []
        self.etcd_address = ""

    def _spawn(self, name: str, argv: Sequence[str], address: str, etcd: bool = False) -> Proc:
        """Start ``argv`` logging to ``<workdir>/<name>.log``; ``etcd`` passes ``--etcd`` when
        this cluster runs one."""
        if etcd and self.etcd_address:
            argv = [*argv, "--etcd", self.etcd_address]
        log_path = os.path.join(self.workdir, f"{name}.log")
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=self.env)
        proc = Proc(name, popen, address, log_path)
        self.procs.append(proc)
        return proc

    def start_etcd(self) -> Proc:
        binary = etcd_binary()
        if binary is None:
            raise Unavailable("etcd is not installed", hint="apt-get install etcd-server")
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
        proc = self._spawn("etcd", argv, f"127.0.0.1:{client}")
        wait_until(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{client}/health", timeout=1).status == 200,
            20,
            "etcd",
            proc.popen,
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
        proc = self._spawn(name, argv, address, etcd)

        def ready() -> bool:
            with grpc.insecure_channel(address) as ch:
                reply = directory_pb2_grpc.DirectoryStub(ch).Leader(
                    directory_pb2.LeaderRequest(), timeout=1, metadata=self._metadata
                )
                return bool(reply.is_leader) or not wait_leader

        wait_until(ready, 20, f"directory {name}", proc.popen)
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
        proc = self._spawn(name, argv, address, etcd)

        def ready() -> bool:
            with grpc.insecure_channel(address) as ch:
                stats = pool_pb2_grpc.PoolStub(ch).Stats(pool_pb2.StatsRequest(), timeout=1, metadata=self._metadata)
                proc.extra["arena_path"] = json.loads(stats.json).get("arena_path", "")
                return True

        wait_until(ready, 30, f"node {name}", proc.popen)
        if directories:  # registration is asynchronous: wait until a directory lists the node

            def registered() -> bool:
                for directory in directories:
                    with grpc.insecure_channel(directory) as ch:
                        try:
                            nodes = directory_pb2_grpc.DirectoryStub(ch).Nodes(
                                directory_pb2.NodesRequest(), timeout=1, metadata=self._metadata
                            )
                        except grpc.RpcError:
                            continue
                        if any(n.node_id == name for n in nodes.nodes):
                            return True
                return False

            wait_until(registered, 30, f"node {name} registered", proc.popen)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                proc.kill(signal.SIGTERM)
            if proc.popen.poll() is None:
                proc.kill(signal.SIGKILL)
        self.procs.clear()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
