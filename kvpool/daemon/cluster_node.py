"""Cluster mode of a node: the data-plane server over the node's arena, liveness in etcd,
registration with the directory leader, and streaming the node's KV events to it.

The node stays the source of truth: on (re)registration it sends a full snapshot of its
blocks (consistent with an event seq), then every event after that seq, in order, in
heartbeats. When the directory answers ``resync`` (it restarted, failed over, or saw a
gap) the node registers again with a fresh snapshot. Losing the directory or etcd never
stops the node: it keeps serving its local clients and peers and retries in the background.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Sequence

import numpy as np

from kvpool.core.auth import Credentials
from kvpool.core.config import DaemonConfig
from kvpool.core.errors import InvalidArgument, KVPoolError, LeaseExpired
from kvpool.core.events import KVEvent
from kvpool.core.hashing import HASH_SCHEME
from kvpool.core.keys import block_keys
from kvpool.core.retry import RetryPolicy
from kvpool.core.supervisor import Supervisor
from kvpool.daemon.node import PoolNode
from kvpool.directory.etcd import EtcdSession
from kvpool.directory.link import DirectoryLink
from kvpool.directory.membership import Membership
from kvpool.directory.state import TIER_CODES
from kvpool.proto import directory_pb2
from kvpool.rpc.credentials import load_root_certs, load_token
from kvpool.transport.base import DataServer, LeasedBlocks, PutSlots
from kvpool.transport.factory import make_data_server
from kvpool.transport.shares import TransferShares
from kvpool.transport.tls import server_tls_context

log = logging.getLogger("kvpool.cluster")

MAX_EVENTS_PER_HEARTBEAT = 512
#: the directory unreachable or refusing: register again after this (constant: a node
#: should rejoin a new leader within one wait)
DIRECTORY_RETRY = RetryPolicy(first_delay_ms=500, max_delay_ms=500)


class NodeBlockStore:
    """``BlockStore`` (the data plane's view of a node) over a ``PoolNode``."""

    def __init__(self, node: PoolNode) -> None:
        self._node = node

    def arena(self) -> np.ndarray:
        return self._node.arena.view

    def block_bytes(self, namespace: bytes) -> int:
        return self._node.namespace(namespace).spec.block_bytes

    def lease(self, namespace: bytes, keys: Sequence[bytes]) -> LeasedBlocks:
        """Lease the leading blocks of ``keys`` (hashes) *in this namespace*: the store key is
        namespace || hash, so a peer that learned another tenant's block hash (from KV
        events, say) asks for a key that does not exist and reads nothing."""
        wanted = block_keys(namespace, keys)
        grant = self._node.store.lease(wanted)
        self._node.count_read(namespace, len(grant.locations), len(keys), wanted[: len(grant.locations)])
        return LeasedBlocks(grant.lease_id, [(loc.offset, loc.size, loc.checksum) for loc in grant.locations])

    def drop_corrupt(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """The data plane found these blocks (hashes) of ``namespace`` rotten in this node's
        arena while serving them: re-verify and drop them (``PoolNode.drop_corrupt``)."""
        return self._node.drop_corrupt(self._node.namespace(namespace), block_keys(namespace, keys))

    def release(self, lease_id: int) -> None:
        try:
            self._node.store.release(lease_id)
        except LeaseExpired:
            log.warning("data plane: lease %d expired while its bytes were being sent", lease_id)

    def put_start(self, namespace: bytes, keys: Sequence[bytes]) -> PutSlots:
        info = self._node.namespace(namespace)
        grant = self._node.store.put_start(info.digest, block_keys(info.digest, keys), info.spec.block_bytes)
        return PutSlots(grant.put_id, list(grant.slots), len(grant.already_present), len(grant.in_flight))

    def put_commit(self, put_id: int, checksums: Sequence[int]) -> tuple[int, int]:
        result = self._node.store.put_commit(put_id, checksums)
        return result.committed, len(result.checksum_failed)

    def write_slot(self, put_id: int, slot: int, data: np.ndarray) -> bool:
        """Copy a received block into its reserved slot only if the put is still pending, so a
        writer whose put was reclaimed can never overwrite a block committed since."""
        return bool(self._node.store.write_slot(put_id, slot, data))

    def put_abort(self, put_id: int) -> None:
        self._node.store.put_abort(put_id)


def namespace_msgs(node: PoolNode, skip: set[bytes]) -> list[directory_pb2.NamespaceSpec]:
    return [
        directory_pb2.NamespaceSpec(
            namespace=ns.digest, spec_digest=ns.spec.digest(), spec_json=json.dumps(ns.spec.to_dict(), sort_keys=True)
        )
        for ns in node.namespaces()
        if ns.digest not in skip
    ]


def event_msg(event: KVEvent) -> directory_pb2.BlockEvent:
    return directory_pb2.BlockEvent(
        seq=event.seq, kind=event.kind.value, hashes=b"".join(event.hashes), tier=event.tier, namespace=event.namespace
    )


class ClusterAgent:
    """Everything a node does in cluster mode; started and stopped by ``PoolServer``."""

    def __init__(
        self, node: PoolNode, config: DaemonConfig, supervisor: Supervisor, credentials: Credentials | None = None
    ) -> None:
        """``credentials``: the node's (the same file as its control plane's): data-plane
        peers must pass AUTH with one of its tokens, for namespaces that token may use."""
        self.node = node
        self.credentials = credentials
        self.config = config
        self.cluster = config.cluster
        self.supervisor = supervisor
        self.incarnation = (time.time_ns() ^ (os.getpid() << 20)) & ((1 << 63) - 1)
        self.host = self.cluster.host or socket.gethostname()
        self.data_server: DataServer | None = None
        self.etcd = EtcdSession(self.cluster.etcd_list) if self.cluster.etcd_list else None
        self.membership: Membership | None = None
        self.link: DirectoryLink | None = None
        self.registered = False
        self._sent_namespaces: set[bytes] = set()
        self._next_seq = 1
        self.publisher: object | None = None

    @property
    def data_address(self) -> str:
        return self.data_server.address if self.data_server is not None else ""

    def _check_one_sided_reads(self) -> None:
        """``--transport nixl`` lets a peer *pull* bytes from the registered arena: the data
        plane's AUTH and namespace check gate the lease and the addresses (OP_NIXL_READ), not
        the READ itself, which the node's CPU never sees. A peer holding the node's NIXL
        metadata can read any byte of the arena. So with credentials for more than one tenant
        the node refuses to start (docs/security.md, docs/cluster.md): one trust domain only."""
        if self.cluster.transport != "nixl" or self.credentials is None:
            return
        tenants = sorted({e.principal.name for e in self.credentials.entries if not e.principal.admin})
        if len(tenants) > 1:
            raise InvalidArgument(
                f"--transport nixl with credentials for {len(tenants)} tenants ({', '.join(tenants[:4])}): NIXL "
                "reads are one-sided, so a tenant could read another's blocks out of the shared arena",
                hint="run one node per tenant with nixl, or use --transport tcp / ucx (two-sided, checked per read)",
            )

    def start_data_plane(self) -> None:
        """Bind and serve the data plane (cluster mode). The daemon calls this before its
        gRPC server answers: a daemon that answers is one whose every listener is up (a
        client handed ``data_address`` right after start-up found nothing listening there)."""
        self._check_one_sided_reads()
        if self.cluster.enabled:
            listen = self.cluster.data_listen or f"{self.config.listen.rpartition(':')[0]}:0"
            tls = None
            if self.cluster.data_tls:
                tls = server_tls_context(self.config.tls_cert_file, self.config.tls_key_file)
            shares = TransferShares(
                self.config.tenant_data_inflight_bytes, self.config.tenant_data_transfers, self.config.tenant_wait_ms
            )
            self.data_server = make_data_server(
                self.cluster.transport, NodeBlockStore(self.node), listen, self.credentials, tls, shares
            )
            self.data_server.start()
            log.info("node %s: data plane (%s) on %s", self.node.node_id, self.cluster.transport, self.data_address)

    def start(self) -> None:
        """Join the cluster (etcd, the directories, the KV-event stream), once the daemon's
        gRPC server answers; ``start_data_plane`` first."""
        if self.etcd is not None:
            self.membership = Membership(
                self.etcd, self.cluster.cluster, self.node.node_id, self._info(), self.cluster.liveness_ttl_s
            )
            self.etcd.start()
            # join before registering with the directory: it drops a registered node it
            # cannot see in etcd (``MemberWatch``)
            self.membership.start(self.supervisor.fail, first_round_s=self.etcd.timeout_s * 2)
        if self.cluster.directory_list or self.etcd is not None:
            self.link = DirectoryLink(
                self.cluster.directory_list,
                self.etcd,
                self.cluster.cluster,
                token=load_token(self.cluster.token_file),
                root_certs=load_root_certs(self.cluster.directory_tls_ca, "directory's CA certificate"),
            )
            self.supervisor.spawn("directory-sync", self._sync_loop)
        if self.cluster.kv_events_endpoint:
            from kvpool.daemon.cluster_events import VllmEventPublisher

            publisher = VllmEventPublisher(
                self.cluster.kv_events_endpoint, self.cluster.kv_events_topic, self.cluster.kv_events_replay_endpoint
            )
            self.publisher = publisher
            self.supervisor.spawn("kv-events", lambda: publisher.run(self.node.events, self.supervisor.stopping))

    def _info(self) -> dict[str, str]:
        """How peers reach this node: its etcd membership value and its NodeInfo addresses."""
        return {
            "control_address": self.config.listen,
            "data_address": self.data_address,
            "transport": self.cluster.transport,
            "host": self.host,
        }

    def _node_msg(self) -> directory_pb2.NodeInfo:
        summary = self.node.store.summary()
        return directory_pb2.NodeInfo(
            node_id=self.node.node_id,
            **self._info(),
            capacity_bytes=summary["capacity_bytes"],
            used_bytes=summary["used_bytes"],
            alive=True,
            # a NIXL node's agent metadata (its arena's registration): readers load it from here
            transport_metadata=self.data_server.transport_metadata if self.data_server is not None else b"",
        )

    def register(self) -> None:
        assert self.link is not None
        last_seq = self.node.events.last_seq  # first: events after it are replayed on top of the snapshot
        keys = self.node.store.snapshot_keys()
        namespaces = namespace_msgs(self.node, set())
        request = directory_pb2.RegisterRequest(
            node=self._node_msg(),
            hash_scheme=HASH_SCHEME,
            namespaces=namespaces,
            incarnation=self.incarnation,
            last_seq=last_seq,
            keys=b"".join(keys),  # namespace digest || hash, 32 bytes each
            tiers=bytes(TIER_CODES[self.node.store.tier_of(key) or "host"] for key in keys),
        )
        self.link.call("Register", request)
        self._sent_namespaces = {ns.namespace for ns in namespaces}
        self._next_seq = last_seq + 1
        self.registered = True
        log.info(
            "node %s registered with directory %s (%d blocks, seq %d)",
            self.node.node_id,
            self.link.leader,
            len(keys),
            last_seq,
        )

    def heartbeat(self, events: list[KVEvent]) -> bool:
        """Send events (may be empty); returns False when the directory wants a resync."""
        assert self.link is not None
        summary = self.node.store.summary()
        new_ns = namespace_msgs(self.node, self._sent_namespaces)
        reply = self.link.call(
            "Heartbeat",
            directory_pb2.HeartbeatRequest(
                node_id=self.node.node_id,
                incarnation=self.incarnation,
                used_bytes=summary["used_bytes"],
                capacity_bytes=summary["capacity_bytes"],
                events=[event_msg(e) for e in events],
                namespaces=new_ns,
            ),
        )
        self._sent_namespaces.update(ns.namespace for ns in new_ns)
        if reply.resync:
            return False
        if events:
            self._next_seq = events[-1].seq + 1
        return True

    def _sync_loop(self) -> None:
        wait_s = self.cluster.heartbeat_interval_ms / 1000.0
        backoff = DIRECTORY_RETRY.backoff()
        while not self.supervisor.stopping.is_set():
            try:
                if not self.registered:
                    self.register()
                    backoff.reset()
                events = self.node.events.read_from(self._next_seq, wait_s=wait_s)[:MAX_EVENTS_PER_HEARTBEAT]
                if self.supervisor.stopping.is_set():
                    return
                if not self.heartbeat(events):
                    log.info("node %s: directory asked for a resync", self.node.node_id)
                    self.registered = False
            except KVPoolError as err:
                if backoff.retries == 0:  # once per outage
                    log.warning("node %s: directory unreachable or refused (%s); retrying", self.node.node_id, err)
                self.registered = False
                if self.link is not None:
                    self.link.close()
                self.supervisor.stopping.wait(backoff.next_delay_s())

    def stop(self) -> None:
        if self.membership is not None:
            self.membership.leave()
        if self.data_server is not None:
            self.data_server.stop()
        if self.link is not None:
            self.link.close()
        if self.etcd is not None:
            self.etcd.close()
