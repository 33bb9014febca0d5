"""``PoolAdmin``: calls for operators and tools (stats, events, snapshots).

The inspection CLI uses it; it needs no KVSpec and maps no arena, so it works from any
host that can reach the daemon's control port. Without a ``namespace`` it asks for the
admin views (every namespace's events and blocks, the namespace list), which a daemon
serves only where admin views are enabled on its listener (docs/security.md); with one
(``PoolClient`` passes its own) every view is scoped to that namespace. Against a daemon
with credentials the admin views need an admin ``token``; ``tls_root_certs`` (PEM) opens a
TLS channel.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from kvpool.core.events import KVEvent
from kvpool.core.hashing import pack_hashes, unpack_hashes
from kvpool.proto import pool_pb2, pool_pb2_grpc
from kvpool.rpc.auth import call_metadata, make_channel
from kvpool.rpc.codec import event_from_msg
from kvpool.rpc.errors import from_rpc_error


class PoolAdmin:
    """Operator calls on one daemon: stats, events, snapshots, explain, hot, and block
    removal / pinning by namespace. No KVSpec, no arena mapping; a context manager."""

    def __init__(
        self,
        address: str,
        timeout_s: float = 5.0,
        channel: grpc.Channel | None = None,
        namespace: bytes = b"",
        token: str = "",
        tls_root_certs: bytes | None = None,
    ) -> None:
        """``channel``: share an existing channel (PoolClient does); it is then not closed here.
        ``namespace``: scope every view to this namespace digest ("" = admin views)."""
        self.address = address
        self.namespace = namespace
        self.timeout_s = timeout_s
        self._owns_channel = channel is None
        self._metadata = call_metadata(token)
        self._channel = channel if channel is not None else make_channel(address, (), tls_root_certs)
        self._stub = pool_pb2_grpc.PoolStub(self._channel)

    def __enter__(self) -> PoolAdmin:
        return self

    def _call(self, method: str, request: Any) -> Any:
        """One unary call; a gRPC error becomes the typed KVPoolError naming the address."""
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.address) from None

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self, namespaces_after: bytes = b"", namespaces_limit: int = 0) -> dict[str, Any]:
        """The node's counters; ``namespaces`` lists one page of namespaces (admin view;
        ``namespaces_next`` is the digest to pass as ``namespaces_after`` for the next)."""
        request = pool_pb2.StatsRequest(
            namespace=self.namespace, namespaces_after=namespaces_after, namespaces_limit=namespaces_limit
        )
        reply = self._call("Stats", request)
        result: dict[str, Any] = json.loads(reply.json)
        return result

    def snapshot(self, namespace: bytes = b"") -> tuple[int, list[bytes]]:
        """(last event seq, block hashes) of ``namespace`` (default: this admin's scope; with
        neither, every namespace's: an admin view)."""
        scope = namespace or self.namespace
        request = pool_pb2.SnapshotRequest(namespace=scope, all_namespaces=not scope)
        reply = self._call("Snapshot", request)
        return int(reply.last_seq), unpack_hashes(reply.hashes)

    def events(self, from_seq: int = 0) -> Iterator[KVEvent]:
        """Follow the node's events (blocks). A gap in seq means: resync with ``snapshot``.
        Scoped to this admin's namespace (its own seq numbers) or, without one, every
        namespace's (node-wide seq numbers; an admin view)."""
        request = pool_pb2.EventsRequest(from_seq=from_seq, namespace=self.namespace, all_namespaces=not self.namespace)
        try:
            for msg in self._stub.Events(request, metadata=self._metadata):
                yield event_from_msg(msg)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                return
            raise from_rpc_error(exc, self.address) from None

    def explain(self, namespace: bytes, hashes: Sequence[bytes] = (), token_ids: Sequence[int] = ()) -> dict[str, Any]:
        """Why a prompt hits or misses on this node (an admin view, ``kvpool inspect lookup``):
        per block hit / miss with its tier, and why the chain stops (a put in flight, evicted by
        which policy and when, a checksum failure or I/O error and the tier that found it,
        removed, other namespace, never stored), and ``lease_refused``: why the namespace's
        latest lease was refused (TENANT_BUSY, PERMISSION_DENIED, max_leases, ...). Give ``hashes`` of
        ``namespace``'s chain or its ``token_ids`` (hashed by the daemon with the namespace's
        spec). Does not count as a lookup. Keys of the reply: ``kvpool.daemon.introspect``."""
        request = pool_pb2.InspectRequest(
            what="explain", namespace=namespace, hashes=pack_hashes(list(hashes)), token_ids=list(token_ids)
        )
        return self._inspect(request)

    def hot(self, limit: int = 20) -> dict[str, Any]:
        """The node's most-read blocks and prefixes, ``limit`` of each (an admin view; decayed
        counts, see ``kvpool.daemon.block_history.HotBlocks``)."""
        return self._inspect(pool_pb2.InspectRequest(what="hot", limit=limit))

    def _inspect(self, request: pool_pb2.InspectRequest) -> dict[str, Any]:
        reply = self._call("Inspect", request)
        result: dict[str, Any] = json.loads(reply.json)
        return result

    def remove(self, namespace: bytes, hashes: Sequence[bytes]) -> int:
        """Remove these blocks of ``namespace`` from the node (``kvpool inspect evict`` and
        ``clear``); blocks under a read lease go once the lease ends. Returns how many were
        removed. Needs a credential that may use ``namespace`` (an admin's may use any)."""
        request = pool_pb2.HashesRequest(namespace=namespace, hashes=pack_hashes(list(hashes)))
        reply = self._call("Remove", request)
        return int(reply.removed)

    def pin(self, namespace: bytes, hashes: Sequence[bytes], ttl_ms: int | None = None, unpin: bool = False) -> int:
        """Pin blocks of ``namespace`` against eviction: softly for ``ttl_ms``, or hard
        (``ttl_ms=None``, until unpinned); ``unpin=True`` removes both kinds. Returns how many
        blocks changed."""
        request = pool_pb2.PinRequest(
            namespace=namespace,
            hashes=pack_hashes(list(hashes)),
            hard=ttl_ms is None and not unpin,
            ttl_ms=ttl_ms or 0,
            unpin=unpin,
        )
        reply = self._call("Pin", request)
        return int(reply.changed)

    def close(self) -> None:
        """Close the channel, unless it was lent by the caller (``channel=``)."""
        if self._owns_channel:
            self._channel.close()
