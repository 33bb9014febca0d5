"""``PoolClient``: the library serving engines link to reach a kvpool node on their host.

    with PoolClient.connect("127.0.0.1:7450", spec, salt=b"tenant-a") as c:
        hashes = c.hashes(token_ids)      # one 16-byte hash per full block
        n = c.lookup(hashes)              # leading blocks present in the pool
        c.put(hashes, blocks)             # blocks: [n, *spec.block_shape]
        arr = c.get(hashes[:n])           # new array
        c.get_into(hashes[:n], out)       # into the caller's buffer

Against a daemon with credentials pass ``token=`` (sent as ``authorization: Bearer``
metadata on every gRPC call, once per connection on the same-host socket) and, where it
serves TLS, ``tls_root_certs=`` (PEM bytes of the CA that signed its certificate);
docs/security.md.

One control round trip per batch (over the daemon's same-host Unix socket when it offers
one, ``kvpool.rpc.local_call``; gRPC otherwise), one memcpy per block through
the node's shared-memory arena, a checksum on each block at both ends. Releases of
read leases ride on the next call (or ``close``); a lease never released expires after
the daemon's lease TTL. A block that fails its checksum is a miss, never an exception.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from kvpool.client.admin import PoolAdmin
from kvpool.client.blocks import BlockFill, BlockUse, fill_slots, read_rows, use_rows, write_rows
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
from kvpool.client.tickets import NO_TICKET, ticket_of
from kvpool.core.arena_map import ArenaMapping, PutWindow
from kvpool.core.errors import KVPoolError, TenantBusy, Unavailable, UnknownNamespace
from kvpool.core.events import KVEvent
from kvpool.core.hashing import block_hashes, pack_hashes
from kvpool.core.spec import KVSpec, Namespace
from kvpool.proto import pool_pb2, pool_pb2_grpc
from kvpool.rpc.auth import call_metadata, make_channel
from kvpool.rpc.codec import channel_options
from kvpool.rpc.errors import from_rpc_error
from kvpool.rpc.local_call import LocalCallClosed
from kvpool.rpc.local_channel import LocalChannel

log = logging.getLogger("kvpool.client")

T = TypeVar("T")

MAX_PENDING_RELEASES = 256


class StagedPut:
    """A put whose bytes are in the arena and checksummed but not visible yet (``PoolClient.stage_put``).

    ``commit`` (once, from any thread) makes them visible; ``abort`` drops them. A put neither
    committed nor aborted is reclaimed by the node like one of a writer that died.
    """

    def __init__(self, client: PoolClient, start: pool_pb2.PutStartReply, checksums: list[int]) -> None:
        """Made by ``PoolClient.stage_put``: the put ``start`` granted, with the ``checksums`` of the blocks
        written."""
        self._client = client
        self._start = start
        self._checksums = checksums
        self._done = start.put_id == 0

    @property
    def written_blocks(self) -> int:
        """Blocks this put wrote (the others were present or in flight)."""
        return len(self._checksums)

    def commit(self) -> PutResult:
        """Make the written blocks visible; the node refuses (``checksum_failed``) any whose bytes changed
        among those it checks (a random sample, all of the put once one fails: ``PutResult``)."""
        if self._done:
            return put_result(self._start, None)
        self._done = True
        request = pool_pb2.PutCommitRequest(put_id=self._start.put_id, checksums=self._checksums)
        return put_result(self._start, self._client._rpc("PutCommit", request))

    def abort(self) -> None:
        """Drop the written blocks (nothing becomes visible)."""
        if self._done:
            return
        self._done = True
        self._client._rpc("PutAbort", pool_pb2.PutAbortRequest(put_id=self._start.put_id))


class PoolClient:
    """Synchronous client of one same-host node. Safe to share between threads."""

    def __init__(
        self,
        address: str,
        namespace: Namespace,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        token: str = "",
        tls_root_certs: bytes | None = None,
        local_calls: bool = True,
    ) -> None:
        """Prefer ``PoolClient.connect``, which also says hello (registers the namespace) and maps the arena.
        ``timeout_s`` bounds each control call; ``token`` is the bearer credential; ``tls_root_certs`` (PEM)
        opens a TLS channel; ``local_calls``: send control calls over the daemon's same-host socket
        when it offers one (``kvpool.rpc.local_call``; gRPC otherwise, and Hello always).
        """
        self.address = address
        self.namespace = namespace
        self.spec = namespace.spec
        self.timeout_s = timeout_s
        self._ns_digest = namespace.digest()
        self._token = token
        self._metadata = call_metadata(token)
        self._channel = make_channel(address, channel_options(MAX_MESSAGE_BYTES), tls_root_certs)
        self._stub = pool_pb2_grpc.PoolStub(self._channel)
        self._use_local = local_calls
        self._local: LocalChannel | None = None  # opened after Hello when the daemon offers it
        self._admin = PoolAdmin(address, timeout_s, self._channel, namespace=self._ns_digest, token=token)
        self._arena: ArenaMapping | None = None  # mapped read-only; puts write through windows
        self._pending_releases: list[int] = []
        self._lock = threading.Lock()
        self._hello_lock = threading.Lock()
        self.node_id = ""
        self.data_ticket = NO_TICKET
        self.max_batch_blocks = 0

    @classmethod
    def connect(
        cls,
        address: str,
        spec: KVSpec,
        salt: bytes = b"",
        adapter: str = "",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        token: str = "",
        tls_root_certs: bytes | None = None,
        local_calls: bool = True,
    ) -> PoolClient:
        """Connect to the daemon at ``address``, register the namespace, map the arena.
        ``token``: the credential the daemon's operator issued (none on the loopback default)."""
        client = cls(address, Namespace(spec, salt, adapter), timeout_s, token, tls_root_certs, local_calls)
        try:
            client._hello()
        except BaseException:
            client.close()
            raise
        return client

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ------------------------------------------------------------------------
    def _rpc(self, method: str, request: Any) -> Any:
        """``method`` (a Pool method's name) with ``request``; a call refused TENANT_BUSY
        (nothing done) is sent again after a backoff."""
        for attempt in range(BUSY_RETRIES + 1):
            try:
                return self._call(method, request)
            except TenantBusy:
                if attempt == BUSY_RETRIES:
                    raise
            time.sleep(BUSY_BACKOFF_S * 2**attempt)  # the node did nothing: the same call is safe again
        raise AssertionError("unreachable")

    def _call(self, method: str, request: Any) -> Any:
        """One call: over the local socket when open, else over gRPC, also when no local
        connection could take it (busy, too large) or the socket is gone; raises the typed
        error, and Unavailable if the local connection broke after the request left."""
        local = self._local if method != "Hello" else None  # Hello names the socket: always gRPC
        if local is not None:
            try:
                return local.call(method, request, REPLY_TYPES[method], MAX_MESSAGE_BYTES)
            except LocalCallClosed as err:
                if err.gone and self._replace_local(None, only=local):
                    log.warning("local calls to %s stopped (%s): gRPC until the next hello", self.address, err.message)
                if err.sent:  # the node may have run it: not safe to send again
                    raise
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            # no local names the raised error: a frame <-> traceback cycle would keep this
            # client (and its channel) alive after its owner dropped it
            raise from_rpc_error(exc, self.address) from None

    def _open_local(self, reply: pool_pb2.HelloReply) -> None:
        """After each Hello, the daemon's local-call socket if it offers one (a restarted daemon
        has a new one, and a new key), else none; the channel it replaces is closed. If it
        cannot be opened, calls go through gRPC."""
        local = None
        if self._use_local and reply.local_socket:
            try:
                local = LocalChannel.open(
                    reply.local_socket, reply.local_key_id, reply.local_key, self._token, reply.node_id, self.timeout_s
                )
            except KVPoolError as err:
                log.info("control calls to %s go through gRPC: %s", self.address, err.message)
        self._replace_local(local)

    def _replace_local(self, local: LocalChannel | None, only: LocalChannel | None = None) -> bool:
        """Make ``local`` the channel (None: gRPC only) and close the one it replaces; with
        ``only``, just while that one is still the channel (another thread may have replaced
        it since). Whether it replaced."""
        with self._lock:
            old = self._local
            if only is not None and old is not only:
                return False
            self._local = local
        if old is not None:
            old.close()
        return True

    def _hello(self) -> None:
        with self._hello_lock:  # two threads re-registering at once must not both map the arena
            reply = self._rpc("Hello", hello_request(self.namespace))  # always gRPC: it names the socket
            self._arena = attach_arena(self._arena, reply, self.spec, self._token)
            self._open_local(reply)
        self.node_id = reply.node_id
        self.max_batch_blocks = reply.max_batch_blocks
        #: this client's ticket for the node's data plane (``kvpool.client.tickets``; reads over TCP/UCX)
        self.data_ticket = ticket_of(reply, time.monotonic())

    def _with_namespace(self, call: Callable[[], T]) -> T:
        """Run ``call``; if the daemon forgot our namespace (it restarted), say hello again once."""
        try:
            return call()
        except UnknownNamespace:
            log.info("daemon at %s restarted: registering the namespace again", self.address)
            with self._lock:
                self._pending_releases.clear()  # leases of the old process are gone
            self._hello()
            return call()

    def _take_releases(self) -> list[int]:
        with self._lock:
            taken, self._pending_releases = self._pending_releases, []
        return taken

    def _hashes_request(self, hashes: Sequence[bytes]) -> pool_pb2.HashesRequest:
        return hashes_request(self._ns_digest, hashes, self._take_releases(), self.max_batch_blocks)

    @property
    def arena(self) -> np.ndarray:
        """The daemon's shared-memory arena as a uint8 array (read-only unless a put of this client holds it
        writable); Unavailable before connect.
        """
        return self._mapping().view

    def _mapping(self) -> ArenaMapping:
        """The arena mapping now, taken once per call: a re-Hello from another thread may
        replace ``_arena``, and a read must map and read through one and the same mapping."""
        arena = self._arena
        if arena is None:
            raise Unavailable(f"not connected to {self.address}", hint="use PoolClient.connect")
        return arena

    def _put_window(self, start: pool_pb2.PutStartReply, own_copy: bool) -> PutWindow:
        arena = self._mapping()  # Unavailable if not connected
        with self._lock:  # one hand-off for the write descriptor, however many threads put
            return put_window(
                arena,
                start.put_id,
                start.offsets,
                self.spec.block_bytes,
                self._token,
                start.segment_generations,
                own_copy,
            )

    # -- API -----------------------------------------------------------------------------
    def hashes(self, token_ids: Any, extras: Sequence[bytes] | None = None) -> list[bytes]:
        """The block-hash chain of a prompt in this client's namespace (full blocks only)."""
        return block_hashes(self.namespace, token_ids, extras)

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` the pool holds now."""
        if not hashes:
            return 0
        reply = self._with_namespace(lambda: self._rpc("Lookup", self._hashes_request(hashes)))
        return int(reply.hits)

    def put(self, hashes: Sequence[bytes], blocks: Any) -> PutResult:
        """Store blocks ([n, *spec.block_shape]) under ``hashes``; present ones are skipped."""
        rows = put_rows(blocks, self.spec, hashes)
        if not hashes:
            return PutResult(0, 0, 0, 0)
        return self._stage(
            hashes, lambda window, start: write_rows(window, rows, start.indices, start.offsets), own_copy=True
        ).commit()

    def stage_put(self, hashes: Sequence[bytes], fill: BlockFill) -> StagedPut:
        """Start a put and let ``fill`` write its blocks straight into their arena slots
        (``kvpool.client.blocks.BlockFill``; blocks the pool has or another writer is storing
        are not asked for), each checksummed right after; nothing is visible until
        ``StagedPut.commit``, which may run later on another thread. An engine gathers its
        pages into the slots on its step and commits off it: one copy per byte, no staging
        buffer. An exception from ``fill`` aborts the put and propagates."""
        block_bytes = self.spec.block_bytes
        return self._stage(
            hashes, lambda window, start: fill_slots(window, block_bytes, start.indices, start.offsets, fill)
        )

    def put_with(self, hashes: Sequence[bytes], fill: BlockFill) -> PutResult:
        """``stage_put`` and commit at once."""
        return self.stage_put(hashes, fill).commit()

    def _stage(
        self,
        hashes: Sequence[bytes],
        write: Callable[[PutWindow, pool_pb2.PutStartReply], list[int]],
        own_copy: bool = False,
    ) -> StagedPut:
        """``own_copy``: ``write`` is ``write_rows`` (this thread copies every byte itself),
        not an engine's ``fill``, which may write from threads of its own."""
        start = self._with_namespace(lambda: self._rpc("PutStart", self._hashes_request(hashes)))
        if start.put_id == 0:
            return StagedPut(self, start, [])
        try:
            with self._put_window(start, own_copy) as window:
                checksums = write(window, start)
        except BaseException:
            self._rpc("PutAbort", pool_pb2.PutAbortRequest(put_id=start.put_id))
            raise
        return StagedPut(self, start, checksums)

    def read_with(self, hashes: Sequence[bytes], use: BlockUse) -> int:
        """Lease the leading cached blocks of ``hashes`` and hand them to ``use`` straight from
        the arena, verified (``kvpool.client.blocks.BlockUse``): an engine scatters them into
        its pages with no staging buffer. Returns how many leading blocks were verified and
        given to ``use``; a bad block is reported to the node and it and later ones are misses.

        The bytes are verified before ``use`` reads them, so they are the verified ones only
        while the lease holds them in place: a read that outlives its lease (``use`` stalled
        past the daemon's ``lease_ttl_ms``) returns 0, whatever ``use`` saw, and the caller
        recomputes (the slot may have been reused by then)."""
        if not hashes:
            return 0
        block_bytes, source = self.spec.block_bytes, f"node {self.node_id}"
        return self._leased(
            hashes,
            lambda r, view: use_rows(view, block_bytes, r.offsets, r.checksums, use, source),
            outlived_lease_is_miss=True,
        )

    def get_into(self, hashes: Sequence[bytes], out: Any) -> int:
        """Read the leading cached blocks of ``hashes`` into ``out`` ([>= n, *block_shape]).

        Returns how many leading blocks were read and verified; rows past that are
        untouched or partially written and must be recomputed by the caller.
        """
        rows = out_rows(out, self.spec, hashes)
        if not hashes:
            return 0
        source = f"node {self.node_id}"
        return self._leased(hashes, lambda r, view: read_rows(view, rows, r.offsets, r.checksums, source))

    def _leased(
        self,
        hashes: Sequence[bytes],
        read: Callable[[pool_pb2.LeaseReply, np.ndarray], int],
        outlived_lease_is_miss: bool = False,
    ) -> int:
        """Lease, ``read`` through the arena view (returns the leading verified blocks),
        release later, report a bad block. ``outlived_lease_is_miss``: a read that took
        longer than the lease (timed from before the Lease call, so never shorter than the
        daemon's own count) is all misses (``read_with``: its bytes were verified before the
        reader used them)."""
        started = time.monotonic()
        reply = self._with_namespace(lambda: self._rpc("Lease", self._hashes_request(hashes)))
        if reply.lease_id == 0:
            return 0
        try:
            arena = self._mapping()
            try:
                arena.ensure(reply.offsets, reply.segment_generations)  # per tenant: map new segments
                good = read(reply, arena.view)
            except Exception:
                if arena.closed:  # a re-Hello on another thread replaced the mapping under this read
                    raise Unavailable(
                        f"the arena of {self.address} was mapped again during this read (the daemon restarted)",
                        hint="read again",
                    ) from None
                raise
        finally:
            self._release_later(int(reply.lease_id))
        took_ms = (time.monotonic() - started) * 1000
        if good < len(reply.offsets):  # block ``good`` failed its checksum: tell the node
            self.report_corrupt([hashes[good]])
        if outlived_lease_is_miss and good and took_ms >= reply.expires_in_ms:
            log.warning(
                "a read of %d leased blocks took %.0f ms, past its %d ms lease: treated as misses "
                "(their slots may have been reused before they were used)",
                good,
                took_ms,
                reply.expires_in_ms,
            )
            return 0
        return good

    def report_corrupt(self, hashes: Sequence[bytes]) -> int:
        """Tell the node these blocks of this namespace failed their checksum when read. The
        node re-verifies each and drops the ones that really are bad, so the next put stores
        fresh bytes instead of being told ``already_present``. Returns how many it dropped;
        never raises (a failed report leaves the block to the next reader's report)."""
        try:
            reply = self._with_namespace(lambda: self._rpc("ReportCorrupt", self._hashes_request(hashes)))
        except KVPoolError as err:
            log.warning("could not report %d corrupt blocks to %s: %s", len(hashes), self.address, err)
            return 0
        return int(reply.dropped)

    def get(self, hashes: Sequence[bytes]) -> np.ndarray:
        """The leading cached blocks of ``hashes`` as a new array [hits, *block_shape]."""
        out = np.empty((len(hashes), *self.spec.block_shape), dtype=self.spec.numpy_dtype)
        n = self.get_into(hashes, out)
        return out[:n]

    def remove(self, hashes: Sequence[bytes]) -> int:
        """Remove these blocks of this namespace from the node; a block under a read lease goes when the lease
        ends. Returns how many were removed.
        """
        if not hashes:
            return 0
        reply = self._with_namespace(lambda: self._rpc("Remove", self._hashes_request(hashes)))
        return int(reply.removed)

    def pin(self, hashes: Sequence[bytes], ttl_ms: int | None = None) -> int:
        """Pin present blocks: soft for ``ttl_ms`` (system prompts), hard when ttl_ms is None."""
        request = pool_pb2.PinRequest(
            namespace=self._ns_digest, hashes=pack_hashes(hashes), hard=ttl_ms is None, ttl_ms=ttl_ms or 0
        )
        return int(self._with_namespace(lambda: self._rpc("Pin", request)).changed)

    def unpin(self, hashes: Sequence[bytes]) -> int:
        """Drop the soft and hard pins of these blocks, so the eviction policy may take them again. Returns how
        many changed.
        """
        request = pool_pb2.PinRequest(namespace=self._ns_digest, hashes=pack_hashes(hashes), unpin=True)
        return int(self._with_namespace(lambda: self._rpc("Pin", request)).changed)

    def stats(self) -> dict[str, Any]:
        """The node's counters (see ``kvpool inspect stats``); ``namespaces`` lists this
        client's namespace (all of them where the daemon serves admin views)."""
        return self._admin.stats()

    def snapshot(self) -> tuple[int, list[bytes]]:
        """(last event seq, every block hash of this namespace on the node)."""
        return self._admin.snapshot(self._ns_digest)

    def events(self, from_seq: int = 0) -> Iterator[KVEvent]:
        """This namespace's KV events from ``from_seq`` on (blocks until they come), numbered
        1, 2, 3, ... in this namespace. A gap in ``seq`` means events were dropped: resync
        with ``snapshot``, whose seq is of the same numbering."""
        return self._admin.events(from_seq)

    def flush_releases(self) -> None:
        """Send the lease releases this client batches (they also ride on its next call, and a lease ends at its
        TTL anyway): call it before a long pause so the node may evict those blocks sooner.
        """
        lease_ids = self._take_releases()
        if lease_ids:
            self._rpc("Release", pool_pb2.ReleaseRequest(lease_ids=lease_ids))

    def close(self) -> None:
        """Release pending leases, unmap the arena, close the channel. Idempotent; the context manager calls it."""
        try:
            self.flush_releases()
        except KVPoolError:
            pass  # the daemon is gone; its leases went with it
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._replace_local(None)
        self._channel.close()

    def _release_later(self, lease_id: int) -> None:
        with self._lock:
            self._pending_releases.append(lease_id)
            flush = len(self._pending_releases) >= MAX_PENDING_RELEASES
        if flush:
            self.flush_releases()
