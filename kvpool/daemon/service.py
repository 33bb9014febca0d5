"""The Pool gRPC service: decode a request, call the node, encode the reply.

Every handler is wrapped by ``typed_handler``: a KVPoolError becomes its status code
with a hint; any other exception is logged (rate-limited) and answered INTERNAL, and the
daemon goes on serving. Requests reach the handlers through ``add_typed_service``, so an
undecodable or oversized message is InvalidArgument too. Nothing here touches block bytes
except the store's commit-time check.

Tenancy: every hash a request names becomes the block key ``namespace || hash`` of the
request's registered namespace (``kvpool.core.keys``) before it reaches the store, so no
call can read, detect, pin, remove or overwrite another namespace's block. Snapshot and
Events are scoped to the request's namespace; their all-namespace forms and the Stats
namespace list are admin views, served only where ``DaemonConfig.admin_enabled``
(docs/security.md). Every list a request carries is bounded (``MAX_*`` below and the
store's ``max_batch_blocks``).

Authentication: with credentials configured every call first names its caller
(``principal_of``: the bearer token in the call's metadata, else ``Unauthenticated``);
a tenant may name only the namespace digests its credential lists (``PERMISSION_DENIED``
otherwise, in Hello and in every call that names a namespace), and the admin views need
an admin credential. Lease and put ids are random 63-bit capabilities, so Release,
PutCommit and PutAbort need only an authenticated caller. Without credentials (the
loopback default) every caller is ``ANONYMOUS``, as before.

Fairness: every unary call but the stream runs inside ``TenantGate.admit`` (``gated``),
which bounds the cost units and the worker threads one tenant has in flight
(``kvpool/core/fairness.py``); a call past its tenant's share is ``TenantBusy`` having
done nothing. The tenant is the credential's tenant name, or without credentials the
request's namespace (the connection, for calls that name none).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, TypeVar

import grpc

from kvpool.core.auth import Credentials, Principal
from kvpool.core.errors import CapacityExhausted, InvalidArgument, KVPoolError, PermissionDenied
from kvpool.core.fairness import request_cost, tenant_key
from kvpool.core.hashing import HASH_SCHEME, pack_hashes
from kvpool.core.keys import NAMESPACE_BYTES, BlockKeys, hashes_of, key_hash
from kvpool.daemon import introspect
from kvpool.daemon.node import NamespaceInfo, PoolNode
from kvpool.proto import pool_pb2, pool_pb2_grpc
from kvpool.rpc.auth import principal_of
from kvpool.rpc.codec import PROTOCOL_VERSION, event_to_msg, spec_from_msg
from kvpool.rpc.errors import abort_with, typed_handler
from kvpool.rpc.local_call import LocalCallKeys

log = logging.getLogger("kvpool.service")

#: lease ids one call may release (piggybacked or in Release); the client sends <= 256
MAX_RELEASE_IDS_PER_CALL = 4096
#: namespaces listed per Stats reply (admin view; page with namespaces_after)
MAX_STATS_NAMESPACES = 256
#: longest hash_scheme / protocol_version string a Hello may carry, in bytes
MAX_VERSION_STRING_BYTES = 64
#: blocks one ReportCorrupt may name: the daemon checksums each under the host lock, so a
#: tenant must not make it hash a whole batch; readers report one block per failed read
MAX_CORRUPT_REPORT_BLOCKS = 16
#: fixed room in a request besides its hashes / ids / checksums (namespace, flags, framing)
REQUEST_OVERHEAD_BYTES = 64 << 10


F = TypeVar("F", bound=Callable[..., Any])

#: Snapshot lists every key of the node: it runs alone among its tenant's calls
WHOLE_BUDGET = 1 << 30


#: a lease id released costs this many hashes looked up (a dict pop and a lease's blocks
#: unpinned, against one 16-byte slice for a hash a lookup may never reach)
RELEASE_ID_WEIGHT = 8


def _hashes_cost(request: Any) -> int:
    return request_cost(len(request.hashes) // 16 + RELEASE_ID_WEIGHT * len(getattr(request, "release_lease_ids", ())))


def gated(cost: Callable[[Any], int]) -> Callable[[F], F]:
    """Run a handler as one of its caller's tenant's calls of ``cost(request)`` units
    (``TenantGate``); the caller is identified once here and reused by ``_caller``."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def inner(self: PoolService, request: Any, context: grpc.ServicerContext) -> Any:
            principal = principal_of(context, self.credentials)
            self._current.context, self._current.principal = context, principal
            self._current.walked = 0
            try:
                if self.credentials is not None and (principal.admin or principal.cluster):
                    return method(self, request, context)  # operators and the cluster's own calls
                tenant, units = self._tenant_of(principal, request), cost(request)
                with self.gate.admit(tenant, units, method.__name__):
                    reply = method(self, request, context)
                # the blocks it walked, billed now that they are known (fairness.TenantGate.charge)
                self.gate.charge(tenant, self._walk_units())
                return reply
            except KVPoolError as err:
                if method.__name__ == "Lease":  # why a reader got nothing: kvpool inspect lookup says
                    namespace = bytes(request.namespace)[:NAMESPACE_BYTES]
                    self.node.note_lease_refused(namespace, err.code.name, err.message)
                raise
            finally:
                self._current.context = self._current.principal = None

        return inner  # type: ignore[return-value]

    return wrap


