"""``kvpool serve``: the embedded single-machine default (one process = node + directory).

Start-up: read the credentials file and TLS key pair if configured (a daemon that cannot
read them does not start), map the arena, build the store, start the gRPC server on the
configured address (TLS when configured), start the sweeper. SIGTERM / SIGINT: stop accepting calls, let
in-flight calls finish (grace period), remove the arena file, exit 0. A crashed
background task exits non-zero.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from concurrent import futures
from typing import Any

import grpc

from kvpool.core.clock import MonotonicClock
from kvpool.core.config import DaemonConfig
from kvpool.core.errors import Unavailable
from kvpool.core.supervisor import Supervisor
from kvpool.core.tickets import TicketIssuer, new_secret
from kvpool.daemon.arena_handoff import ArenaHandoff
from kvpool.daemon.gc_pauses import TICK_MS as GC_TICK_MS
from kvpool.daemon.gc_pauses import GcFreezer
from kvpool.daemon.local_calls import LocalCallServer, local_socket_path
from kvpool.daemon.metrics import NodeCollector
from kvpool.daemon.node import PoolNode
from kvpool.daemon.service import PoolService, max_request_bytes
from kvpool.proto import pool_pb2
from kvpool.rpc.codec import server_options
from kvpool.rpc.credentials import load_credentials, load_tls
from kvpool.rpc.local_call import LocalCallKeys
from kvpool.rpc.metrics import ServiceMetrics
from kvpool.rpc.serving import add_typed_service
from kvpool.storage.arena_segments import SegmentedArena

log = logging.getLogger("kvpool.server")

SHUTDOWN_GRACE_S = 5.0


PR_SET_DUMPABLE = 4  # <linux/prctl.h>


def make_non_dumpable() -> None:
    """``prctl(PR_SET_DUMPABLE, 0)``: the kernel then refuses other processes of this uid
    (without CAP_SYS_PTRACE) ``/proc/PID/fd``, ``/proc/PID/mem``, ``/proc/PID/environ`` and
    ptrace attach, whatever ``kernel.yama.ptrace_scope`` says, and writes no core dump. The
    daemon itself still opens ``/proc/self/fd`` (the arena's read-only descriptor). Where
    prctl is not there (not Linux) the daemon starts anyway and says so."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    except (OSError, AttributeError) as exc:
        log.warning("cannot make the daemon non-dumpable (%s): same-uid processes can read its memory", exc)


class PoolServer:
    """A running daemon; ``start`` then ``wait`` (or ``stop``)."""

    def __init__(self, config: DaemonConfig, gc_freezer: GcFreezer | None = None) -> None:
        """``gc_freezer``: the process's garbage-collector policy, from the process that owns the
        daemon (``kvpool serve`` with ``--gc-freeze on``); a server embedded elsewhere has none."""
        self.config = config
        self.gc_freezer = gc_freezer
        if config.process_protected:
            make_non_dumpable()  # before the tokens' hashes and the arena are in memory
        self.supervisor = Supervisor()
        credentials = load_credentials(config.credentials_file)  # before anything is mapped
        # a fresh secret each start: a ticket admits to this daemon's data plane only, until it restarts
        self.credentials = None if credentials is None else credentials.with_tickets(TicketIssuer(new_secret()))
        self._tls = load_tls(config.tls_cert_file, config.tls_key_file)
        self.node = PoolNode(config, MonotonicClock())
        if self.credentials is not None and self.credentials.tenant_quotas():
            self.node.store.set_tenant_quotas(self.credentials.tenant_quotas())  # before any put
        if self.credentials is not None and isinstance(self.node.arena, SegmentedArena):  # per-tenant arena
            owners = self.credentials.arena_owners().namespace_owner
            self.node.store.set_segment_owners(owners, self.node.arena.on_owned)
            groups = len(set(owners.values()))
            if self.node.arena.num_segments < groups:
                log.warning(
                    "arena: %d segments for %d tenant groups: a group gets room only while another's "
                    "segment is empty (raise --capacity-bytes or lower --arena-segment-bytes)",
                    self.node.arena.num_segments,
                    groups,
                )
        self.handoff: ArenaHandoff | None = None
        if config.arena_by_fd:
            self.handoff = ArenaHandoff(
                self.node.arena,
                config.arena_dir,
                self.credentials,
                self.node.store.put_pending,
                socket_mode=config.arena_socket_mode,
            )
        # /metrics reads the node's own counters at scrape time (docs/metrics.md)
        self.local: LocalCallServer | None = None
        self.metrics = ServiceMetrics(NodeCollector(self.node, self._process_summary), "pool")
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.grpc_workers, thread_name_prefix="kvpool-rpc"),
            options=server_options(config.max_message_bytes),
            interceptors=self.metrics.interceptors(bool(config.metrics_listen)),  # none without /metrics
        )
        local_path = local_socket_path(config.arena_dir) if config.local_calls else ""
        local_keys = LocalCallKeys()
        service = PoolService(
            self.node,
            max_event_subscribers=max(1, config.grpc_workers // 2),
            credentials=self.credentials,
            arena_socket=self.handoff.path if self.handoff is not None else "",
            local_socket=local_path,
            local_keys=local_keys,
            process_summary=self._process_summary,
        )
        limit = min(config.max_message_bytes, max_request_bytes(config.store.max_batch_blocks))
        methods = add_typed_service(self._server, service, pool_pb2, "Pool", limit)
        if local_path:
            rpc = self.metrics.rpc
            self.local = LocalCallServer(
                methods,
                local_path,
                local_keys,
                self.credentials,
                self.node.node_id,
                limit,
                socket_mode=config.arena_socket_mode,
                timer=(lambda name, h: rpc.timed(name, h, service="pool-local")) if config.metrics_listen else None,
            )
        self._stopped = threading.Event()
        self.cluster: Any = None  # kvpool.daemon.cluster_node.ClusterAgent when cluster mode is on

    def _process_summary(self) -> dict[str, Any]:
        """The local-call socket's counters and the garbage collector's, for Stats and /metrics."""
        summary: dict[str, Any] = {}
        if self.local is not None:
            summary.update(self.local.summary())
        if self.gc_freezer is not None:
            summary.update(self.gc_freezer.summary())
        return summary

    def start(self) -> None:
        self.supervisor.install_stop_signals()
        try:
            if self._tls is not None:
                port = self._server.add_secure_port(self.config.listen, self._tls)
            else:
                port = self._server.add_insecure_port(self.config.listen)
        except RuntimeError as exc:
            port = 0
            reason = str(exc)
        else:
            reason = "address in use or not local"
        if port == 0:
            if self.handoff is not None:
                self.handoff.stop()
            self.node.close()
            raise Unavailable(
                f"cannot listen on {self.config.listen}: {reason}", hint="pick a free port with --listen 127.0.0.1:PORT"
            )
        if self.gc_freezer is not None:
            self.gc_freezer.start()  # its whole pass before anyone is served; stop() undoes it
        if self.handoff is not None:
            self.handoff.start(self.supervisor)
        if self.local is not None:
            self.local.start(self.supervisor)
        try:
            self.metrics.serve(self.config.metrics_listen, self.supervisor.spawn)
        except BaseException:  # the metrics port is taken: shut down whole, then report
            self.stop()
            raise
        if self.config.cluster.enabled or self.config.cluster.kv_events_endpoint:
            from kvpool.daemon.cluster_node import ClusterAgent  # cluster mode only

            self.cluster = ClusterAgent(self.node, self.config, self.supervisor, self.credentials)
            try:  # every listener is up before the gRPC server answers (the daemon's "ready")
                self.cluster.start_data_plane()
            except BaseException:  # e.g. the data-plane port is taken: shut down whole, then report
                self.stop()
                raise
        self._server.start()
        self.supervisor.every("sweep", self.config.sweep_interval_ms, self.node.sweep)
        if self.gc_freezer is not None:
            self.supervisor.every("gc", GC_TICK_MS, self.gc_freezer.tick)
        if self.cluster is not None:
            try:
                self.cluster.start()
            except BaseException:  # e.g. etcd refused: shut down whole, then report
                self.stop()
                raise
        log.info(
            "kvpool serving on %s (node %s; %s, %s)",
            self.config.listen,
            self.node.node_id,
            "TLS" if self._tls is not None else "plaintext",
            "credentials required" if self.credentials is not None else "no authentication",
        )

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.cluster is not None:
            self.cluster.stop()
        if self.handoff is not None:
            self.handoff.stop()  # before the supervisor joins its accept thread
        if self.local is not None:
            self.local.close()  # likewise; its calls in flight answer, joined below
        self.metrics.stop()  # ends its serve loop, which the supervisor joins
        self.supervisor.stop()
        self.node.events.close()
        done = self._server.stop(SHUTDOWN_GRACE_S)
        deadline = time.monotonic() + SHUTDOWN_GRACE_S + 1  # one grace for both kinds of calls in flight
        if self.local is not None:
            self.local.join(SHUTDOWN_GRACE_S)
        done.wait(max(0.0, deadline - time.monotonic()))
        self.node.close()
        if self.gc_freezer is not None:
            self.gc_freezer.close()
        log.info("kvpool on %s stopped", self.config.listen)

    def wait(self) -> int:
        """Block until SIGTERM/SIGINT or a crashed background task; returns the exit code."""
        failed = self.supervisor.wait_for_stop()
        self.stop()
        return 1 if failed else 0
