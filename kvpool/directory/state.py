"""The directory's state: which live node holds which block, the node registry, leases.

Pure Python and single-lock; no gRPC, no etcd. Time comes from the injected clock. Nodes
are the source of truth: a node registers with a full snapshot of its blocks (which
replaces whatever the directory believed), then streams numbered events in heartbeats.
An event that does not follow the last applied seq means the directory lost track (it
restarted, or an event was dropped) and it asks the node to resync with a new snapshot.

Durable state goes through ``DirectoryDB`` (RocksDB) when one is given: a restarted
directory loads the registry and every node's last known blocks and answers lookups at
once; nodes that do not come back within ``node_ttl_ms`` are dropped.

Keys are opaque block keys; the service passes ``namespace digest || hash``
(``kvpool.core.keys``), so a lookup, remove or pin of one namespace can never see or drop
another namespace's holders, whatever hashes it names.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvpool.core.clock import Clock
from kvpool.core.errors import CapacityExhausted, InvalidArgument, SpecMismatch, VersionMismatch
from kvpool.core.hashing import HASH_SCHEME
from kvpool.core.invariants import checked_after, require
from kvpool.core.spec import KVSpec
from kvpool.directory.db import DirectoryDB
from kvpool.directory.index import (
    MAX_HOLDERS_IN_REPLY,
    TIER_CODES,
    TIER_NAMES,
    TIER_RANK,
    BlockIndex,
    NodeRecord,
)
from kvpool.directory.leases import MAX_LEASES, LeaseTable
from kvpool.directory.placement import choose_nodes

__all__ = [
    "MAX_HOLDERS_IN_REPLY",
    "MAX_NAMESPACES",
    "TIER_CODES",
    "TIER_NAMES",
    "TIER_RANK",
    "DirectoryDB",
    "DirectoryState",
    "EventIn",
    "LookupResult",
    "NodeRecord",
]

log = logging.getLogger("kvpool.directory")

#: namespaces the directory remembers (16 nodes' worth of --max-namespaces); when full, the
#: ones no holder's key names any more are forgotten first
MAX_NAMESPACES = 65_536


@dataclass(frozen=True)
class EventIn:
    seq: int
    kind: str  # "stored" | "removed" | "cleared"
    hashes: Sequence[bytes]  # block keys (the service builds them from namespace + hashes)
    tier: str = "host"


@dataclass(frozen=True)
class LookupResult:
    hits: int
    nodes: list[NodeRecord]
    masks: list[int]
    tiers: bytes
    lease_id: int = 0


class DirectoryState:
    def __init__(
        self,
        clock: Clock,
        node_ttl_ms: int = 5_000,
        db: DirectoryDB | None = None,
        max_lease_ms: int = 60_000,
        min_free_ratio: float = 0.05,
        max_leases: int = MAX_LEASES,
    ) -> None:
        self._clock = clock
        self.node_ttl_ms = node_ttl_ms
        self.min_free_ratio = min_free_ratio
        self._db = db
        self._lock = threading.RLock()
        self._nodes: dict[str, NodeRecord] = {}
        self._index = BlockIndex()
        self._namespaces: dict[bytes, bytes] = {}  # namespace digest -> spec digest
        self._leases = LeaseTable(max_lease_ms, max_leases)
        self._slots = itertools.count(1)
        self._dirty: set[str] = set()
        self._writing = 0  # nodes the flush in progress is writing
        self.epoch = 1
        self.counters = {
            "lookups": 0,
            "lookup_blocks": 0,
            "lookup_hits": 0,
            "read_locates": 0,  # Lookups sent by a read (for_read): not counted as lookups
            "registrations": 0,
            "resyncs": 0,
            "nodes_expired": 0,
            "events": 0,
        }
        # lookup hits per best tier among the holders (docs/architecture.md "Counters")
        self.lookup_hit_blocks_by_tier: dict[str, int] = dict.fromkeys(TIER_CODES, 0)
        if db is not None:
            self._load(db)

    # -- persistence ---------------------------------------------------------------------
    def _load(self, db: DirectoryDB) -> None:
        self.epoch = db.next_epoch()
        now = self._clock.now_ms()
        for spec_ns, spec_digest in db.namespaces():
            self._namespaces[spec_ns] = spec_digest
        for record, keys in db.nodes():
            record.slot = next(self._slots)
            record.confirmed = False
            record.alive = True
            record.last_heartbeat_ms = now  # give it one TTL to come back
            if keys is None:
                log.warning(
                    "directory: node %s: its stored key list does not match its row (an interrupted "
                    "flush): its blocks are not offered until it registers again",
                    record.node_id,
                )
                record.resync_needed = True
                keys = {}
            record.keys = keys
            self._nodes[record.node_id] = record
            self._index.attach(record)
        if self._nodes:
            log.info(
                "directory: loaded %d nodes and %d blocks from %s (epoch %d)",
                len(self._nodes),
                len(self._index),
                db.path,
                self.epoch,
            )

    def flush(self) -> int:
        """Write the nodes changed since the last flush to RocksDB (each node's row and key
        list in one write batch). Returns how many."""
        if self._db is None:
            return 0
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            rows = [(self._nodes.get(nid), nid) for nid in dirty]
            snapshot = [(r.public(), dict(r.keys)) if r is not None else (None, nid) for r, nid in rows]
            namespaces = dict(self._namespaces)
            self._writing = len(snapshot)
        flushed = 0
        try:
            for public, keys in snapshot:
                if public is None:
                    self._db.delete_node(str(keys))
                else:
                    assert isinstance(keys, dict)
                    self._db.put_node(public, keys)
                flushed += 1
        except BaseException:
            with self._lock:  # the rest (the failed one included) go again on the next flush
                self._dirty.update(nid for _, nid in rows[flushed:])
            raise
        finally:
            with self._lock:
                self._writing = 0
        self._db.put_namespaces(namespaces)
        return len(snapshot)

    # -- registration and heartbeats -----------------------------------------------------
    def check_namespace(self, namespace: bytes, spec_digest: bytes, spec_json: str) -> None:
        if len(namespace) != 16 or len(spec_digest) != 16:
            raise InvalidArgument("namespace and spec digests must be 16 bytes")
        try:
            spec = KVSpec.from_dict(json.loads(spec_json)) if spec_json else None
        except (ValueError, TypeError) as exc:
            raise InvalidArgument(f"unreadable spec for namespace {namespace.hex()}: {exc}") from exc
        if spec is not None and spec.digest() != spec_digest:
            raise SpecMismatch(
                f"namespace {namespace.hex()}: spec digest {spec_digest.hex()} does not match its spec "
                f"[{spec.describe()}] ({spec.digest().hex()})",
                hint="the node runs a kvpool version with a different spec encoding: upgrade it",
            )
        known = self._namespaces.get(namespace)
        if known is not None and known != spec_digest:
            raise SpecMismatch(
                f"namespace {namespace.hex()} is known with spec digest {known.hex()}, "
                f"the node reports {spec_digest.hex()}",
                hint="every node of a cluster must use the same model revision, layout, dtype and block size",
            )

    def _learn_namespace(self, namespace: bytes, spec_digest: bytes) -> None:
        """Remember a namespace's spec digest, within ``MAX_NAMESPACES``: when full, forget
        those no holder key (namespace || hash) names, then refuse (CapacityExhausted)."""
        if namespace not in self._namespaces and len(self._namespaces) >= MAX_NAMESPACES:
            used = self._index.namespaces_in_use()
            for unused in [ns for ns in self._namespaces if ns not in used]:
                del self._namespaces[unused]
            if len(self._namespaces) >= MAX_NAMESPACES:
                raise CapacityExhausted(
                    f"the directory knows {MAX_NAMESPACES} namespaces and every one has blocks",
                    hint="remove the blocks of namespaces no longer used",
                )
        self._namespaces[namespace] = spec_digest

    @checked_after
    def register(
        self,
        node: NodeRecord,
        hash_scheme: str,
        namespaces: Sequence[tuple[bytes, bytes, str]],
        hashes: Sequence[bytes],
        tiers: bytes,
    ) -> int:
        """A node (re)joins with a full snapshot; it replaces what the directory held for it."""
        if hash_scheme != HASH_SCHEME:
            raise VersionMismatch(
                f"node {node.node_id} hashes with scheme {hash_scheme!r}, the directory with {HASH_SCHEME!r}",
                hint="run the same kvpool version on every node",
            )
        if tiers and len(tiers) != len(hashes):
            raise InvalidArgument(f"{len(tiers)} tier codes for {len(hashes)} hashes")
        with self._lock:
            for ns, digest, spec_json in namespaces:
                self.check_namespace(ns, digest, spec_json)
            for ns, digest, _ in namespaces:
                self._learn_namespace(ns, digest)
            old = self._nodes.get(node.node_id)
            if old is not None:
                self._index.detach(old)
                node.slot = old.slot
            else:
                node.slot = next(self._slots)
            node.alive = True
            node.confirmed = True
            node.last_heartbeat_ms = node.last_registered_ms = self._clock.now_ms()
            node.keys = {key: tiers[i] if tiers else 0 for i, key in enumerate(hashes)}
            self._nodes[node.node_id] = node
            self._index.attach(node)
            self._dirty.add(node.node_id)
            self.counters["registrations"] += 1
            log.info(
                "directory: node %s registered (%s, data %s, %d blocks, seq %d)",
                node.node_id,
                node.control_address,
                node.data_address,
                len(hashes),
                node.last_seq,
            )
            return self.epoch

    @checked_after
    def heartbeat(
        self,
        node_id: str,
        incarnation: int,
        used_bytes: int,
        capacity_bytes: int,
        events: Iterable[EventIn],
        namespaces: Sequence[tuple[bytes, bytes, str]] = (),
    ) -> tuple[bool, int]:
        """Apply a node's events. Returns (resync needed, last applied seq)."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None or not node.alive or node.incarnation != incarnation or node.resync_needed:
                self.counters["resyncs"] += 1
                return True, 0
            for ns, digest, spec_json in namespaces:
                self.check_namespace(ns, digest, spec_json)
                self._learn_namespace(ns, digest)
            node.last_heartbeat_ms = self._clock.now_ms()
            node.confirmed = True
            node.used_bytes = used_bytes
            node.capacity_bytes = capacity_bytes
            for event in events:
                if event.seq <= node.last_seq:
                    continue  # already applied (a retried heartbeat)
                if event.seq != node.last_seq + 1:
                    log.info("directory: node %s skipped from seq %d to %d: resync", node_id, node.last_seq, event.seq)
                    self.counters["resyncs"] += 1
                    return True, node.last_seq
                self._apply(node, event)
                node.last_seq = event.seq
                self.counters["events"] += 1
            self._dirty.add(node_id)
            return False, node.last_seq

    def _apply(self, node: NodeRecord, event: EventIn) -> None:
        if event.kind == "stored":
            tier = TIER_CODES.get(event.tier, 0)
            for key in event.hashes:
                self._index.add(node, key, tier)
        elif event.kind == "removed":
            for key in event.hashes:
                self._index.discard(node, key)
        elif event.kind == "cleared":
            self._index.drop_keys(node)
        else:
            raise InvalidArgument(f"unknown event kind {event.kind!r}")

    @checked_after
    def mark_dead(self, node_id: str, why: str) -> bool:
        """Stop offering a node's blocks (lease expired in etcd, or heartbeats stopped)."""
        with self._lock:
            node = self._nodes.pop(node_id, None)
            if node is None:
                return False
            self._index.detach(node)
            node.alive = False
            self._dirty.add(node_id)
            self.counters["nodes_expired"] += 1
            log.warning("directory: node %s is gone (%s): its blocks are no longer offered", node_id, why)
            return True

    @checked_after
    def expire(self) -> list[str]:
        """Drop nodes whose last heartbeat is older than node_ttl_ms; sweep leases."""
        now = self._clock.now_ms()
        with self._lock:
            late = [n.node_id for n in self._nodes.values() if now - n.last_heartbeat_ms > self.node_ttl_ms]
            for node_id in late:
                self.mark_dead(node_id, f"no heartbeat for {self.node_ttl_ms} ms")
            self._leases.expire(now)
            return late

    # -- reads ---------------------------------------------------------------------------
    @checked_after
    def lookup(
        self, keys: Sequence[bytes], client_node: str = "", lease_ms: int = 0, for_read: bool = False
    ) -> LookupResult:
        """Per leading block, which live nodes hold it (``BlockIndex.leading_run``); with
        ``lease_ms`` the hits are leased (``LeaseTable``: bounded, lease_id 0 when full)."""
        with self._lock:
            run = self._index.leading_run(keys)
            hits = run.hits
            if for_read:  # the read that follows a lookup asked no new question
                self.counters["read_locates"] += 1
            else:
                self.counters["lookups"] += 1
                self.counters["lookup_blocks"] += len(keys)
                self.counters["lookup_hits"] += hits
                for code in run.tiers[:hits]:
                    self.lookup_hit_blocks_by_tier[TIER_NAMES.get(code, "host")] += 1
            lease_id = 0
            if lease_ms > 0 and hits:
                lease_id = self._leases.grant(keys[:hits], lease_ms, self._clock.now_ms())
            return LookupResult(hits, run.nodes, run.masks, run.tiers, lease_id)

    @checked_after
    def release(self, lease_ids: Iterable[int], may_release: Callable[[bytes], bool] | None = None) -> int:
        """Release directory leases (``LeaseTable.release``: only in namespaces ``may_release`` accepts)."""
        with self._lock:
            return self._leases.release(lease_ids, may_release)

    @checked_after
    def take_due_removes(self) -> dict[bytes, dict[str, list[bytes]]]:
        """Deferred removes whose leases are gone: namespace -> node -> keys to forward."""
        with self._lock:
            return {ns: self._index.holders_by_node(keys, forget=True) for ns, keys in self._leases.take_due().items()}

    @checked_after
    def remove(self, keys: Sequence[bytes], namespace: bytes = b"") -> tuple[dict[str, list[bytes]], int]:
        """Blocks to remove now (grouped by holder node) and how many wait for a lease."""
        with self._lock:
            now_keys = [k for k in keys if not self._leases.is_leased(k)]
            deferred = [k for k in keys if self._leases.is_leased(k) and self._index.holds(k)]
            for key in deferred:
                self._leases.defer(key, namespace)
            return self._index.holders_by_node(now_keys, forget=True), len(deferred)

    def holders_by_node(self, keys: Sequence[bytes]) -> dict[str, list[bytes]]:
        with self._lock:
            return self._index.holders_by_node(keys, forget=False)

    # -- placement -----------------------------------------------------------------------
    def place(self, blocks: int, block_bytes: int, client_node: str = "", replicas: int = 1) -> list[NodeRecord]:
        """Nodes to write a batch to (``placement.choose_nodes``)."""
        with self._lock:
            live = [n for n in self._nodes.values() if n.alive]
            local = self._nodes.get(client_node)
            return choose_nodes(live, local, blocks, block_bytes, replicas, self.min_free_ratio)

    def check_invariants(self) -> None:
        """The index's and the leases' own rules, and: every registered node is alive and
        attached to the index, and no more namespaces than the bound (debug mode)."""
        with self._lock:
            self._index.check_invariants()
            self._leases.check_invariants()
            for node_id, node in self._nodes.items():
                require("DirectoryState", "a registered node is alive", node.alive and node.node_id == node_id, node_id)
                require(
                    "DirectoryState",
                    "a registered node is in the index",
                    self._index.node_at(node.slot) is node,
                    node_id,
                )
            require("DirectoryState", "namespaces are bounded", len(self._namespaces) <= MAX_NAMESPACES)

    # -- introspection -------------------------------------------------------------------
    def node(self, node_id: str) -> NodeRecord | None:
        with self._lock:
            return self._nodes.get(node_id)

    def nodes(self) -> list[NodeRecord]:
        with self._lock:
            return list(self._nodes.values())

    def summary(self) -> dict[str, object]:
        with self._lock:
            return {
                "epoch": self.epoch,
                "nodes": [
                    {**n.public(), "blocks": len(n.keys), "confirmed": n.confirmed} for n in self._nodes.values()
                ],
                "blocks": len(self._index),
                "namespaces": len(self._namespaces),
                "leases_active": len(self._leases),
                "leases_refused": self._leases.refused,
                "deferred_removes": self._leases.deferred,
                # nodes whose last change is not in RocksDB yet (0 without --data-dir)
                "unflushed_nodes": len(self._dirty) + self._writing if self._db is not None else 0,
                **self.counters,
                "lookup_hit_blocks_by_tier": dict(self.lookup_hit_blocks_by_tier),
            }