def max_request_bytes(max_batch_blocks: int) -> int:
    """Largest request the service decodes: a full batch of hashes or commit checksums
    (<= 10 bytes each on the wire) plus a full list of release ids (<= 11 bytes each)."""
    return 16 * max_batch_blocks + 11 * MAX_RELEASE_IDS_PER_CALL + REQUEST_OVERHEAD_BYTES


class PoolService(pool_pb2_grpc.PoolServicer):
    def __init__(
        self,
        node: PoolNode,
        max_event_subscribers: int = 4,
        credentials: Credentials | None = None,
        arena_socket: str = "",
        local_socket: str = "",
        local_keys: LocalCallKeys | None = None,
        process_summary: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        """``arena_socket``: where clients get the arena (memfd hand-off), "" = by path;
        ``local_socket``: where same-host clients may send unary calls (kvpool.rpc.local_call), "" = none;
        ``process_summary``: the process's own counters for Stats (the local-call socket's, the
        garbage collector's), read at each call."""
        self.node = node
        self.arena_socket = arena_socket
        self.local_socket = local_socket
        self.local_keys = local_keys if local_keys is not None else LocalCallKeys()
        self.process_summary = process_summary
        self.credentials = credentials
        # each Events stream holds a worker thread: bound them so control calls always get one
        self._subscriber_slots = threading.BoundedSemaphore(max_event_subscribers)
        self.max_event_subscribers = max_event_subscribers
        self.admin_enabled = node.config.admin_enabled
        cfg = node.config
        self.limits = cfg.tenant_limits
        self.gate = self.limits.gate(cfg.grpc_workers)
        self._current = threading.local()  # the principal ``gated`` identified for this thread's call

    # helpers
    def _walk_units(self) -> float:
        """Cost units of the blocks this thread's call walked (``_current.walked``), billed
        after the call: ``walk_cost x walked / 1024``, a fraction for a short walk (so a flood
        of small lookups that hit pays for its walks too; before, walks under about 100 blocks
        owed nothing)."""
        return self.limits.walk_units(int(getattr(self._current, "walked", 0)))

    def _caller(self, context: grpc.ServicerContext) -> Principal:
        if getattr(self._current, "context", None) is context:
            principal: Principal = self._current.principal
            return principal
        return principal_of(context, self.credentials)

    def _tenant_of(self, principal: Principal, request: Any) -> Hashable:
        """Whose share a call counts against: the credential's tenant; without credentials
        (every caller is the same ANONYMOUS principal then) the namespace the call names, or
        for a Release / PutCommit / PutAbort the namespace of the lease or put it names, or
        else one share for every call that names no known namespace."""
        namespace = bytes(getattr(request, "namespace", b""))
        if self.credentials is not None or namespace:
            return tenant_key(self.credentials is not None, principal.name, namespace)
        ids = list(request.lease_ids[:1]) if hasattr(request, "lease_ids") else []
        ids += [request.put_id] if hasattr(request, "put_id") else []
        owner = self.node.store.owner_of(int(ids[0])) if ids else None
        return owner if owner is not None else b""

    def _authorise(self, principal: Principal, namespace: bytes) -> None:
        if not principal.may_use(namespace):
            raise PermissionDenied(
                f"credential {principal.name!r} may not use namespace {namespace.hex()[:64] or '(empty)'}",
                hint="the operator adds this digest to the tenant's namespaces in the credentials file "
                "(docs/security.md), or use the token of the tenant that owns it",
            )

    def _keys(self, request: Any, context: grpc.ServicerContext) -> tuple[NamespaceInfo, BlockKeys]:
        """The caller's right to the request's namespace (PermissionDenied if not), the
        registered namespace (UnknownNamespace if not) and the block keys of its hashes."""
        self._authorise(self._caller(context), bytes(request.namespace))
        info = self.node.namespace(request.namespace)
        keys = BlockKeys(info.digest, request.hashes)  # built lazily: a lookup stops at its first miss
        if len(keys) > self.node.config.store.max_batch_blocks:
            raise InvalidArgument(
                f"{len(keys)} blocks in one call; the limit is {self.node.config.store.max_batch_blocks}",
                hint="split the batch",
            )
        return info, keys

    def _release(self, lease_ids: Any) -> int:
        if len(lease_ids) > MAX_RELEASE_IDS_PER_CALL:
            raise InvalidArgument(
                f"{len(lease_ids)} lease ids in one call; the limit is {MAX_RELEASE_IDS_PER_CALL}",
                hint="release in smaller batches",
            )
        return self.node.store.release_many(lease_ids) if lease_ids else 0

    def _is_admin(self, principal: Principal) -> bool:
        return self.admin_enabled and principal.admin

    def _require_admin(self, principal: Principal, what: str) -> None:
        if not self.admin_enabled:
            raise PermissionDenied(
                f"{what} is an admin view and this daemon does not serve admin views on {self.node.config.listen}",
                hint="ask for your own namespace, or run the daemon with --admin-views on (see docs/security.md)",
            )
        if not principal.admin:
            raise PermissionDenied(
                f"{what} is an admin view and credential {principal.name!r} is not an admin's",
                hint="ask for your own namespace, or use an admin token (docs/security.md)",
            )

    def _scope(self, request: Any, context: grpc.ServicerContext, what: str) -> bytes | None:
        """The namespace a Snapshot / Events request is scoped to, or None for the admin view."""
        principal = self._caller(context)
        if request.all_namespaces:
            self._require_admin(principal, f"{what} of every namespace")
            return None
        if not request.namespace:
            raise InvalidArgument(
                f"{what} names no namespace", hint="send your namespace digest, or all_namespaces (admin)"
            )
        self._authorise(principal, bytes(request.namespace))
        return self.node.namespace(request.namespace).digest

    @typed_handler
    @gated(lambda r: 1)
    def Hello(self, request: pool_pb2.HelloRequest, context: grpc.ServicerContext) -> pool_pb2.HelloReply:
        for name in ("hash_scheme", "protocol_version"):
            if len(getattr(request, name).encode()) > MAX_VERSION_STRING_BYTES:
                raise InvalidArgument(f"Hello.{name} is longer than {MAX_VERSION_STRING_BYTES} bytes")
        if request.protocol_version != PROTOCOL_VERSION:
            raise InvalidArgument(
                f"protocol {request.protocol_version!r} is not {PROTOCOL_VERSION!r}",
                hint="use a client of the same kvpool version",
            )
        principal = self._caller(context)
        self._authorise(principal, bytes(request.namespace))
        spec = spec_from_msg(request.spec)
        info = self.node.register(request.hash_scheme, spec, request.namespace, request.spec_digest)
        cfg = self.node.config.store
        ticket_id, ticket_key, ticket_ttl_ms = b"", b"", 0
        issuer = self.credentials.tickets if self.credentials is not None else None
        if self.credentials is not None and issuer is not None:  # the data plane admits only callers seen here
            ticket_id, ticket_key = self.credentials.issue_ticket(principal, int(time.monotonic() * 1000)) or (b"", b"")
            ticket_ttl_ms = issuer.ttl_ms
        local_key_id, local_key = self.local_keys.issue() if self.local_socket else (b"", b"")
        return pool_pb2.HelloReply(
            local_key_id=local_key_id,
            local_key=local_key,
            data_ticket=ticket_id,
            data_ticket_key=ticket_key,
            data_ticket_ttl_ms=ticket_ttl_ms,
            node_id=self.node.node_id,
            hash_scheme=HASH_SCHEME,
            protocol_version=PROTOCOL_VERSION,
            arena_path=self.node.arena.path,
            arena_socket=self.arena_socket,
            local_socket=self.local_socket,
            arena_bytes=self.node.arena.capacity_bytes,
            lease_ttl_ms=cfg.lease_ttl_ms,
            max_batch_blocks=cfg.max_batch_blocks,
            block_bytes=info.spec.block_bytes,
            arena_segment_bytes=getattr(self.node.arena, "segment_bytes", 0),
            arena_page_bytes=self.node.arena.page_bytes,
        )

    @typed_handler
    @gated(_hashes_cost)
    def Lookup(self, request: pool_pb2.HashesRequest, context: grpc.ServicerContext) -> pool_pb2.LookupReply:
        info, keys = self._keys(request, context)
        self._release(request.release_lease_ids)
        hits = self.node.lookup(info, keys)
        self._current.walked = hits
        return pool_pb2.LookupReply(hits=hits)

    @typed_handler
    @gated(_hashes_cost)
    def Lease(self, request: pool_pb2.HashesRequest, context: grpc.ServicerContext) -> pool_pb2.LeaseReply:
        info, keys = self._keys(request, context)
        self._release(request.release_lease_ids)
        grant = self.node.lease(info, keys)
        self._current.walked = len(grant.locations)
        offsets = [loc.offset for loc in grant.locations]
        return pool_pb2.LeaseReply(
            lease_id=grant.lease_id,
            offsets=offsets,
            checksums=[loc.checksum for loc in grant.locations],
            block_bytes=info.spec.block_bytes,
            expires_in_ms=self.node.config.store.lease_ttl_ms,
            segment_generations=self.node.store.segment_generations(offsets),
        )

    @typed_handler
    @gated(lambda r: request_cost(RELEASE_ID_WEIGHT * len(r.lease_ids)))
    def Release(self, request: pool_pb2.ReleaseRequest, context: grpc.ServicerContext) -> pool_pb2.ReleaseReply:
        self._caller(context)
        return pool_pb2.ReleaseReply(expired=self._release(request.lease_ids))

    @typed_handler
    @gated(_hashes_cost)
    def PutStart(self, request: pool_pb2.HashesRequest, context: grpc.ServicerContext) -> pool_pb2.PutStartReply:
        info, keys = self._keys(request, context)
        self._release(request.release_lease_ids)
        grant = self.node.store.put_start(info.digest, keys, info.spec.block_bytes)
        return pool_pb2.PutStartReply(
            put_id=grant.put_id,
            indices=grant.indices,
            offsets=grant.offsets,
            segment_generations=self.node.store.segment_generations(grant.offsets),
            already_present=grant.already_present,
            in_flight=grant.in_flight,
            block_bytes=info.spec.block_bytes,
        )

    @typed_handler
    @gated(lambda r: request_cost(len(r.checksums)))
    def PutCommit(self, request: pool_pb2.PutCommitRequest, context: grpc.ServicerContext) -> pool_pb2.PutCommitReply:
        self._caller(context)
        # a same-host client's put: it checksummed each block's source in the pass that copied it
        verify_one_in = self.node.config.store.client_put_verify_one_in
        result = self.node.store.put_commit(request.put_id, list(request.checksums), verify_one_in)
        if result.checksum_failed:
            log.warning(
                "put %d: %d blocks failed their checksum at commit and were dropped",
                request.put_id,
                len(result.checksum_failed),
            )
        return pool_pb2.PutCommitReply(committed=result.committed, checksum_failed=result.checksum_failed)

    @typed_handler
    @gated(lambda r: 1)
    def PutAbort(self, request: pool_pb2.PutAbortRequest, context: grpc.ServicerContext) -> pool_pb2.Empty:
        self._caller(context)
        self.node.store.put_abort(request.put_id)
        return pool_pb2.Empty()

    @typed_handler
    @gated(_hashes_cost)
    def Remove(self, request: pool_pb2.HashesRequest, context: grpc.ServicerContext) -> pool_pb2.RemoveReply:
        _, keys = self._keys(request, context)
        self._release(request.release_lease_ids)  # a client's pending releases ride on any call
        return pool_pb2.RemoveReply(removed=self.node.remove(keys))

    @typed_handler
    @gated(_hashes_cost)
    def ReportCorrupt(
        self, request: pool_pb2.HashesRequest, context: grpc.ServicerContext
    ) -> pool_pb2.ReportCorruptReply:
        """A reader found these blocks failing their checksum: the node re-verifies them (a
        report alone never drops a block) and drops only the bad ones of this namespace."""
        info, keys = self._keys(request, context)
        if len(keys) > MAX_CORRUPT_REPORT_BLOCKS:
            raise InvalidArgument(
                f"{len(keys)} blocks reported corrupt in one call; the limit is {MAX_CORRUPT_REPORT_BLOCKS}",
                hint="report the first block that failed its checksum (nothing after it was checked)",
            )
        self._release(request.release_lease_ids)
        return pool_pb2.ReportCorruptReply(dropped=self.node.drop_corrupt(info, keys))

    @typed_handler
    @gated(_hashes_cost)
    def Pin(self, request: pool_pb2.PinRequest, context: grpc.ServicerContext) -> pool_pb2.PinReply:
        _, keys = self._keys(request, context)
        if request.unpin:
            return pool_pb2.PinReply(changed=self.node.store.unpin(keys))
        if not request.hard and request.ttl_ms == 0:
            raise InvalidArgument("a soft pin needs ttl_ms > 0", hint="set hard=true for a pin without TTL")
        ttl_ms = None if request.hard else int(request.ttl_ms)
        return pool_pb2.PinReply(changed=self.node.store.pin(keys, ttl_ms))

    @typed_handler
    def Inspect(self, request: pool_pb2.InspectRequest, context: grpc.ServicerContext) -> pool_pb2.StatsReply:
        """kvpool inspect lookup / hot: an admin view (kvpool.daemon.introspect)."""
        self._require_admin(self._caller(context), f"Inspect {request.what[:32]!r}")
        return pool_pb2.StatsReply(json=json.dumps(introspect.inspect(self.node, request)))

    @typed_handler
    @gated(lambda r: 4)
    def Stats(self, request: pool_pb2.StatsRequest, context: grpc.ServicerContext) -> pool_pb2.StatsReply:
        principal = self._caller(context)
        summary: dict[str, Any] = dict(self.node.store.summary())
        summary["node_id"] = self.node.node_id
        summary["arena_path"] = self.node.arena.path
        summary["arena_page_bytes"] = self.node.arena.page_bytes  # 4096, or the huge page size
        summary["arena_huge_pages"] = self.node.config.arena_huge_pages  # what was asked: off / on / thp / try
        summary["arena_transparent"] = self.node.arena.transparent  # on transparent huge pages (storage/thp.py)
        summary["arena_huge_bytes"] = self.node.arena.huge_bytes  # of the arena on huge pages
        summary["local_socket"] = self.local_socket  # same-host calls (kvpool.rpc.local_call); "" = off
        if self.process_summary is not None:
            summary.update(self.process_summary())
        # per-tenant arena (docs/security.md): its segments' size (0 = one piece), and how many
        # times a segment got fresh memory for a new owner
        summary["arena_segment_bytes"] = getattr(self.node.arena, "segment_bytes", 0)
        summary["arena_segments_renewed"] = getattr(self.node.arena, "renewed", 0)
        summary["hash_scheme"] = HASH_SCHEME
        summary["last_event_seq"] = self.node.events.last_seq
        host_policy = self.node.tier_policy("host")  # the host store does not know its policy's name
        summary["policy"] = host_policy
        if isinstance(summary.get("tiers"), dict) and isinstance(summary["tiers"].get("host"), dict):
            summary["tiers"]["host"].setdefault("policy", host_policy)
        summary.update(self.node.counters.summary())
        summary["tenant_calls_waited"] = self.gate.waited  # per-tenant fairness (fairness.py)
        summary["tenant_calls_refused"] = self.gate.refused
        summary.update(self._namespace_stats(request, principal))
        return pool_pb2.StatsReply(json=json.dumps(summary, sort_keys=True))

    def _namespace_stats(self, request: pool_pb2.StatsRequest, principal: Principal) -> dict[str, Any]:
        """The bounded namespace part of Stats: counts for everyone; the list of namespaces
        (paged, ``MAX_STATS_NAMESPACES`` at most) only as an admin view, else only the
        caller's own entry (one its credential may use)."""
        every = sorted(self.node.namespaces(), key=lambda ns: ns.digest)
        out: dict[str, Any] = {
            "namespaces_total": len(every),
            "namespaces_max": self.node.config.max_namespaces,
            "namespaces_retired": self.node.namespaces_retired,
        }
        if self._is_admin(principal):
            limit = min(request.namespaces_limit or MAX_STATS_NAMESPACES, MAX_STATS_NAMESPACES)
            after = bytes(request.namespaces_after)
            shown = [ns for ns in every if ns.digest > after][:limit]
            more = len(shown) == limit and shown[-1].digest != every[-1].digest
            out["namespaces_next"] = shown[-1].digest.hex() if more else ""
        else:
            own = bytes(request.namespace)
            shown = [ns for ns in every if own and ns.digest == own and principal.may_use(own)]
        out["namespaces"] = [
            {
                "digest": ns.digest.hex(),
                "spec": ns.spec.describe(),
                "block_bytes": ns.spec.block_bytes,
                "used_bytes": self.node.store.namespace_bytes(ns.digest),
                **self.node.counters.namespace_summary(ns.digest),
            }
            for ns in shown
        ]
        return out

    def Events(self, request: pool_pb2.EventsRequest, context: grpc.ServicerContext) -> Iterator[pool_pb2.Event]:
        try:
            scope = self._scope(request, context, "the event stream")
        except KVPoolError as err:  # Unauthenticated, UnknownNamespace, PermissionDenied, InvalidArgument
            abort_with(context, err)
        if not self._subscriber_slots.acquire(blocking=False):
            abort_with(
                context,
                CapacityExhausted(
                    f"{self.max_event_subscribers} event subscribers are already attached",
                    hint="share one subscription (e.g. through the router) or raise --grpc-workers",
                ),
            )
        try:
            for event in self.node.events.follow(int(request.from_seq), context.is_active, namespace=scope):
                yield event_to_msg(event)
        finally:
            self._subscriber_slots.release()

    @typed_handler
    @gated(lambda r: WHOLE_BUDGET)
    def Snapshot(self, request: pool_pb2.SnapshotRequest, context: grpc.ServicerContext) -> pool_pb2.SnapshotReply:
        scope = self._scope(request, context, "a snapshot")
        if scope is None:
            last_seq = self.node.events.last_seq  # read first: events after it are replayed on top
            hashes = [key_hash(k) for k in self.node.store.snapshot_keys()]
        else:
            last_seq = self.node.events.last_seq_of(scope)
            hashes = hashes_of([k for k in self.node.store.snapshot_keys() if k.startswith(scope)])
        return pool_pb2.SnapshotReply(node_id=self.node.node_id, last_seq=last_seq, hashes=pack_hashes(hashes))
