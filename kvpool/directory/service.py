"""The Directory gRPC service: decode, check leadership, call ``DirectoryState``, encode.

Only the leader answers (except ``Leader``, which every instance answers); a standby
raises NOT_LEADER naming the leader, and ``DirectoryLink`` redirects. Removes and pins
are forwarded to the holder nodes over their Pool control service.

Every hash a request names becomes the block key ``namespace || hash`` before it reaches
``DirectoryState`` (nodes register their 32-byte keys as they are), so a Lookup, Remove
or Pin sent with tenant B's namespace can never see, drop or pin tenant A's holders.

With credentials (the same file format as a node's, docs/security.md) every call needs a
known bearer token: Register and Heartbeat only the cluster token (a node), Lookup /
Remove / Pin only for a namespace the caller's credential may use; Release only the
caller's own leases (ids are random, and each lease's namespace is checked); Stats
node-wide counts only for the admin or cluster token (a tenant gets the node list); Place,
Leader and Nodes any known token. Removes and pins forwarded to nodes carry the cluster
token (over TLS when the nodes serve it: ``node_root_certs``).

Fairness: every call of a tenant runs inside the node's policy (``gated``,
``kvpool/core/fairness.py``): past its share it is ``TenantBusy`` having done nothing.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from kvpool.core.auth import Credentials, Principal
from kvpool.core.errors import InvalidArgument, KVPoolError, NotLeader, PermissionDenied
from kvpool.core.fairness import TenantLimits, request_cost, tenant_key
from kvpool.core.hashing import pack_hashes, unpack_hashes
from kvpool.core.keys import BLOCK_KEY_BYTES, block_keys, check_namespace, group_by_namespace
from kvpool.directory.state import DirectoryState, EventIn, NodeRecord
from kvpool.proto import directory_pb2, directory_pb2_grpc, pool_pb2, pool_pb2_grpc
from kvpool.rpc.auth import Metadata, call_metadata, make_channel, principal_of
from kvpool.rpc.codec import channel_options
from kvpool.rpc.errors import from_rpc_error, typed_handler

log = logging.getLogger("kvpool.directory.service")

MAX_TRANSPORT_METADATA_BYTES = 64 << 10  # a NIXL agent with UCX on loopback publishes ~0.5 KiB
FORWARD_TIMEOUT_S = 5.0
#: most hashes one Lookup / Remove / Pin or one heartbeat event may name (a 4M-token prompt
#: at 16 tokens per block); the whole message is bounded by --max-message-bytes too
MAX_BATCH_BLOCKS = 262_144
#: most directory lease ids one Release may name
MAX_RELEASE_IDS = 4096


def bounded_hashes(packed: bytes, what: str) -> list[bytes]:
    """The hashes of a request field, or InvalidArgument past ``MAX_BATCH_BLOCKS``."""
    hashes = unpack_hashes(packed)
    if len(hashes) > MAX_BATCH_BLOCKS:
        raise InvalidArgument(f"{what} names {len(hashes)} blocks; the limit is {MAX_BATCH_BLOCKS}", hint="split it")
    return hashes


F = TypeVar("F", bound=Callable[..., Any])


def _hashes_cost(request: Any) -> int:
    return request_cost(len(request.hashes) // 16)


def gated(cost: Callable[[Any], int]) -> Callable[[F], F]:
    """Run a handler as one of its caller's tenant's calls of ``cost(request)`` units
    (``TenantGate``, the node's policy): a tenant past its share is ``TenantBusy`` having
    done nothing; the blocks a Lookup found are billed after it. The admin and the cluster
    token (nodes, the directory's own forwards) are not gated; nor are Register and
    Heartbeat, which only nodes may send; nor, without credentials, calls naming no
    namespace."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def inner(self: DirectoryService, request: Any, context: grpc.ServicerContext) -> Any:
            principal = principal_of(context, self.credentials)
            self._current.context, self._current.principal = context, principal
            named = self.credentials is not None
            try:
                namespace = bytes(getattr(request, "namespace", b""))
                if (named and (principal.admin or principal.cluster)) or not (named or namespace):
                    # without credentials a call that names no namespace (Place, Nodes, Stats,
                    # Leader, Release) has no tenant to count against: every client would share one
                    return method(self, request, context)
                tenant = tenant_key(named, principal.name, namespace)
                with self.gate.admit(tenant, cost(request), f"Directory.{method.__name__}"):
                    reply = method(self, request, context)
                self.gate.charge(tenant, self.limits.walk_units(int(getattr(reply, "hits", 0))))
                return reply
            finally:
                self._current.context = self._current.principal = None

        return inner  # type: ignore[return-value]

    return wrap


def node_to_msg(node: NodeRecord) -> directory_pb2.NodeInfo:
    return directory_pb2.NodeInfo(
        node_id=node.node_id,
        control_address=node.control_address,
        data_address=node.data_address,
        transport=node.transport,
        host=node.host,
        capacity_bytes=node.capacity_bytes,
        used_bytes=node.used_bytes,
        alive=node.alive,
        transport_metadata=node.transport_metadata,
    )


class DirectoryService(directory_pb2_grpc.DirectoryServicer):
    def __init__(
        self,
        state: DirectoryState,
        is_leader: Callable[[], bool],
        leader: Callable[[], str],
        extra_stats: Callable[[], dict[str, Any]] | None = None,
        credentials: Credentials | None = None,
        cluster_token: str = "",
        node_root_certs: bytes | None = None,
        limits: TenantLimits | None = None,
        workers: int = 16,
    ) -> None:
        """``credentials``: who may call (None: everyone, the loopback default);
        ``cluster_token``: presented to nodes when forwarding removes and pins, over TLS
        verified against ``node_root_certs`` when given (nodes with --tls-cert-file)."""
        self.credentials = credentials
        self._node_root_certs = node_root_certs
        # per-tenant shares (kvpool/core/fairness.py): a tenant's calls past them are TENANT_BUSY
        self.limits = limits if limits is not None else TenantLimits()
        self.gate = self.limits.gate(workers)
        self._current = threading.local()  # the principal ``gated`` identified for this call
        self._node_metadata: Metadata | None = call_metadata(cluster_token)
        self.state = state
        self._is_leader = is_leader
        self._leader = leader
        self._extra_stats = extra_stats
        self._stubs: dict[str, pool_pb2_grpc.PoolStub] = {}
        self._stubs_lock = threading.Lock()

    def _lead(self) -> None:
        if not self._is_leader():
            leader = self._leader()
            raise NotLeader(
                f"this directory is a standby; the leader is {leader or 'not elected yet'}",
                hint=f"call {leader}" if leader else "retry in a moment",
            )

    def _caller(self, context: grpc.ServicerContext) -> Principal:
        if getattr(self._current, "context", None) is context:
            principal: Principal = self._current.principal
            return principal
        return principal_of(context, self.credentials)

    def _require_node(self, context: grpc.ServicerContext, what: str) -> None:
        principal = self._caller(context)
        if not principal.cluster:
            raise PermissionDenied(
                f"{what} is for cluster nodes and credential {principal.name!r} is not the cluster token",
                hint="nodes present the cluster token (--cluster-token-file); docs/security.md",
            )

    def _authorise(self, context: grpc.ServicerContext, namespace: bytes) -> None:
        principal = self._caller(context)
        if not principal.may_use(namespace):
            raise PermissionDenied(
                f"credential {principal.name!r} may not use namespace {namespace.hex()[:64] or '(empty)'}",
                hint="the operator adds this digest to the tenant's namespaces in the credentials file",
            )

    def _node_stub(self, address: str) -> pool_pb2_grpc.PoolStub:
        with self._stubs_lock:
            stub = self._stubs.get(address)
            if stub is None:
                channel = make_channel(address, channel_options(64 << 20), self._node_root_certs)
                stub = pool_pb2_grpc.PoolStub(channel)
                self._stubs[address] = stub
            return stub

    def forward(self, groups: dict[str, list[bytes]], call: str, **fields: Any) -> int:
        """Send a Remove / Pin for each node's block keys to that node, one call per
        namespace the keys name; returns the sum of changes."""
        changed = 0
        for node_id, keys in groups.items():
            node = self.state.node(node_id)
            if node is None:
                continue
            stub = self._node_stub(node.control_address)
            try:
                for namespace, hashes in group_by_namespace(keys).items():
                    if call == "Remove":
                        req = pool_pb2.HashesRequest(namespace=namespace, hashes=pack_hashes(hashes))
                        changed += stub.Remove(req, timeout=FORWARD_TIMEOUT_S, metadata=self._node_metadata).removed
                    else:
                        req2 = pool_pb2.PinRequest(namespace=namespace, hashes=pack_hashes(hashes), **fields)
                        changed += stub.Pin(req2, timeout=FORWARD_TIMEOUT_S, metadata=self._node_metadata).changed
            except grpc.RpcError as exc:
                log.warning(
                    "directory: %s on node %s failed: %s", call, node_id, from_rpc_error(exc, node.control_address)
                )
        return changed

    @staticmethod
    def _event_keys(event: directory_pb2.BlockEvent) -> list[bytes]:
        hashes = bounded_hashes(event.hashes, "a heartbeat event")
        return block_keys(event.namespace, hashes) if hashes else []

    @staticmethod
    def _namespaces(msgs: Any) -> list[tuple[bytes, bytes, str]]:
        return [(m.namespace, m.spec_digest, m.spec_json) for m in msgs]

    @staticmethod
    def _transport_metadata(n: directory_pb2.NodeInfo) -> bytes:
        """A node's published transport metadata, or b"" when it is beyond the bound (logged:
        readers then fetch it from the node's data plane, so registering still succeeds)."""
        if len(n.transport_metadata) > MAX_TRANSPORT_METADATA_BYTES:
            log.warning(
                "directory: node %s publishes %d bytes of transport metadata (limit %d): not stored",
                n.node_id,
                len(n.transport_metadata),
                MAX_TRANSPORT_METADATA_BYTES,
            )
            return b""
        return bytes(n.transport_metadata)

    @typed_handler
    def Register(self, request: directory_pb2.RegisterRequest, context: grpc.ServicerContext) -> Any:
        self._require_node(context, "Register")
        self._lead()
        n = request.node
        if not n.node_id or not n.data_address:
            raise InvalidArgument("a node registers with a node_id and a data_address")
        record = NodeRecord(
            node_id=n.node_id,
            control_address=n.control_address,
            data_address=n.data_address,
            transport=n.transport or "tcp",
            host=n.host,
            capacity_bytes=n.capacity_bytes,
            used_bytes=n.used_bytes,
            incarnation=request.incarnation,
            last_seq=request.last_seq,
            transport_metadata=self._transport_metadata(n),
        )
        if len(request.keys) % BLOCK_KEY_BYTES:
            raise InvalidArgument(f"Register.keys is {len(request.keys)} bytes, not a multiple of {BLOCK_KEY_BYTES}")
        keys = [request.keys[i : i + BLOCK_KEY_BYTES] for i in range(0, len(request.keys), BLOCK_KEY_BYTES)]
        epoch = self.state.register(
            record, request.hash_scheme, self._namespaces(request.namespaces), keys, request.tiers
        )
        return directory_pb2.RegisterReply(epoch=epoch, leader=self._leader())

    @typed_handler
    def Heartbeat(self, request: directory_pb2.HeartbeatRequest, context: grpc.ServicerContext) -> Any:
        self._require_node(context, "Heartbeat")
        self._lead()
        events = [EventIn(e.seq, e.kind, self._event_keys(e), e.tier or "host") for e in request.events]
        resync, acked = self.state.heartbeat(
            request.node_id,
            request.incarnation,
            request.used_bytes,
            request.capacity_bytes,
            events,
            self._namespaces(request.namespaces),
        )
        return directory_pb2.HeartbeatReply(resync=resync, acked_seq=acked)

    @typed_handler
    @gated(_hashes_cost)
    def Lookup(self, request: directory_pb2.LookupRequest, context: grpc.ServicerContext) -> Any:
        self._authorise(context, bytes(request.namespace))
        self._lead()
        keys = block_keys(request.namespace, bounded_hashes(request.hashes, "Lookup"))
        result = self.state.lookup(keys, request.client_node, int(request.lease_ms), for_read=request.for_read)
        return directory_pb2.LookupReply(
            hits=result.hits,
            nodes=[node_to_msg(n) for n in result.nodes],
            holder_masks=result.masks,
            tiers=result.tiers,
            lease_id=result.lease_id,
        )

    @typed_handler
    @gated(lambda r: 1)
    def Place(self, request: directory_pb2.PlaceRequest, context: grpc.ServicerContext) -> Any:
        self._caller(context)
        self._lead()
        nodes = self.state.place(request.blocks, request.block_bytes, request.client_node, request.replicas or 1)
        return directory_pb2.PlaceReply(nodes=[node_to_msg(n) for n in nodes])

    @typed_handler
    @gated(lambda r: request_cost(len(r.lease_ids)))
    def Release(self, request: directory_pb2.LeaseRelease, context: grpc.ServicerContext) -> Any:
        principal = self._caller(context)
        self._lead()
        if len(request.lease_ids) > MAX_RELEASE_IDS:
            raise InvalidArgument(
                f"{len(request.lease_ids)} lease ids in one Release; the limit is {MAX_RELEASE_IDS}", hint="split it"
            )
        # a tenant releases only leases of its own namespaces (ids are random: not guessable either)
        released = self.state.release(request.lease_ids, principal.may_use)
        return directory_pb2.ReleaseReply(released=released)

    @typed_handler
    @gated(_hashes_cost)
    def Remove(self, request: directory_pb2.RemoveRequest, context: grpc.ServicerContext) -> Any:
        self._authorise(context, bytes(request.namespace))
        self._lead()
        namespace = check_namespace(request.namespace)
        groups, deferred = self.state.remove(block_keys(namespace, bounded_hashes(request.hashes, "Remove")), namespace)
        removed = self.forward(groups, "Remove")
        return directory_pb2.RemoveReply(removed=removed, deferred=deferred)

    @typed_handler
    @gated(_hashes_cost)
    def Pin(self, request: directory_pb2.PinRequest, context: grpc.ServicerContext) -> Any:
        self._authorise(context, bytes(request.namespace))
        self._lead()
        groups = self.state.holders_by_node(block_keys(request.namespace, bounded_hashes(request.hashes, "Pin")))
        changed = self.forward(groups, "Pin", hard=request.hard, ttl_ms=request.ttl_ms, unpin=request.unpin)
        return directory_pb2.PinReply(changed=changed)

    @typed_handler
    @gated(lambda r: 1)
    def Stats(self, request: directory_pb2.StatsRequest, context: grpc.ServicerContext) -> Any:
        principal = self._caller(context)
        summary: dict[str, Any] = dict(self.state.summary())
        if not (principal.admin or principal.cluster):
            # a tenant sees the cluster's shape (what Nodes tells it too), not the counts of
            # every tenant's blocks, lookups, leases and namespaces: those are an admin view
            summary = {
                "epoch": summary["epoch"],
                "nodes": [{k: v for k, v in n.items() if k not in ("blocks", "confirmed")} for n in summary["nodes"]],
                "scope": f"tenant {principal.name!r}: node-wide counts need the admin token",
            }
        else:
            summary["tenant_calls_waited"] = self.gate.waited  # per-tenant fairness (core/fairness.py)
            summary["tenant_calls_refused"] = self.gate.refused
        summary["is_leader"] = self._is_leader()
        summary["leader"] = self._leader()
        if self._extra_stats is not None:
            summary.update(self._extra_stats())
        return directory_pb2.StatsReply(json=json.dumps(summary, sort_keys=True, default=str))

    @typed_handler
    @gated(lambda r: 1)
    def Leader(self, request: directory_pb2.LeaderRequest, context: grpc.ServicerContext) -> Any:
        self._caller(context)
        return directory_pb2.LeaderReply(leader=self._leader(), is_leader=self._is_leader())

    @typed_handler
    @gated(lambda r: 1)
    def Nodes(self, request: directory_pb2.NodesRequest, context: grpc.ServicerContext) -> Any:
        self._caller(context)
        self._lead()
        return directory_pb2.NodesReply(nodes=[node_to_msg(n) for n in self.state.nodes()])

    def flush_removes(self) -> None:
        """Forward removes that waited for a directory lease to end."""
        for groups in self.state.take_due_removes().values():
            try:
                self.forward(groups, "Remove")
            except KVPoolError as err:
                log.warning("directory: deferred remove failed: %s", err)
