"""``ClusterClient``: one pool across many nodes.

    with ClusterClient.connect(spec, directory=["127.0.0.1:7440"], local="127.0.0.1:7450") as c:
        h = c.hashes(token_ids)
        c.put(h, blocks)             # where the directory places them (local node first)
        n = c.get_into(h, out)       # each block from whichever node holds it

Reads: one directory Lookup for the whole prompt says, per block, which nodes hold it.
Each block is read from the best holder: the client's own node or another node on the
same host through shared memory (``PoolClient``, one memcpy), any other node through the
data plane (TCP sockets or UCX), runs on different peers in parallel. Every block is
checksummed on arrival; a failed, timed-out or corrupt transfer is retried once from
another holder and otherwise becomes a miss (logged with the peer's address): the
result is always the count of leading blocks that are in ``out`` and verified.

Writes: the directory's ``Place`` picks the nodes (local-first, most free space,
``replicas`` distinct nodes). Hot blocks read from remote nodes ``replicate_after`` times
are copied into the local node, so the next read is local.

Directory failover (``docs/cluster.md``): while no directory leader answers (the old one
died and the standby has not won the election yet), reads never raise: ``lookup`` is 0 (a
miss: it reports what the directory knows) and ``get_into`` reads what the client's own
node holds (verified as always; a miss without one). The directory is probed at most once
per ``FAILOVER_PROBE_MS`` meanwhile, so a prompt does not pay a failed round trip each. A
new leader answers lookups with misses until the nodes have re-registered with it. Writes
wait for a leader that has nodes, up to ``failover_wait_ms``, then fail with one
``DirectoryFailover`` (an ``Unavailable``) naming the directory and saying a failover is in
progress: a new leader's "no live node is registered" (``NotFound``) is part of the
failover, not an answer. Every other call that needs the directory's answer (``connect``,
``remove``, ``pin``, ``unpin``, ``stats``, ``put_on``) waits the same way and fails the
same way, naming the call (``_directory_waiting``).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from kvpool.client.blocks import block_rows
from kvpool.client.pool_client import PoolClient
from kvpool.client.pool_common import PutResult, hashes_request, hello_request
from kvpool.client.tickets import NodeTickets
from kvpool.core.clock import Clock, MonotonicClock
from kvpool.core.errors import (
    InvalidArgument,
    KVPoolError,
    NotFound,
    NotLeader,
    TenantBusy,
    Unavailable,
)
from kvpool.core.hashing import block_hashes, pack_hashes
from kvpool.core.retry import RetryPolicy
from kvpool.core.spec import KVSpec, Namespace
from kvpool.directory.etcd import EtcdSession
from kvpool.directory.link import DirectoryLink
from kvpool.proto import directory_pb2, pool_pb2, pool_pb2_grpc
from kvpool.rpc.auth import call_metadata, make_channel
from kvpool.rpc.codec import channel_options
from kvpool.rpc.errors import TlsFailed, from_rpc_error
from kvpool.transport.base import ReadItem, Transport
from kvpool.transport.factory import make_transport

log = logging.getLogger("kvpool.cluster_client")

MAX_PARALLEL_PEERS = 8
DEFAULT_FAILOVER_WAIT_MS = 5_000  # > the directory's default election TTL (2 s) + a node heartbeat
FAILOVER_PROBE_MS = 100  # while the directory is down, reads ask it at most this often
#: a put waiting out a failover retries Place after 25 ms, doubling up to 250 ms (until
#: ``failover_wait_ms``)
PLACE_RETRY = RetryPolicy(first_delay_ms=25, max_delay_ms=250)


class DirectoryFailover(Unavailable):
    """No directory leader answers: the old leader is gone and no new one has taken over
    (or has, but no node has re-registered with it yet). An ``Unavailable``: retry later."""


@dataclass(frozen=True)
class Holder:
    """A node that holds a block, as the directory reports it: its id, addresses, transport and host (same host:
    read through its arena).
    """

    node_id: str
    control_address: str
    data_address: str
    host: str
    transport_metadata: bytes = field(default=b"", compare=False, repr=False)  # NodeInfo's, for the transport

    @classmethod
    def of(cls, info: directory_pb2.NodeInfo) -> Holder:
        """The holder described by a directory NodeInfo message."""
        return cls(info.node_id, info.control_address, info.data_address, info.host, bytes(info.transport_metadata))


class ClusterClient:
    """Client of a cluster: asks the directory where each block lives, reads from the local node's arena or from
    peers over the data plane, and writes where the directory places. ``ClusterClient.connect`` finds the
    leader (``directory`` addresses or ``etcd``); the block calls are ``PoolClient``'s.
    """

    def __init__(
        self,
        link: DirectoryLink,
        namespace: Namespace,
        transport: Transport,
        local: PoolClient | None = None,
        host: str = "",
        replicate_after: int = 0,
        same_host_shm: bool = True,
        timeout_s: float = 10.0,
        failover_wait_ms: int = DEFAULT_FAILOVER_WAIT_MS,
        clock: Clock | None = None,
        sleep: Callable[[float], None] = time.sleep,
        token: str = "",
        tls_root_certs: bytes | None = None,
    ) -> None:
        """``token``: the tenant credential presented to every node's control plane (the
        same-host clients, Hello on a put target and for data-plane tickets);
        ``tls_root_certs``: verify nodes' control planes and (``--data-tls``) data planes
        against this CA (PEM); None = plaintext."""
        if failover_wait_ms < 0:
            raise InvalidArgument("failover_wait_ms must be >= 0")
        self.link = link
        self._token = token
        self._tls_root_certs = tls_root_certs
        self._metadata = call_metadata(token)
        # data-plane tickets, one per node, from its control plane (docs/security.md)
        self.tickets = NodeTickets(self._hello_reply)
        if token:
            transport.use_tickets(self.tickets)
        if tls_root_certs:
            transport.use_tls(tls_root_certs)
        self.namespace = namespace
        self.spec = namespace.spec
        self._ns = namespace.digest()
        self.transport = transport
        self.local = local
        self.host = host or socket.gethostname()
        self.replicate_after = replicate_after
        self.same_host_shm = same_host_shm
        self.timeout_s = timeout_s
        self.failover_wait_ms = failover_wait_ms
        self._clock = clock or MonotonicClock()
        self._sleep = sleep
        self._ok_leader = ""  # the leader of the last directory call that succeeded
        self._place_leader = ""  # the leader of the last Place that succeeded
        self._down_since_ms: float | None = None  # first failed directory call of a failover
        self._next_probe_ms = 0.0  # reads skip the directory until then while it is down
        self._leader_changed_ms: float | None = None  # when a call was last answered by a new leader
        self._same_host: dict[str, PoolClient] = {}
        self._hello_done: set[str] = set()
        self._remote_reads: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(MAX_PARALLEL_PEERS, thread_name_prefix="kvpool-cc")
        self.counters = {
            "local_blocks": 0,
            "same_host_blocks": 0,
            "remote_blocks": 0,
            "failed_runs": 0,
            "retried_runs": 0,
            "replicated_blocks": 0,
            "directory_down_reads": 0,  # reads answered without the directory (failover, or TENANT_BUSY)
            "failover_put_waits": 0,  # puts that waited for a directory leader
            "failover_call_waits": 0,  # connect/remove/pin/stats calls that waited for one
            "reported_corrupt": 0,  # blocks that arrived failing their checksum, reported to their node
            "dropped_corrupt": 0,  # of those, how many the node found bad too and dropped
        }

    @classmethod
    def connect(
        cls,
        spec: KVSpec,
        salt: bytes = b"",
        adapter: str = "",
        directory: Sequence[str] = (),
        etcd: Sequence[str] = (),
        cluster: str = "default",
        local: str = "",
        transport: str = "tcp",
        host: str = "",
        replicate_after: int = 0,
        same_host_shm: bool = True,
        timeout_s: float = 10.0,
        failover_wait_ms: int = DEFAULT_FAILOVER_WAIT_MS,
        token: str = "",
        tls_root_certs: bytes | None = None,
        directory_tls_root_certs: bytes | None = None,
        read_streams: int = 0,
    ) -> ClusterClient:
        """Find the directory (through etcd or the given addresses) and, when ``local`` is
        given, attach to that same-host node's arena. ``failover_wait_ms`` bounds how long
        this call, puts and management calls wait for a directory leader during a failover.
        ``tls_root_certs`` verifies the nodes (control and data planes),
        ``directory_tls_root_certs`` the directory (its own option: a cluster may run TLS on
        one and not the other; pass the same CA for both where one CA signed them all).
        ``read_streams``: the most data connections one large read from a node is spread
        over (0 = the data plane's default: 1 for tcp, one per core up to 4 for ucx and nixl;
        docs/cluster.md, Data plane)."""
        namespace = Namespace(spec, salt, adapter)
        session = EtcdSession(etcd).start() if etcd else None
        link = DirectoryLink(
            directory, session, cluster, timeout_s, token=token, owns_etcd=True, root_certs=directory_tls_root_certs
        )
        local_client: PoolClient | None = None
        made: ClusterClient | None = None
        try:
            local_client = (
                PoolClient.connect(local, spec, salt, adapter, timeout_s, token=token, tls_root_certs=tls_root_certs)
                if local
                else None
            )
            made = cls(
                link,
                namespace,
                make_transport(transport, timeout_s, read_streams),
                local_client,
                host,
                replicate_after,
                same_host_shm,
                timeout_s,
                failover_wait_ms=failover_wait_ms,
                token=token,
                tls_root_certs=tls_root_certs,
            )
            # finds the leader, waiting out a failover like every directory call
            nodes = made._directory_waiting("Nodes", directory_pb2.NodesRequest()).nodes
            if not host and local_client is not None:
                made.host = next((n.host for n in nodes if n.node_id == local_client.node_id), "") or made.host
            return made
        except BaseException:
            if made is not None:
                made.close()
            else:
                if local_client is not None:
                    local_client.close()
                link.close()
            raise

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- lookups -------------------------------------------------------------------------
    def hashes(self, token_ids: Any, extras: Sequence[bytes] | None = None) -> list[bytes]:
        """The block-hash chain of a prompt in this client's namespace (full blocks only; no I/O)."""
        return block_hashes(self.namespace, token_ids, extras)

    # -- the directory, through failovers ----------------------------------------------------
    def _directory(self, name: str, request: Any) -> Any:
        """``Directory.<name>`` on the leader; remembers which leader answered, and when the
        directory stopped answering, so reads and puts can tell a failover from an answer."""
        try:
            reply = self.link.call(name, request)
        except (Unavailable, NotLeader):
            with self._lock:
                if self._down_since_ms is None:
                    self._down_since_ms = self._clock.now_ms()
                self._next_probe_ms = self._clock.now_ms() + FAILOVER_PROBE_MS
            raise
        with self._lock:
            if self._ok_leader and self.link.leader != self._ok_leader:
                self._leader_changed_ms = self._clock.now_ms()
            self._ok_leader = self.link.leader
            self._down_since_ms = None
        return reply

    def _directory_down(self) -> bool:
        """True while the directory is known not to answer and the next probe is not due."""
        with self._lock:
            return self._down_since_ms is not None and self._clock.now_ms() < self._next_probe_ms

    def _where(self) -> str:
        where = ",".join(self.link.addresses)
        if self.link.etcd is not None:
            etcd = f"etcd {','.join(self.link.etcd.endpoints)}, cluster {self.link.cluster!r}"
            where = f"{where} ({etcd})" if where else etcd
        return where

    def _failover_error(self, name: str, waited_ms: float, last: KVPoolError | None) -> DirectoryFailover:
        if isinstance(last, NotFound):  # a leader answers, but no node has re-registered with it yet
            what = f"the new leader {self.link.leader} of {self._where()} has no node registered"
        else:
            previous = f"leader {self._ok_leader} stopped answering and " if self._ok_leader else ""
            what = f"{previous}no directory leader of {self._where()} answered {name}"
        undone = "nothing was written" if name == "Place" else f"{name} did not complete"
        return DirectoryFailover(
            f"directory failover in progress: {what} within {waited_ms:.0f} ms "
            f"(last: {last.message if last else 'none'})",
            hint=f"{undone}; retry, or raise failover_wait_ms (now {self.failover_wait_ms} ms) above the "
            "directory's --election-ttl-s plus a node heartbeat; reads are misses (or local hits) meanwhile"
            + (f". The last error's hint: {last.hint}" if last is not None and last.hint else ""),
        )

    def _new_leader_without_nodes(self) -> bool:
        """A NotFound ("no live node is registered") from Place is the tail of a failover when
        it comes from a leader other than the one that last placed for us, or from one that
        took over less than ``failover_wait_ms`` ago: nodes re-register with a new leader
        within a heartbeat. From the leader that placed before, it is an answer."""
        if self._place_leader and self.link.leader != self._place_leader:
            return True
        changed = self._leader_changed_ms
        return changed is not None and self._clock.now_ms() - changed < self.failover_wait_ms

    def _place(self, request: directory_pb2.PlaceRequest) -> Any:
        """``Place``, waiting out a failover (``_directory_waiting``); a new leader's "no live
        node is registered" is waited out too (``_new_leader_without_nodes``). Never the new
        leader's misleading NotFound."""
        reply = self._directory_waiting("Place", request, place=True)
        self._place_leader = self.link.leader
        return reply

    def _directory_waiting(self, name: str, request: Any, place: bool = False) -> Any:
        """``Directory.<name>``, waiting out a failover for up to ``failover_wait_ms``:
        retried (with backoff) while no leader answers, then one ``DirectoryFailover``.
        Every call that must reach the directory (connect, puts, remove, pin, stats) goes
        through here; reads do not wait (they are misses meanwhile). ``place``: a NotFound
        from a new leader that has no node yet is part of the failover too."""
        started = self._clock.now_ms()
        backoff = PLACE_RETRY.backoff()
        last: KVPoolError | None = None
        waited = False
        while True:
            try:
                return self._directory(name, request)
            except TlsFailed:
                raise  # configuration (a CA, a certificate, plaintext against TLS): no failover to wait out
            except (Unavailable, NotLeader) as err:
                last = err
            except NotFound as err:
                if not place or not (waited or self._new_leader_without_nodes()):
                    raise
                last = err
            elapsed_ms = self._clock.now_ms() - started
            if elapsed_ms >= self.failover_wait_ms:
                raise self._failover_error(name, elapsed_ms, last) from None
            if not waited:
                waited = True
                with self._lock:
                    self.counters["failover_put_waits" if place else "failover_call_waits"] += 1
                log.info("directory did not answer %s (%s); waiting up to %d ms", name, last, self.failover_wait_ms)
            self._sleep(min(backoff.next_delay_s(), (self.failover_wait_ms - elapsed_ms) / 1000))

    def locate(
        self, hashes: Sequence[bytes], lease_ms: int = 0, for_read: bool = False
    ) -> tuple[list[list[Holder]], int]:
        """Per leading cached block, its holders; plus the directory lease id (0 if none).
        ``for_read``: this locate is a read's (the directory counts it apart from lookups, so
        an engine's lookup followed by its read is one lookup). Raises ``Unavailable`` while no
        directory leader answers (``lookup`` does not)."""
        if not hashes:
            return [], 0
        reply = self._directory(
            "Lookup",
            directory_pb2.LookupRequest(
                namespace=self._ns,
                hashes=pack_hashes(hashes),
                lease_ms=lease_ms,
                client_node=self.local.node_id if self.local else "",
                for_read=for_read,
            ),
        )
        nodes = [Holder.of(n) for n in reply.nodes]
        # blocks held by the same nodes share one list (a prompt's blocks mostly do): built
        # once per distinct mask, and ``_plan`` ranks it once; callers must not mutate them
        by_mask: dict[int, list[Holder]] = {}
        out: list[list[Holder]] = []
        for mask in reply.holder_masks[: reply.hits]:
            holders = by_mask.get(mask)
            if holders is None:
                holders = by_mask[mask] = [node for bit, node in enumerate(nodes) if mask >> bit & 1]
            out.append(holders)
        return out, int(reply.lease_id)

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``hashes`` held by some live node, as the directory says. While no
        directory leader answers (a failover) it is 0: a miss, never an error. (``get_into``
        still reads what the client's own node holds.)"""
        if not hashes:
            return 0
        if self._directory_down():
            self.counters["directory_down_reads"] += 1
            return 0
        try:
            return len(self.locate(hashes)[0])
        except (Unavailable, NotLeader, TenantBusy) as err:  # busy: past our tenant's share of it
            log.info("directory lookup failed (%s): a miss", err)
            self.counters["directory_down_reads"] += 1
            return 0

    # -- reads ---------------------------------------------------------------------------
    def _rank(self, holder: Holder) -> int:
        if self.local is not None and holder.node_id == self.local.node_id:
            return 0
        if self.same_host_shm and holder.host == self.host:
            return 1
        return 2

    def _plan(self, holders: list[list[Holder]]) -> list[tuple[Holder, int, int]]:
        """Contiguous runs (holder, start, end): best rank first, staying on one holder.
        A block with no holder ends the plan: it and every later block are misses."""
        runs: list[tuple[Holder, int, int]] = []
        best_of: dict[int, list[Holder]] = {}  # per distinct holder list (``locate`` shares them)
        holder: Holder | None = None  # the open run's, from ``start`` to block ``end``
        start = end = 0
        for end, options in enumerate(holders):
            if not options:
                break
            candidates = best_of.get(id(options))
            if candidates is None:
                best = min(self._rank(h) for h in options)
                candidates = best_of[id(options)] = [h for h in options if self._rank(h) == best]
            if holder is None or holder not in candidates:
                if holder is not None:
                    runs.append((holder, start, end))
                holder, start = candidates[0], end
        else:
            end = len(holders)
        if holder is not None:
            runs.append((holder, start, end))
        return runs

    def _same_host_client(self, holder: Holder) -> PoolClient:
        with self._lock:
            client = self._same_host.get(holder.node_id)
        if client is None:
            client = PoolClient.connect(
                holder.control_address,
                self.spec,
                self.namespace.salt,
                self.namespace.adapter,
                self.timeout_s,
                token=self._token,
                tls_root_certs=self._tls_root_certs,
            )
            with self._lock:
                self._same_host[holder.node_id] = client
        return client

    def _read_run(
        self,
        holder: Holder,
        hashes: Sequence[bytes],
        rows: np.ndarray,
        out: Any,
        start: int,
        byte_range: tuple[int, int] | None = None,
    ) -> int:
        """Read one run; returns how many of its leading blocks are in place and verified.
        ``rows`` are uint8 rows of ``out`` (whole blocks, or the ``byte_range`` of each)."""
        rank = self._rank(holder)
        n = len(hashes)
        try:
            if rank in (0, 1):
                client = self.local if rank == 0 else self._same_host_client(holder)
                assert client is not None
                if byte_range is None:
                    got = client.get_into(hashes, out[start : start + n])
                else:  # shared memory moves whole blocks: read them, keep the range
                    scratch = np.empty((n, *self.spec.block_shape), dtype=self.spec.numpy_dtype)
                    got = client.get_into(hashes, scratch)
                    offset, length = byte_range
                    flat = scratch.reshape(n, -1).view(np.uint8)
                    rows[start : start + got] = flat[:got, offset : offset + length]
                self.counters["local_blocks" if rank == 0 else "same_host_blocks"] += got
                return got
        except KVPoolError as err:
            log.warning(
                "read of %d blocks from node %s (%s) failed: %s; they are misses",
                n,
                holder.node_id,
                holder.control_address,
                err,
            )
            return 0
        if byte_range is None:
            items = [ReadItem(h) for h in hashes]
        else:
            items = [ReadItem(h, byte_range[0], byte_range[1]) for h in hashes]
        self._learn(holder)
        result = self.transport.read(holder.data_address, self._ns, items, [rows[start + i] for i in range(n)])
        self.counters["remote_blocks"] += result.ok
        if result.corrupt_index >= 0:
            self._report_corrupt(holder, hashes[result.corrupt_index])
        if result.ok and self.replicate_after > 0 and byte_range is None:
            self._count_remote(hashes[: result.ok], rows[start : start + result.ok])
        return result.ok

    def get_into(self, hashes: Sequence[bytes], out: Any) -> int:
        """Read the leading cached blocks of ``hashes`` into ``out`` from wherever they are.
        Returns how many leading rows are read and verified; the rest must be recomputed."""
        rows = block_rows(out, self.spec, "out", writable=True)
        if rows.shape[0] < len(hashes):
            raise InvalidArgument(f"out holds {rows.shape[0]} blocks, {len(hashes)} were asked for")
        return self._get(hashes, rows, out, None)

    def get_layers_into(self, hashes: Sequence[bytes], first_layer: int, num_layers: int, out: np.ndarray) -> int:
        """Read layers [first_layer, first_layer + num_layers) of the leading cached blocks
        into ``out`` ([n, num_layers, k|v, kv_heads, tokens, head_dim], spec dtype): the
        canonical layout is layer-major, so remote nodes send only that byte range."""
        offset, length = self.spec.layer_range_bytes(first_layer, num_layers)
        expected = (num_layers, *self.spec.block_shape[1:])
        if out.dtype != self.spec.numpy_dtype or tuple(out.shape[1:]) != expected or not out.flags.c_contiguous:
            raise InvalidArgument(
                f"out must be a C-contiguous {self.spec.numpy_dtype} array [n, {', '.join(map(str, expected))}]"
            )
        if out.shape[0] < len(hashes):
            raise InvalidArgument(f"out holds {out.shape[0]} blocks, {len(hashes)} were asked for")
        rows = out.reshape(-1).view(np.uint8).reshape(out.shape[0], length)
        return self._get(hashes, rows, out, (offset, length))

    def _get(self, hashes: Sequence[bytes], rows: np.ndarray, out: Any, byte_range: tuple[int, int] | None) -> int:
        if not hashes:
            return 0
        holders: list[list[Holder]] | None = None
        if not self._directory_down():
            try:
                holders, _ = self.locate(hashes, for_read=True)
            except (Unavailable, NotLeader, TenantBusy) as err:
                log.info("directory lookup failed (%s): reading from the local node only", err)
            except KVPoolError as err:
                log.warning("directory lookup failed (%s): every block is a miss", err)
                return 0
        if holders is None:  # no directory leader: what the client's own node holds, verified
            self.counters["directory_down_reads"] += 1
            if self.local is None:
                return 0
            holders = [[Holder(self.local.node_id, "", "", self.host)]] * len(hashes)
        runs = self._plan(holders)
        # runs on other holders go to the pool; the first runs here (polling UCX progress
        # from the calling thread is the fastest path, and most prompts are one run)
        futures: list[tuple[Holder, int, int, Future[int] | None]] = [(*runs[0], None)] if runs else []
        futures += [
            (
                holder,
                start,
                end,
                self._pool.submit(self._read_run, holder, hashes[start:end], rows, out, start, byte_range),
            )
            for holder, start, end in runs[1:]
        ]
        good = 0
        try:
            for holder, start, end, future in futures:
                if future is not None:
                    got = future.result()
                else:
                    got = self._read_run(holder, hashes[start:end], rows, out, start, byte_range)
                if got == end - start and good == start:
                    good = end
                    continue
                if good != start:
                    break  # an earlier run fell short: everything after it is a miss anyway
                self.counters["failed_runs"] += 1
                good = start + got
                alternatives = [h for h in holders[good] if h != holder] if good < len(holders) else []
                if alternatives:  # one retry of the rest of this run from another holder
                    self.counters["retried_runs"] += 1
                    alt = min(alternatives, key=self._rank)
                    stop = good
                    while stop < end and alt in holders[stop]:
                        stop += 1
                    good += self._read_run(alt, hashes[good:stop], rows, out, good, byte_range)
                break
        finally:
            for _, _, _, future in futures:  # no transfer may still write into out after we return
                if future is not None:
                    future.exception()
        return good

    def get(self, hashes: Sequence[bytes]) -> np.ndarray:
        """The leading blocks of ``hashes`` the cluster holds, as a new array [hits, *block_shape] (``get_into``
        into a new buffer).
        """
        out = np.empty((len(hashes), *self.spec.block_shape), dtype=self.spec.numpy_dtype)
        n = self.get_into(hashes, out)
        return out[:n]

    def _count_remote(self, hashes: Sequence[bytes], rows: np.ndarray) -> None:
        hot: list[int] = []
        with self._lock:
            for i, key in enumerate(hashes):
                count = self._remote_reads.get(key, 0) + 1
                self._remote_reads[key] = count
                if count == self.replicate_after:
                    hot.append(i)
            if len(self._remote_reads) > 1_000_000:  # bound the counter table
                self._remote_reads.clear()
        if hot and self.local is not None:
            blocks = rows[hot].view(self.spec.numpy_dtype).reshape(len(hot), *self.spec.block_shape)
            try:
                result = self.local.put([hashes[i] for i in hot], blocks)
                self.counters["replicated_blocks"] += result.stored
            except KVPoolError as err:
                log.info("replicating %d hot blocks locally failed: %s", len(hot), err)

    def _report_corrupt(self, holder: Holder, block_hash: bytes) -> None:
        """A block from ``holder`` arrived failing its checksum: tell its node, which
        re-verifies it in its arena and drops it only if it is bad there (damage on the wire
        drops nothing); its REMOVED event then drops this holder from the directory. Rare, so
        one short-lived channel per report; a failed report is logged, never raised."""
        try:
            self._hello(holder)
            channel = make_channel(holder.control_address, channel_options(64 << 20), self._tls_root_certs)
            try:
                request = hashes_request(self._ns, [block_hash], [], 0)
                reply = pool_pb2_grpc.PoolStub(channel).ReportCorrupt(request, timeout=self.timeout_s)
            except grpc.RpcError as exc:
                raise from_rpc_error(exc, holder.control_address) from None
            finally:
                channel.close()
        except KVPoolError as err:
            log.warning("could not report a corrupt block to node %s: %s", holder.node_id, err)
            return
        self.counters["reported_corrupt"] += 1
        self.counters["dropped_corrupt"] += int(reply.dropped)

    # -- writes --------------------------------------------------------------------------
    def _learn(self, holder: Holder) -> None:
        """What the transport needs for a holder's data plane: its metadata, where its ticket comes from."""
        if holder.transport_metadata:
            self.transport.learn_peer(holder.data_address, holder.transport_metadata)
        self.tickets.learn(holder.data_address, holder.control_address)

    def _hello_reply(self, control_address: str) -> pool_pb2.HelloReply:
        """Hello on a node's control plane with this client's token (registers the namespace there;
        the reply carries this client's data-plane ticket for that node)."""
        channel = make_channel(control_address, channel_options(64 << 20), self._tls_root_certs)
        try:
            reply: pool_pb2.HelloReply = pool_pb2_grpc.PoolStub(channel).Hello(
                hello_request(self.namespace), timeout=self.timeout_s, metadata=self._metadata
            )
            return reply
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, control_address) from None
        finally:
            channel.close()

    def _hello(self, holder: Holder) -> None:
        if holder.node_id in self._hello_done:
            return
        self.tickets.learn(holder.data_address, holder.control_address)
        self.tickets.store(holder.data_address, self._hello_reply(holder.control_address))
        self._hello_done.add(holder.node_id)

    def put(self, hashes: Sequence[bytes], blocks: Any, replicas: int = 1) -> PutResult:
        """Store blocks where the directory places them; returns the first target's result."""
        rows = block_rows(blocks, self.spec, "blocks")
        if rows.shape[0] != len(hashes):
            raise InvalidArgument(f"{len(hashes)} hashes for {rows.shape[0]} blocks")
        if not hashes:
            return PutResult(0, 0, 0, 0)
        reply = self._place(
            directory_pb2.PlaceRequest(
                namespace=self._ns,
                blocks=len(hashes),
                block_bytes=self.spec.block_bytes,
                client_node=self.local.node_id if self.local else "",
                replicas=replicas,
            ),
        )
        results = [self._put_on(Holder.of(n), hashes, blocks, rows) for n in reply.nodes]
        return results[0] if results else PutResult(0, 0, 0, 0)

    def put_on(self, node_id: str, hashes: Sequence[bytes], blocks: Any) -> PutResult:
        """Store blocks on one named node (tests, manual replication)."""
        rows = block_rows(blocks, self.spec, "blocks")
        nodes = self._directory_waiting("Nodes", directory_pb2.NodesRequest()).nodes
        for n in nodes:
            if n.node_id == node_id:
                return self._put_on(Holder.of(n), hashes, blocks, rows)
        raise InvalidArgument(f"node {node_id} is not registered with the directory")

    def _put_on(self, holder: Holder, hashes: Sequence[bytes], blocks: Any, rows: np.ndarray) -> PutResult:
        rank = self._rank(holder)
        try:
            if rank == 0:
                assert self.local is not None
                return self.local.put(hashes, blocks)
            if rank == 1:
                return self._same_host_client(holder).put(hashes, blocks)
            self._hello(holder)
        except KVPoolError as err:
            log.warning("put of %d blocks on node %s failed: %s", len(hashes), holder.node_id, err)
            return PutResult(0, 0, 0, 0)
        self._learn(holder)
        result = self.transport.write(holder.data_address, self._ns, hashes, rows)
        if result.reason:
            log.warning("put of %d blocks on node %s failed: %s", len(hashes), holder.node_id, result.reason)
        return PutResult(result.stored, result.already_present, result.in_flight, result.checksum_failed)

    # -- management ----------------------------------------------------------------------
    def remove(self, hashes: Sequence[bytes]) -> int:
        """Remove these blocks from every node holding them (through the directory). Returns how many were
        removed.
        """
        request = directory_pb2.RemoveRequest(namespace=self._ns, hashes=pack_hashes(hashes))
        reply = self._directory_waiting("Remove", request)
        return int(reply.removed)

    def pin(self, hashes: Sequence[bytes], ttl_ms: int | None = None) -> int:
        """Pin these blocks on every holder: soft for ``ttl_ms``, hard when it is None. Returns how many changed."""
        reply = self._directory_waiting(
            "Pin",
            directory_pb2.PinRequest(
                namespace=self._ns, hashes=pack_hashes(hashes), hard=ttl_ms is None, ttl_ms=ttl_ms or 0
            ),
        )
        return int(reply.changed)

    def unpin(self, hashes: Sequence[bytes]) -> int:
        """Unpin these blocks on every holder. Returns how many changed."""
        reply = self._directory_waiting(
            "Pin", directory_pb2.PinRequest(namespace=self._ns, hashes=pack_hashes(hashes), unpin=True)
        )
        return int(reply.changed)

    def stats(self) -> dict[str, Any]:
        """The directory's view: nodes, blocks, leases, counters (the directory's Stats JSON)."""
        result: dict[str, Any] = json.loads(self._directory_waiting("Stats", directory_pb2.StatsRequest()).json)
        result["client"] = dict(self.counters)
        return result

    def close(self) -> None:
        """Close the local client, the peer transports and the directory channel."""
        self._pool.shutdown(wait=True)
        for client in self._same_host.values():
            client.close()
        if self.local is not None:
            self.local.close()
        self.transport.close()
        self.link.close()
