"""The Pool gRPC service: decode a request, call the node, encode the reply.

Every handler is wrapped by ``typed_handler``: a KVPoolError becomes its status code
with a hint; any other exception is logged and answered INTERNAL, and the daemon goes
on serving. Nothing here touches block bytes except the store's commit-time check.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from kvpool.core.errors import CapacityExhausted, InvalidArgument, LeaseExpired
from kvpool.core.hashing import HASH_SCHEME, pack_hashes, unpack_hashes
from kvpool.daemon.node import NamespaceInfo, PoolNode
from kvpool.proto import pool_pb2, pool_pb2_grpc
from kvpool.rpc.codec import PROTOCOL_VERSION, event_to_msg, spec_from_msg
from kvpool.rpc.errors import abort_with, typed_handler

log = logging.getLogger("kvpool.service")


class PoolService(pool_pb2_grpc.PoolServicer):
    def __init__(self, node: PoolNode, max_event_subscribers: int = 4) -> None:
        self.node = node
        # each Events stream holds a worker thread: bound them so control calls always get one
        self._subscriber_slots = threading.BoundedSemaphore(max_event_subscribers)
        self.max_event_subscribers = max_event_subscribers

    # helpers
    def _keys(self, request: Any) -> tuple[NamespaceInfo, list[bytes]]:
        """The request's registered namespace (UnknownNamespace if not) and its block hashes."""
        return self.node.namespace(request.namespace), unpack_hashes(request.hashes)

    def _release(self, lease_ids: Any) -> int:
        expired = 0
        for lease_id in lease_ids:
            try:
                self.node.store.release(lease_id)
            except LeaseExpired:
                expired += 1
        return expired

    @typed_handler
    def Hello(self, request: pool_pb2.HelloRequest, context: grpc.ServicerContext) -> pool_pb2.HelloReply:
        if request.protocol_version != PROTOCOL_VERSION:
            raise InvalidArgument(
                f"protocol {request.protocol_version!r} is not {PROTOCOL_VERSION!r}",
                hint="use a client of the same kvpool version",
            )
        spec = spec_from_msg(request.spec)
        info = self.node.register(request.hash_scheme, spec, request.namespace, request.spec_digest)
        cfg = self.node.config.store
        return pool_pb2.HelloReply(
            node_id=self.node.node_id,
            hash_scheme=HASH_SCHEME,
            protocol_version=PROTOCOL_VERSION,
            arena_path=self.node.arena.path,
            arena_bytes=self.node.arena.capacity_bytes,
            lease_ttl_ms=cfg.lease_ttl_ms,
            max_batch_blocks=cfg.max_batch_blocks,
            block_bytes=info.spec.block_bytes,
        )

    @typed_handler
    def Lookup(self, request: pool_pb2.HashesRequest, context: grpc.ServicerContext) -> pool_pb2.LookupReply:
        _, keys = self._keys(request)
        self._release(request.release_lease_ids)
        return pool_pb2.LookupReply(hits=self.node.store.lookup(keys))

    @typed_handler
    def Lease(self, request: pool_pb2.HashesRequest, context: grpc.ServicerContext) -> pool_pb2.LeaseReply:
        info, keys = self._keys(request)
        self._release(request.release_lease_ids)
        grant = self.node.store.lease(keys)
        return pool_pb2.LeaseReply(
            lease_id=grant.lease_id,
            offsets=[loc.offset for loc in grant.locations],
            checksums=[loc.checksum for loc in grant.locations],
            block_bytes=info.spec.block_bytes,
            expires_in_ms=self.node.config.store.lease_ttl_ms,
        )

    @typed_handler
    def Release(self, request: pool_pb2.ReleaseRequest, context: grpc.ServicerContext) -> pool_pb2.ReleaseReply:
        return pool_pb2.ReleaseReply(expired=self._release(request.lease_ids))

    @typed_handler
    def PutStart(self, request: pool_pb2.HashesRequest, context: grpc.ServicerContext) -> pool_pb2.PutStartReply:
        info, keys = self._keys(request)
        self._release(request.release_lease_ids)
        grant = self.node.store.put_start(request.namespace, keys, info.spec.block_bytes)
        return pool_pb2.PutStartReply(
            put_id=grant.put_id,
            indices=[i for i, _ in grant.slots],
            offsets=[off for _, off in grant.slots],
            already_present=grant.already_present,
            in_flight=grant.in_flight,
            block_bytes=info.spec.block_bytes,
        )

    @typed_handler
    def PutCommit(self, request: pool_pb2.PutCommitRequest, context: grpc.ServicerContext) -> pool_pb2.PutCommitReply:
        result = self.node.store.put_commit(request.put_id, list(request.checksums))
        if result.checksum_failed:
            log.warning(
                "put %d: %d blocks failed their checksum at commit and were dropped",
                request.put_id,
                len(result.checksum_failed),
            )
        return pool_pb2.PutCommitReply(committed=result.committed, checksum_failed=result.checksum_failed)

    @typed_handler
    def PutAbort(self, request: pool_pb2.PutAbortRequest, context: grpc.ServicerContext) -> pool_pb2.Empty:
        self.node.store.put_abort(request.put_id)
        return pool_pb2.Empty()

    @typed_handler
    def Remove(self, request: pool_pb2.HashesRequest, context: grpc.ServicerContext) -> pool_pb2.RemoveReply:
        _, keys = self._keys(request)
        return pool_pb2.RemoveReply(removed=self.node.store.remove(keys))

    @typed_handler
    def Pin(self, request: pool_pb2.PinRequest, context: grpc.ServicerContext) -> pool_pb2.PinReply:
        _, keys = self._keys(request)
        if request.unpin:
            return pool_pb2.PinReply(changed=self.node.store.unpin(keys))
        if not request.hard and request.ttl_ms == 0:
            raise InvalidArgument("a soft pin needs ttl_ms > 0", hint="set hard=true for a pin without TTL")
        ttl_ms = None if request.hard else int(request.ttl_ms)
        return pool_pb2.PinReply(changed=self.node.store.pin(keys, ttl_ms))

    @typed_handler
    def Stats(self, request: pool_pb2.StatsRequest, context: grpc.ServicerContext) -> pool_pb2.StatsReply:
        summary: dict[str, Any] = dict(self.node.store.summary())
        summary["node_id"] = self.node.node_id
        summary["arena_path"] = self.node.arena.path
        summary["hash_scheme"] = HASH_SCHEME
        summary["last_event_seq"] = self.node.events.last_seq
        summary["namespaces"] = [
            {"digest": ns.digest.hex(), "spec": ns.spec.describe(), "block_bytes": ns.spec.block_bytes}
            for ns in self.node.namespaces()
        ]
        return pool_pb2.StatsReply(json=json.dumps(summary, sort_keys=True))

    def Events(self, request: pool_pb2.EventsRequest, context: grpc.ServicerContext) -> Iterator[pool_pb2.Event]:
        if not self._subscriber_slots.acquire(blocking=False):
            abort_with(
                context,
                CapacityExhausted(
                    f"{self.max_event_subscribers} event subscribers are already attached",
                    hint="share one subscription (e.g. through the router) or raise --grpc-workers",
                ),
            )
        try:
            for event in self.node.events.follow(int(request.from_seq), context.is_active):
                yield event_to_msg(event)
        finally:
            self._subscriber_slots.release()

    @typed_handler
    def Snapshot(self, request: pool_pb2.SnapshotRequest, context: grpc.ServicerContext) -> pool_pb2.SnapshotReply:
        last_seq = self.node.events.last_seq  # read first: events after it are replayed on top
        keys = self.node.store.snapshot_keys()
        if request.namespace:
            self.node.namespace(request.namespace)
            keys = [k for k in keys if (e := self.node.store.entry(k)) is not None and e.namespace == request.namespace]
        return pool_pb2.SnapshotReply(node_id=self.node.node_id, last_seq=last_seq, hashes=pack_hashes(keys))
