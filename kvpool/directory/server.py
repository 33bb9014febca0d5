"""``kvpool directory``: the composition of the directory service.

State in memory (``DirectoryState``), persisted to RocksDB under ``data_dir`` when one is
given; node liveness from heartbeats and, with etcd, from each node's etcd lease; leader
election through etcd when endpoints are given (else this instance simply leads).
Background work (expiry, flush, election, etcd watch) runs under one ``Supervisor``.
TLS on the listener when ``tls_cert_file`` is set (``grpc.ssl_server_credentials``, as the
node); off loopback it refuses to start without credentials and TLS unless ``insecure``.
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvpool.core.clock import Clock, MonotonicClock
from kvpool.core.config import is_loopback_address
from kvpool.core.errors import InvalidArgument, Unavailable
from kvpool.core.fairness import TenantLimits
from kvpool.core.supervisor import Supervisor
from kvpool.directory.election import LeaderElection
from kvpool.directory.etcd import EtcdSession
from kvpool.directory.membership import MemberWatch
from kvpool.directory.metrics import DirectoryCollector
from kvpool.directory.service import DirectoryService
from kvpool.directory.state import DirectoryDB, DirectoryState
from kvpool.proto import directory_pb2
from kvpool.rpc.codec import server_options
from kvpool.rpc.credentials import load_credentials, load_root_certs, load_tls, load_token
from kvpool.rpc.metrics import ServiceMetrics
from kvpool.rpc.serving import add_typed_service

log = logging.getLogger("kvpool.directory.server")


@dataclass(frozen=True)
class DirectoryConfig:
    listen: str = "127.0.0.1:7440"
    advertise: str = ""  # address others use to reach this instance (default: listen)
    data_dir: str = ""  # RocksDB directory; empty = state in memory only
    etcd: tuple[str, ...] = ()
    cluster: str = "default"
    node_ttl_ms: int = 5_000  # a node without a heartbeat for this long is dropped
    election_ttl_s: int = 2
    flush_interval_ms: int = 1_000
    expire_interval_ms: int = 250
    grpc_workers: int = 16
    max_message_bytes: int = 64 << 20
    credentials_file: str = ""  # who may call (docs/security.md); "" = anyone, loopback only unless insecure
    cluster_token_file: str = ""  # the cluster token, presented to nodes when forwarding removes / pins
    tls_cert_file: str = ""  # PEM certificate chain of the listener; "" = plaintext (docs/security.md)
    tls_key_file: str = ""  # its PEM private key
    node_tls_ca_file: str = ""  # PEM CA the nodes' TLS control planes are verified with (forwards)
    insecure: bool = False  # allow a non-loopback listener without credentials and TLS
    metrics_listen: str = ""  # Prometheus GET /metrics, HOST:PORT; "" = off (docs/metrics.md)
    # per-tenant shares of the directory's workers and time (the node's --tenant-* options)
    tenant: TenantLimits = field(default_factory=TenantLimits)

    def __post_init__(self) -> None:
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"listen address {self.listen!r} is not HOST:PORT", hint="e.g. 127.0.0.1:7440")
        if self.node_ttl_ms <= 0 or self.election_ttl_s <= 0:
            raise InvalidArgument("node_ttl_ms and election_ttl_s must be positive")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise InvalidArgument("TLS needs both --tls-cert-file and --tls-key-file", hint="give both, or neither")
        missing = [
            what
            for what, ok in (("--credentials", self.credentials_file), ("--tls-cert-file", self.tls_cert_file))
            if not ok
        ]
        if missing and not self.insecure and not is_loopback_address(self.listen):
            # the node's rule (core/config.py): a bearer token in plaintext can be read off the wire
            raise InvalidArgument(
                f"refusing to listen on {self.listen} (not loopback) without {' and '.join(missing)}",
                hint="configure credentials and TLS (docs/security.md), keep it on 127.0.0.1, "
                "or pass --insecure on a network you trust",
            )
        if self.metrics_listen and not self.insecure and not is_loopback_address(self.metrics_listen):
            raise InvalidArgument(
                f"refusing to serve metrics on {self.metrics_listen} (not loopback): /metrics has no authentication",
                hint="keep --metrics-listen on 127.0.0.1 (scrape through a proxy), or pass --insecure",
            )


class DirectoryServer:
    def __init__(self, config: DirectoryConfig, clock: Clock | None = None) -> None:
        self.config = config
        self.supervisor = Supervisor()
        self.db = DirectoryDB(config.data_dir) if config.data_dir else None
        self._clock = clock or MonotonicClock()
        self.state = DirectoryState(self._clock, config.node_ttl_ms, self.db)
        self.etcd = EtcdSession(config.etcd) if config.etcd else None
        self.address = config.advertise or config.listen
        self.election = (
            LeaderElection(self.etcd, config.cluster, self.address, config.election_ttl_s) if self.etcd else None
        )
        self.members = MemberWatch(self.etcd, config.cluster, self._clock) if self.etcd else None
        self.service = DirectoryService(
            self.state,
            self.is_leader,
            self.leader,
            self._extra_stats,
            credentials=load_credentials(config.credentials_file),
            cluster_token=load_token(config.cluster_token_file),
            node_root_certs=load_root_certs(config.node_tls_ca_file, "nodes' CA certificate"),
            limits=config.tenant,
            workers=config.grpc_workers,
        )
        self._tls = load_tls(config.tls_cert_file, config.tls_key_file)
        self.metrics = ServiceMetrics(DirectoryCollector(self.state.summary, self.is_leader), "directory")
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.grpc_workers, thread_name_prefix="kvpool-dir"),
            options=server_options(config.max_message_bytes),
            interceptors=self.metrics.interceptors(bool(config.metrics_listen)),  # none without /metrics
        )
        # a node's Register carries every block key it holds: the only bound is the message size
        add_typed_service(self._server, self.service, directory_pb2, "Directory", config.max_message_bytes)
        self._stopped = threading.Event()

    def is_leader(self) -> bool:
        """True only while this instance's etcd lease is known to be alive (``election.py``):
        a leader cut off from etcd stops serving writes before another can be elected."""
        return self.election.is_leader() if self.election is not None else True

    def leader(self) -> str:
        if self.election is None:
            return self.address
        return self.election.leader_address

    def _extra_stats(self) -> dict[str, Any]:
        if self.etcd is None:
            return {"etcd": "not configured (single directory, heartbeat liveness)"}
        assert self.election is not None and self.members is not None
        term = {"leader_term": self.election.term}
        if self.election.etcd_ok and self.members.ok:
            return {"etcd": "ok", **term}
        return {
            "etcd": "unreachable: a leader steps down when its lease cannot be renewed; standbys serve "
            "lookups from current state and cannot elect, admit liveness leases or notice node deaths "
            "except by heartbeat timeout",
            **term,
        }

    def start(self) -> None:
        self.supervisor.install_stop_signals()
        try:
            if self._tls is not None:
                port = self._server.add_secure_port(self.config.listen, self._tls)
            else:
                port = self._server.add_insecure_port(self.config.listen)
        except RuntimeError:
            port = 0
        if port == 0:
            raise Unavailable(
                f"directory cannot listen on {self.config.listen}", hint="pick a free port with --listen 127.0.0.1:PORT"
            )
        if self.etcd is not None:
            assert self.election is not None and self.members is not None
            self.etcd.start()
            self.election.start(self.supervisor.fail, first_round_s=self.etcd.timeout_s * 2)
            self.members.start(self.supervisor.fail)
            self.supervisor.every("etcd-nodes", self.config.expire_interval_ms, self._check_etcd_nodes)
        self.metrics.serve(self.config.metrics_listen, self.supervisor.spawn)
        self._server.start()
        self.supervisor.every("expire", self.config.expire_interval_ms, self._expire)
        if self.db is not None:
            self.supervisor.every("flush", self.config.flush_interval_ms, self.state.flush)
        log.info(
            "directory on %s, %s (leader: %s)",
            self.address,
            "TLS" if self._tls is not None else "plaintext",
            self.leader() or "electing",
        )

    def _expire(self) -> None:
        if self.is_leader():
            self.state.expire()
            self.service.flush_removes()

    def _check_etcd_nodes(self) -> None:
        """Drop nodes whose etcd liveness key is gone (their lease expired: SIGKILL, partition),
        as the watch of the nodes' keys reports it; only a node registered before its absence
        was known (a node that registers is already in etcd: it joins first)."""
        if self.members is None or not self.is_leader():
            return
        for node in self.state.nodes():
            absent_since_ms = self.members.absent_since_ms(node.node_id)
            if absent_since_ms > 0 and node.confirmed and node.last_registered_ms < absent_since_ms:
                self.state.mark_dead(node.node_id, "its etcd liveness lease expired")

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.metrics.stop()
        self.supervisor.stop()
        if self.election is not None:
            self.election.resign()
        if self.etcd is not None:
            self.etcd.close()
        self._server.stop(2.0).wait(3.0)
        if self.db is not None:
            self.state.flush()
            self.db.close()

    def wait(self) -> int:
        failed = self.supervisor.wait_for_stop()
        self.stop()
        return 1 if failed else 0
