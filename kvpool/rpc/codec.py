"""Conversions between core types and their protobuf messages."""

from __future__ import annotations

from kvpool.core.events import EventKind, KVEvent
from kvpool.core.hashing import unpack_hashes
from kvpool.core.spec import KVSpec
from kvpool.proto import pool_pb2

PROTOCOL_VERSION = "kvpool.v1"
SERVICE_NAME = "kvpool.v1.Pool"


def spec_to_msg(spec: KVSpec) -> pool_pb2.Spec:
    return pool_pb2.Spec(
        model=spec.model,
        revision=spec.revision,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=spec.dtype,
        block_tokens=spec.block_tokens,
        kind=spec.kind,
    )


def spec_from_msg(msg: pool_pb2.Spec) -> KVSpec:
    return KVSpec(
        model=msg.model,
        revision=msg.revision,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        dtype=msg.dtype,
        block_tokens=msg.block_tokens,
        kind=msg.kind or "mha",
    )


def event_to_msg(event: KVEvent) -> pool_pb2.Event:
    return pool_pb2.Event(
        node_id=event.node_id,
        seq=event.seq,
        kind=event.kind.value,
        hashes=b"".join(event.hashes),
        tier=event.tier,
        namespace=event.namespace,
        block_tokens=event.block_tokens,
    )


def event_from_msg(msg: pool_pb2.Event) -> KVEvent:
    return KVEvent(
        node_id=msg.node_id,
        seq=msg.seq,
        kind=EventKind(msg.kind),
        hashes=tuple(unpack_hashes(msg.hashes)),
        tier=msg.tier,
        namespace=msg.namespace,
        block_tokens=msg.block_tokens,
    )


def _message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options for every kvpool gRPC channel. Each channel keeps its own subchannels: by
    default gRPC shares them process-wide, so a new channel to a daemon that was down
    inherits the old one's reconnect backoff (1 s, then x1.6 per failure) and keeps failing
    with the stale "connection refused" after the daemon is back; a client that reconnects
    by making a new channel (``ResilientPool``) would then miss a restarted pool for seconds."""
    return [*_message_options(max_message_bytes), ("grpc.use_local_subchannel_pool", 1)]


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options for every kvpool gRPC server. SO_REUSEPORT is off: gRPC turns it on by default,
    which would let a second daemon silently share a port in use instead of failing to start."""
    return [*_message_options(max_message_bytes), ("grpc.so_reuseport", 0)]
