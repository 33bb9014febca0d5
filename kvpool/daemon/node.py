"""A pool node: the shared-memory arena, its store, the namespaces it knows and its
event log. The gRPC service is a thin layer over this object.

Tenancy (docs/security.md): the store is keyed by ``namespace digest || hash``
(``kvpool.core.keys``), so every call reaches only its own namespace's blocks; this object
turns the store's keys back into per-namespace events. The namespace table is bounded
(``max_namespaces``): when it is full, or during the periodic sweep, namespaces that hold
no block and saw no call for ``namespace_idle_ms`` are retired (under pressure, blockless
ones are retired least recently used first even before that). A retired namespace's
client gets UnknownNamespace on its next call and registers again (PoolClient does).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.core.clock import Clock
from kvpool.core.config import DaemonConfig
from kvpool.core.errors import CapacityExhausted, InvalidArgument, SpecMismatch, UnknownNamespace, VersionMismatch
from kvpool.core.events import EventKind
from kvpool.core.hashing import HASH_SCHEME
from kvpool.core.keys import NAMESPACE_BYTES, group_by_namespace, key_namespace
from kvpool.core.spec import KVSpec
from kvpool.daemon.block_history import NOT_PROMOTED, HotBlocks, LeaseRefusals, Removal, RemovalLog
from kvpool.daemon.counters import TrafficCounters
from kvpool.daemon.event_log import EventLog
from kvpool.rpc.errors import RateLimitedLog
from kvpool.storage.allocator import check_block_fits
from kvpool.storage.arena import MEMINFO_PATH, HugePagesUnavailable, SharedArena
from kvpool.storage.arena_segments import SegmentedArena
from kvpool.storage.host_store import LeaseGrant
from kvpool.storage.node_store import build_node_store
from kvpool.storage.thp import THP_ON_COMMAND, ShmemThp

log = logging.getLogger("kvpool.node")

#: how often the sweeper looks for idle namespaces (a scan of the store's keys)
NAMESPACE_RETIRE_INTERVAL_MS = 30_000
#: at most one "namespace registered" log line per this many seconds
REGISTER_LOG_INTERVAL_S = 10.0


def capability_id() -> int:
    """A random 63-bit lease / put id: whoever holds it may release / commit / abort, and
    no other caller can guess it (a counter would let tenant B end tenant A's leases)."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class NamespaceInfo:
    digest: bytes
    spec: KVSpec


def create_arena(config: DaemonConfig, thp: ShmemThp | None = None) -> SharedArena:
    """The node's arena as ``config`` asks: a memfd handed to admitted clients or a file in
    ``arena_dir``; with ``arena_huge_pages`` on reserved huge pages ("on"), on transparent
    huge pages of shared memory ("thp"), or on the first of those the host has ("try",
    else 4 KiB pages, with a warning that says how to get either). ``thp``: the host's
    setting (default: read from sysfs now)."""
    capacity, overcommit, huge = config.store.capacity_bytes, config.store.allow_overcommit, config.arena_huge_pages
    if not config.arena_by_fd:  # no name to open: handed to admitted clients (arena_handoff.py)
        if huge == "try":
            log.warning("arena: 4 KiB pages (--arena-huge-pages try needs --arena-handoff fd or auto)")
        return SharedArena.create(config.arena_dir, capacity, allow_overcommit=overcommit)
    if thp is None and huge in ("thp", "try"):
        thp = ShmemThp.measure()  # the host's setting, read only when asked for
    if config.segment_bytes:  # per tenant: a memfd per segment (storage/arena_segments.py)
        segment_bytes = config.segment_bytes

        def make(kind: str) -> SharedArena:
            return SegmentedArena(
                capacity,
                segment_bytes,
                huge_pages=kind == "on",
                meminfo_path=MEMINFO_PATH,
                transparent=thp if kind == "thp" else None,
            )
    else:

        def make(kind: str) -> SharedArena:
            if kind == "on":
                return SharedArena.create_memfd(capacity, huge_pages=True)
            transparent = thp if kind == "thp" else None
            return SharedArena.create_memfd(capacity, allow_overcommit=overcommit, transparent=transparent)

    if huge in ("on", "thp"):
        return make(huge)  # HugePagesUnavailable says what to set
    if huge == "try":
        try:
            return make("on")
        except HugePagesUnavailable as err:
            reserved = err
        try:
            arena = make("thp")
            log.info("arena: transparent huge pages, not reserved ones: %s (%s)", reserved.message, reserved.hint)
            return arena
        except HugePagesUnavailable as err:
            log.warning(
                "arena: 4 KiB pages, not huge pages: %s; %s (%s; or, with nothing reserved: %s)",
                reserved.message,
                err.message,
                reserved.hint,
                THP_ON_COMMAND,
            )
    return make("off")


class PoolNode:
    def __init__(self, config: DaemonConfig, clock: Clock) -> None:
        self.config = config
        self._clock = clock
        self.node_id = config.node_id or config.listen
        self.events = EventLog(self.node_id)
        for stale in SharedArena.reap_stale(config.arena_dir):
            log.warning("removed the arena %s of a daemon that died without cleaning up", stale)
        self.arena = create_arena(config)
        self._namespaces: dict[bytes, NamespaceInfo] = {}
        self._last_used_ms: dict[bytes, float] = {}  # namespace -> last call that named it
        self._ns_lock = threading.Lock()
        self._next_retire_ms = clock.now_ms() + NAMESPACE_RETIRE_INTERVAL_MS
        self.namespaces_retired = 0
        self.counters = TrafficCounters()  # lookups and reads, per namespace and tier
        # bounded records for kvpool inspect lookup / hot (kvpool.daemon.block_history)
        self.removals = RemovalLog()
        self.hot = HotBlocks()
        self.lease_refusals = LeaseRefusals()
        self._why = threading.local()  # the reason of a removal this thread is making
        # a flood of Hellos must not flood the log: one line per interval, with a count
        self._registered_log = RateLimitedLog(log, REGISTER_LOG_INTERVAL_S, level=logging.INFO)
        self.store = build_node_store(config, self.arena.view, clock, self._on_event, capability_id)
        log.info(
            "node %s: arena %s (%d bytes, %d-byte pages)",
            self.node_id,
            self.arena.path or "memfd",
            self.arena.capacity_bytes,
            self.arena.page_bytes,
        )

    def _on_event(
        self, kind: EventKind, keys: list[bytes], namespace: bytes, tier: str = "host", cause: str = "", /
    ) -> None:
        """The store's events name block keys; subscribers get one event per namespace with
        its 16-byte hashes (each key carries its namespace, even where a lower tier reports
        a removal without one). A removal is recorded with the store's ``cause`` (a lower
        tier's checksum failure or I/O error), else the reason of the call this thread is
        making (a client's remove, a reported corrupt block), else as an eviction."""
        for ns, hashes in group_by_namespace(keys).items():
            info = self._namespaces.get(ns)
            self.events.append(kind, hashes, ns, info.spec.block_tokens if info else 0, tier=tier)
        if kind is EventKind.REMOVED:
            # what the store does on its own is evicting
            reason = cause or getattr(self._why, "reason", "evicted")
            policy = self.tier_policy(tier) if reason == "evicted" else ""
            self.removals.on_removed(keys, Removal(reason, tier, policy, self._clock.now_ms()))
        elif kind is EventKind.STORED:
            self.removals.on_stored(keys)

    def tier_policy(self, tier: str) -> str:
        """The eviction policy of ``tier`` (its config name)."""
        tiers = self.config.tiers
        return {"host": tiers.host_policy, "disk": tiers.disk_policy, "device": tiers.device_policy}.get(tier, "")

    def remove(self, keys: Sequence[bytes]) -> int:
        """A client's (or an operator's) Remove: recorded as ``removed``, not as an eviction."""
        self._why.reason = "removed"
        try:
            return self.store.remove(keys)
        finally:
            del self._why.reason

    def register(self, hash_scheme: str, spec: KVSpec, namespace: bytes, spec_digest: bytes) -> NamespaceInfo:
        if hash_scheme != HASH_SCHEME:
            raise VersionMismatch(
                f"client hashes with scheme {hash_scheme!r}, this node with {HASH_SCHEME!r}",
                hint="upgrade the client and the daemon to the same kvpool version",
            )
        if len(namespace) != NAMESPACE_BYTES:
            raise InvalidArgument(f"namespace digest must be {NAMESPACE_BYTES} bytes, got {len(namespace)}")
        if spec.digest() != spec_digest:
            raise SpecMismatch(
                "the spec digest the client sent does not match its spec's canonical encoding",
                hint="client and daemon disagree on the spec encoding: use the same kvpool version",
            )
        try:
            check_block_fits(spec.block_bytes, self.config.store.slab_bytes)
        except InvalidArgument as err:
            raise InvalidArgument(f"{spec.describe()}: {err.message}", hint=err.hint) from None
        with self._ns_lock:
            known = self._namespaces.get(namespace)
            if known is not None:
                known.spec.require_same(spec, "client")
                self._last_used_ms[namespace] = self._clock.now_ms()
                return known
        limit = self.config.max_namespaces
        if len(self._namespaces) >= limit:
            self.retire_idle(under_pressure=True)
        with self._ns_lock:
            known = self._namespaces.get(namespace)
            if known is not None:  # registered by a racing Hello meanwhile
                known.spec.require_same(spec, "client")
                return known
            if len(self._namespaces) >= limit:
                raise CapacityExhausted(
                    f"this node serves {limit} namespaces and every one holds blocks",
                    hint="raise --max-namespaces, or remove the blocks of namespaces no longer used",
                )
            info = NamespaceInfo(namespace, spec)
            self._namespaces[namespace] = info
            self._last_used_ms[namespace] = self._clock.now_ms()
            self._registered_log.emit("register", f"namespace {namespace.hex()} registered: {spec.describe()}")
            return info

    def namespace(self, digest: bytes) -> NamespaceInfo:
        """The registered namespace a call names (and mark it used), or UnknownNamespace."""
        info = self._namespaces.get(digest)
        if info is None:
            raise UnknownNamespace(
                f"namespace {digest.hex()[:64] or '(empty)'} is not registered on node {self.node_id}",
                hint="call Hello first (PoolClient.connect does); the daemon may have restarted "
                "or retired the namespace after it was idle",
            )
        self._last_used_ms[digest] = self._clock.now_ms()
        return info

    def retire_idle(self, under_pressure: bool = False) -> int:
        """Retire namespaces that hold no block: those idle for ``namespace_idle_ms``, and,
        ``under_pressure`` (the table is full), the least recently used others down to 3/4 of
        the table. One scan of the store's keys. Returns how many were retired."""
        with_blocks = {key_namespace(k) for k in self.store.snapshot_keys()}
        now = self._clock.now_ms()
        idle_ms = self.config.namespace_idle_ms
        with self._ns_lock:
            blockless = sorted(
                (ns for ns in self._namespaces if ns not in with_blocks), key=lambda ns: self._last_used_ms.get(ns, 0.0)
            )
            retire = [ns for ns in blockless if now - self._last_used_ms.get(ns, 0.0) >= idle_ms]
            if under_pressure:
                excess = len(self._namespaces) - len(retire) - self.config.max_namespaces * 3 // 4
                idle = set(retire)
                rest = [ns for ns in blockless if ns not in idle]
                retire.extend(rest[: max(0, excess)])
            for ns in retire:
                del self._namespaces[ns]
                self._last_used_ms.pop(ns, None)
                self.counters.forget(ns)
            self.namespaces_retired += len(retire)
        if retire:
            log.info("retired %d namespaces without blocks (%d left)", len(retire), len(self._namespaces))
        return len(retire)

    def lookup(self, info: NamespaceInfo, keys: Sequence[bytes]) -> int:
        """How many leading blocks of ``keys`` (this namespace's) the node holds, counted as
        one lookup (hits per tier, misses) in ``counters``."""
        by_tier = self.store.lookup_by_tier(keys)
        if self._namespaces.get(info.digest) is info:  # retired meanwhile: its counters are gone
            self.counters.count_lookup(info.digest, info.spec.block_tokens, by_tier, len(keys))
        return sum(by_tier.values())

    def lease(self, info: NamespaceInfo, keys: Sequence[bytes]) -> LeaseGrant:
        """Lease the leading blocks of ``keys`` for a reader, counted as one read."""
        grant = self.store.lease(keys)
        self.count_read(info.digest, len(grant.locations), len(keys), keys[: len(grant.locations)])
        self.lease_refusals.on_granted(info.digest)
        if grant.not_promoted:  # held on a lower tier, but host could not take it: the reader missed it
            self.note_lease_refused(info.digest, NOT_PROMOTED, grant.not_promoted)
        return grant

    def note_lease_refused(self, namespace: bytes, code: str, message: str) -> None:
        """Remember why a lease of ``namespace`` was refused (or cut short), for ``kvpool
        inspect lookup``: a prompt whose blocks are all here can still miss at read time."""
        self.lease_refusals.note(namespace, code, message, self._clock.now_ms())

    def count_read(
        self, namespace: bytes, served_blocks: int, asked_blocks: int, served_keys: Sequence[bytes] = ()
    ) -> None:
        """Count one read (and its ``served_keys`` in the hot-block counts of ``kvpool inspect
        hot``). A namespace not registered (any more) is not counted, so the per-namespace
        counters stay bounded by the namespace table (a data-plane read of an unknown namespace
        is refused before it leases anything)."""
        info = self._namespaces.get(namespace)
        if info is not None:
            self.counters.count_read(namespace, info.spec.block_tokens, served_blocks, asked_blocks)
            self.hot.on_read(served_keys)

    def drop_corrupt(self, info: NamespaceInfo, keys: Sequence[bytes]) -> int:
        """A reader says these blocks of its namespace failed their checksum: re-verify each
        against its committed checksum and drop the ones that really are bad (counted in
        ``checksum_failures``, REMOVED sent, so the directory drops this holder and the next
        put stores fresh bytes). ``keys`` are built from the caller's namespace (``block_keys``),
        so a report can only ever reach its own blocks; a block that verifies is kept. Returns
        how many were dropped."""
        self._why.reason = "checksum_failure"
        try:
            dropped = self.store.drop_corrupt(keys)
        finally:
            del self._why.reason
        if dropped:
            log.warning(
                "namespace %s: %d blocks reported corrupt failed their checksum here too and were dropped",
                info.digest.hex()[:16],
                len(dropped),
            )
        return len(dropped)

    def sweep(self) -> None:
        """The sweeper's tick: the store's leases and puts, and now and then idle namespaces."""
        self.store.sweep()
        now = self._clock.now_ms()
        if now >= self._next_retire_ms:
            self._next_retire_ms = now + NAMESPACE_RETIRE_INTERVAL_MS
            self.retire_idle()

    def namespaces(self) -> list[NamespaceInfo]:
        with self._ns_lock:
            return list(self._namespaces.values())

    def close(self) -> None:
        self.events.close()
        flush = getattr(self.store, "shutdown_flush", None)  # a tiered store with a disk tier
        if flush is not None and self.config.tiers.shutdown_flush_ms > 0:
            flush(self.config.tiers.shutdown_flush_ms)
        closer = getattr(self.store, "close", None)
        if closer is not None:
            closer()
        self.arena.close()
