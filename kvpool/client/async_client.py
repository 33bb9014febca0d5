"""``AsyncPoolClient``: the asyncio twin of ``PoolClient`` for engines built on asyncio.

Same calls, same semantics, awaited: control calls go over the daemon's same-host socket
when it offers one (``AsyncLocalChannel``), else over ``grpc.aio``; the block
copies through the mapped arena are plain memcpys done inline (a 4 MiB block copies
in well under a millisecond, less than the cost of handing it to a thread).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from kvpool.client.blocks import read_rows, write_rows
from kvpool.client.pool_common import (
    BUSY_BACKOFF_S,
    BUSY_RETRIES,
    DEFAULT_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    REPLY_TYPES,
    PutResult,
    attach_arena,
    hashes_request,
    hello_request,
    out_rows,
    put_result,
    put_rows,
    put_window,
)
from kvpool.core.arena_map import ArenaMapping
from kvpool.core.errors import KVPoolError, TenantBusy, Unavailable, UnknownNamespace
from kvpool.core.hashing import block_hashes
from kvpool.core.spec import KVSpec, Namespace
from kvpool.proto import pool_pb2, pool_pb2_grpc
from kvpool.rpc.auth import call_metadata, make_channel
from kvpool.rpc.codec import channel_options
from kvpool.rpc.errors import from_rpc_error
from kvpool.rpc.local_call import LocalCallClosed
from kvpool.rpc.local_channel import AsyncLocalChannel

log = logging.getLogger("kvpool.client")


class AsyncPoolClient:
    """The asyncio twin of ``PoolClient``: the same calls and semantics, awaited (control over the daemon's
    same-host socket, or ``grpc.aio``; block copies through the mapped arena inline). Use one per event
    loop; ``async with await AsyncPoolClient.connect(...)``.
    """

    def __init__(
        self,
        address: str,
        namespace: Namespace,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        token: str = "",
        tls_root_certs: bytes | None = None,
        local_calls: bool = True,
    ) -> None:
        """Prefer ``await AsyncPoolClient.connect(...)``, which says hello and maps the arena; the arguments are
        ``PoolClient``'s.
        """
        self.address = address
        self.namespace = namespace
        self.spec = namespace.spec
        self.timeout_s = timeout_s
        self._ns_digest = namespace.digest()
        self._token = token
        self._metadata = call_metadata(token)
        self._channel = make_channel(address, channel_options(MAX_MESSAGE_BYTES), tls_root_certs, aio=True)
        self._stub = pool_pb2_grpc.PoolStub(self._channel)
        self._use_local = local_calls
        self._local: AsyncLocalChannel | None = None  # opened after Hello when the daemon offers it
        self._hello_lock = asyncio.Lock()
        self._arena: ArenaMapping | None = None
        self._pending_releases: list[int] = []
        self.node_id = ""
        self.max_batch_blocks = 0

    @classmethod
    async def connect(
        cls,
        address: str,
        spec: KVSpec,
        salt: bytes = b"",
        adapter: str = "",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        token: str = "",
        tls_root_certs: bytes | None = None,
        local_calls: bool = True,
    ) -> AsyncPoolClient:
        """Connect, register the namespace, map the arena (``token``, ``local_calls``: see ``PoolClient.connect``)."""
        client = cls(address, Namespace(spec, salt, adapter), timeout_s, token, tls_root_certs, local_calls)
        try:
            await client._hello()
        except BaseException:
            await client.close()
            raise
        return client

    async def __aenter__(self) -> AsyncPoolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _rpc(self, method: str, request: Any) -> Any:
        for attempt in range(BUSY_RETRIES + 1):  # TENANT_BUSY: as PoolClient._rpc
            try:
                return await self._call(method, request)
            except TenantBusy:
                if attempt == BUSY_RETRIES:
                    raise
            await asyncio.sleep(BUSY_BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable")

    async def _call(self, method: str, request: Any) -> Any:
        """As ``PoolClient._call``: the local socket when open, else gRPC."""
        local = self._local if method != "Hello" else None
        if local is not None:
            try:
                return await local.call(method, request, REPLY_TYPES[method], MAX_MESSAGE_BYTES)
            except LocalCallClosed as err:
                if err.gone and self._local is local:
                    log.warning("local calls to %s stopped (%s): using gRPC until the next hello", self.address, err)
                    self._local = None
                    local.close()
                if err.sent:
                    raise
        try:
            return await getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.address) from None

    async def _open_local(self, reply: pool_pb2.HelloReply) -> None:
        if self._local is not None:
            self._local.close()
            self._local = None
        if not (self._use_local and reply.local_socket):
            return
        try:
            self._local = await AsyncLocalChannel.open(
                reply.local_socket, reply.local_key_id, reply.local_key, self._token, reply.node_id, self.timeout_s
            )
        except KVPoolError as err:
            log.info("control calls to %s go through gRPC: %s", self.address, err.message)

    async def _hello(self) -> None:
        async with self._hello_lock:  # coroutines re-registering at once: one mapping, one channel
            reply = await self._rpc("Hello", hello_request(self.namespace))
            self._arena = attach_arena(self._arena, reply, self.spec, self._token)
            await self._open_local(reply)
        self.node_id = reply.node_id
        self.max_batch_blocks = reply.max_batch_blocks

    async def _hashes_call(self, method: str, hashes: Sequence[bytes]) -> Any:
        def request() -> pool_pb2.HashesRequest:
            releases, self._pending_releases = self._pending_releases, []
            return hashes_request(self._ns_digest, hashes, releases, self.max_batch_blocks)

        try:
            return await self._rpc(method, request())
        except UnknownNamespace:
            self._pending_releases.clear()
            await self._hello()
            return await self._rpc(method, request())

    @property
    def arena(self) -> np.ndarray:
        """The mapped arena as a uint8 array; Unavailable before connect."""
        if self._arena is None:
            raise Unavailable(f"not connected to {self.address}", hint="use AsyncPoolClient.connect")
        return self._arena.view

    def hashes(self, token_ids: Any, extras: Sequence[bytes] | None = None) -> list[bytes]:
        """The block-hash chain of a prompt in this client's namespace (full blocks only; no I/O)."""
        return block_hashes(self.namespace, token_ids, extras)

    async def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` the pool holds now."""
        if not hashes:
            return 0
        return int((await self._hashes_call("Lookup", hashes)).hits)

    async def put(self, hashes: Sequence[bytes], blocks: Any) -> PutResult:
        """Store blocks ([n, *spec.block_shape]) under ``hashes``; present ones are skipped (``PutResult``)."""
        rows = put_rows(blocks, self.spec, hashes)
        if not hashes:
            return PutResult(0, 0, 0, 0)
        start = await self._hashes_call("PutStart", hashes)
        if start.put_id == 0:
            return put_result(start, None)
        try:
            self.arena  # noqa: B018 -- Unavailable if not connected
            assert self._arena is not None
            with put_window(
                self._arena,
                int(start.put_id),
                start.offsets,
                self.spec.block_bytes,
                self._token,
                start.segment_generations,
                own_copy=True,
            ) as window:
                checksums = write_rows(window, rows, start.indices, start.offsets)
        except BaseException:
            await self._rpc("PutAbort", pool_pb2.PutAbortRequest(put_id=start.put_id))
            raise
        done = await self._rpc("PutCommit", pool_pb2.PutCommitRequest(put_id=start.put_id, checksums=checksums))
        return put_result(start, done)

    async def get_into(self, hashes: Sequence[bytes], out: Any) -> int:
        """Read the leading cached blocks of ``hashes`` into ``out``, each checksum-verified; returns how many. A
        block that fails its check ends the run and is reported to the node.
        """
        rows = out_rows(out, self.spec, hashes)
        if not hashes:
            return 0
        reply = await self._hashes_call("Lease", hashes)
        if reply.lease_id == 0:
            return 0
        try:
            arena = self._arena  # taken once: a reconnect may replace it meanwhile
            if arena is None:
                raise Unavailable(f"not connected to {self.address}")
            arena.ensure(reply.offsets, reply.segment_generations)  # per tenant: map new segments
            good = read_rows(arena.view, rows, reply.offsets, reply.checksums, f"node {self.node_id}")
        finally:
            self._pending_releases.append(int(reply.lease_id))
        if good < len(reply.offsets):  # block ``good`` failed its checksum: tell the node
            await self.report_corrupt([hashes[good]])
        return good

    async def report_corrupt(self, hashes: Sequence[bytes]) -> int:
        """``PoolClient.report_corrupt``: the node re-verifies and drops what really is bad.
        Returns how many it dropped; never raises."""
        try:
            reply = await self._hashes_call("ReportCorrupt", hashes)
        except KVPoolError as err:
            log.warning("could not report %d corrupt blocks to %s: %s", len(hashes), self.address, err)
            return 0
        return int(reply.dropped)

    async def get(self, hashes: Sequence[bytes]) -> np.ndarray:
        """The leading cached blocks of ``hashes`` as a new array [hits, *block_shape]."""
        out = np.empty((len(hashes), *self.spec.block_shape), dtype=self.spec.numpy_dtype)
        n = await self.get_into(hashes, out)
        return out[:n]

    async def remove(self, hashes: Sequence[bytes]) -> int:
        """Remove these blocks of this namespace from the node; returns how many were removed."""
        if not hashes:
            return 0
        return int((await self._hashes_call("Remove", hashes)).removed)

    async def close(self) -> None:
        """Release pending leases, unmap the arena, close the channel."""
        if self._pending_releases:
            try:
                await self._rpc("Release", pool_pb2.ReleaseRequest(lease_ids=self._pending_releases))
            except KVPoolError:
                pass
            self._pending_releases = []
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        if self._local is not None:
            self._local.close()
            self._local = None
        await self._channel.close(None)
