"""What ``PoolClient`` and ``AsyncPoolClient`` share: the call limits and retry rule, the
requests they build, how a ``Hello`` reply becomes an arena mapping, and ``PutResult``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.client.blocks import block_rows
from kvpool.core.arena_map import ArenaMapping, PutWindow
from kvpool.core.arena_segments import SegmentedMapping
from kvpool.core.errors import InvalidArgument
from kvpool.core.hashing import HASH_SCHEME, pack_hashes
from kvpool.core.spec import KVSpec, Namespace
from kvpool.proto import pool_pb2
from kvpool.rpc.codec import PROTOCOL_VERSION, spec_to_msg
from kvpool.transport.arena_handoff import receive_arena_fd, receive_arena_segment

DEFAULT_TIMEOUT_S = 10.0
MAX_MESSAGE_BYTES = 64 << 20
#: a call refused TENANT_BUSY (this tenant's share of the node is in flight; nothing was
#: done) is sent again this many times, after 10, 20, 40 ms
BUSY_RETRIES = 3
BUSY_BACKOFF_S = 0.010


@dataclass(frozen=True)
class PutResult:
    """What one put did: ``stored`` blocks committed now, ``already_present`` skipped (the pool had them),
    ``in_flight`` skipped (another writer is storing them), ``checksum_failed`` refused at commit (their bytes
    did not match the checksum; recompute and put again). The node checks a random sample of a put's
    blocks (all of them once one fails): a bad block outside it is a miss at its first read instead.
    """

    stored: int  # blocks written and committed by this call
    already_present: int  # skipped: the pool had them
    in_flight: int  # skipped: another writer is storing them now
    checksum_failed: int  # written but rejected at commit (not stored; of the blocks the node checked)


#: each Pool method's reply type, by name (what a local call's reply decodes as)
REPLY_TYPES: dict[str, Any] = {
    m.name: getattr(pool_pb2, m.output_type.name) for m in pool_pb2.DESCRIPTOR.services_by_name["Pool"].methods
}


def hello_request(namespace: Namespace) -> pool_pb2.HelloRequest:
    return pool_pb2.HelloRequest(
        hash_scheme=HASH_SCHEME,
        protocol_version=PROTOCOL_VERSION,
        spec=spec_to_msg(namespace.spec),
        namespace=namespace.digest(),
        spec_digest=namespace.spec.digest(),
    )


def attach_arena(
    current: ArenaMapping | None, reply: pool_pb2.HelloReply, spec: KVSpec, token: str = ""
) -> ArenaMapping:
    """Check a Hello reply against the spec and map the node's arena read-only (again only
    if it moved: a restarted daemon has a new arena file or socket). Shared by the sync and
    async clients. A node that hands its arena out (``arena_socket``) gives this client a
    read-only descriptor for its token; ``put_window`` gets the writable one for a put."""
    if reply.block_bytes != spec.block_bytes:
        raise InvalidArgument(f"daemon reports {reply.block_bytes}-byte blocks, spec says {spec.block_bytes}")
    source = reply.arena_socket or reply.arena_path
    if current is not None and current.path == source:
        return current
    if current is not None:
        current.close()
    if reply.arena_socket and reply.arena_segment_bytes:  # per tenant: segments mapped as leases name them
        socket_path = reply.arena_socket

        def fetch(mode: str, put_id: int, segment: int) -> tuple[int, int]:
            return receive_arena_segment(socket_path, mode, put_id, segment, token)

        arena: ArenaMapping = SegmentedMapping(socket_path, reply.arena_bytes, reply.arena_segment_bytes, fetch)
    elif reply.arena_socket:
        fd = receive_arena_fd(reply.arena_socket, "r", 0, token)
        arena = ArenaMapping.from_fd(fd, reply.arena_bytes, name=reply.arena_socket)
    else:
        arena = ArenaMapping.attach(reply.arena_path, reply.arena_bytes)
    arena.adopt_page_bytes(reply.arena_page_bytes)
    return arena


def put_window(
    arena: ArenaMapping,
    put_id: int,
    offsets: Sequence[int],
    block_bytes: int,
    token: str,
    generations: Sequence[int] = (),
    own_copy: bool = False,
) -> PutWindow:
    """Writable mappings of only the slots of put ``put_id`` (``ArenaMapping.put_window``), to
    be closed when its bytes are in. A handed-out arena's write descriptor is asked for
    once, naming the put (the node hands it only to a put's holder), and kept for later
    puts' windows; nothing outside a window is ever mapped writable in the client. A
    per-tenant arena asks for each segment's (``generations``: the reply's) the same way.
    ``own_copy``: the caller writes with ``write_rows`` (``ArenaMapping.put_window``)."""
    if isinstance(arena, SegmentedMapping):
        arena.ensure(offsets, generations, put_id)
        return arena.put_window(offsets, block_bytes)
    if not arena.can_write:
        arena.adopt_write_fd(receive_arena_fd(arena.path, "w", put_id, token))
    return arena.put_window(offsets, block_bytes, own_copy)


def hashes_request(
    ns_digest: bytes, hashes: Sequence[bytes], releases: list[int], max_batch_blocks: int
) -> pool_pb2.HashesRequest:
    if max_batch_blocks and len(hashes) > max_batch_blocks:
        raise InvalidArgument(
            f"{len(hashes)} blocks in one call; the daemon allows {max_batch_blocks}", hint="split the batch"
        )
    return pool_pb2.HashesRequest(namespace=ns_digest, hashes=pack_hashes(hashes), release_lease_ids=releases)


def put_rows(blocks: Any, spec: KVSpec, hashes: Sequence[bytes]) -> np.ndarray:
    rows = block_rows(blocks, spec, "blocks")
    if rows.shape[0] != len(hashes):
        raise InvalidArgument(f"{len(hashes)} hashes for {rows.shape[0]} blocks")
    return rows


def out_rows(out: Any, spec: KVSpec, hashes: Sequence[bytes]) -> np.ndarray:
    rows = block_rows(out, spec, "out", writable=True)
    if rows.shape[0] < len(hashes):
        raise InvalidArgument(f"out holds {rows.shape[0]} blocks, {len(hashes)} were asked for")
    return rows


def put_result(start: pool_pb2.PutStartReply, done: pool_pb2.PutCommitReply | None) -> PutResult:
    committed = int(done.committed) if done is not None else 0
    failed = len(done.checksum_failed) if done is not None else 0
    return PutResult(committed, len(start.already_present), len(start.in_flight), failed)
