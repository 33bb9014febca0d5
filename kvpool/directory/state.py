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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvpool.core.clock import Clock
from kvpool.core.errors import CapacityExhausted, InvalidArgument, NotFound, SpecMismatch, VersionMismatch
from kvpool.core.hashing import HASH_SCHEME
from kvpool.core.spec import KVSpec
from kvpool.directory.db import DirectoryDB

log = logging.getLogger("kvpool.directory")

TIER_CODES = {"device": 2, "host": 0, "disk": 1}
TIER_NAMES = {code: name for name, code in TIER_CODES.items()}
#: lower is better for reading: host DRAM first, then device, then disk
TIER_RANK = {0: 0, 2: 1, 1: 2}
MAX_HOLDERS_IN_REPLY = 64
#: namespaces the directory remembers (16 nodes' worth of --max-namespaces); when full, the
#: ones no holder's key names any more are forgotten first
MAX_NAMESPACES = 65_536


@dataclass
class NodeRecord:
    node_id: str
    control_address: str
    data_address: str
    transport: str
    host: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    incarnation: int = 0
    last_seq: int = 0
    last_heartbeat_ms: float = 0.0
    last_registered_ms: float = 0.0
    alive: bool = True
    confirmed: bool = True  # False after a directory restart until the node heartbeats again
    # True when the loaded key list did not match the node row (a torn flush): its blocks are
    # not offered and its next heartbeat gets ``resync`` whatever its seq
    resync_needed: bool = False
    slot: int = 0
    keys: dict[bytes, int] = field(default_factory=dict)  # block key -> tier code
    # what readers need beyond data_address (a NIXL agent's metadata); not persisted: a restarted
    # directory serves "" until the node re-registers, and readers then ask the node itself
    transport_metadata: bytes = b""

    def public(self) -> dict[str, object]:
        return {
            "node_id": self.node_id,
            "control_address": self.control_address,
            "data_address": self.data_address,
            "transport": self.transport,
            "host": self.host,
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "incarnation": self.incarnation,
            "last_seq": self.last_seq,
        }

    @property
    def free_ratio(self) -> float:
        if self.capacity_bytes <= 0:
            return 0.0
        return max(0.0, 1.0 - self.used_bytes / self.capacity_bytes)


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


@dataclass
class _Lease:
    expires_ms: float
    keys: frozenset[bytes]


class DirectoryState:
    def __init__(
        self,
        clock: Clock,
        node_ttl_ms: int = 5_000,
        db: DirectoryDB | None = None,
        max_lease_ms: int = 60_000,
        min_free_ratio: float = 0.05,
    ) -> None:
        self._clock = clock
        self.node_ttl_ms = node_ttl_ms
        self.max_lease_ms = max_lease_ms
        self.min_free_ratio = min_free_ratio
        self._db = db
        self._lock = threading.RLock()
        self._nodes: dict[str, NodeRecord] = {}
        self._by_slot: dict[int, NodeRecord] = {}
        self._holders: dict[bytes, dict[int, int]] = {}  # block key -> {node slot: tier code}
        self._namespaces: dict[bytes, bytes] = {}  # namespace digest -> spec digest
        self._leases: dict[int, _Lease] = {}
        self._leased_count: dict[bytes, int] = {}
        self._deferred_removes: dict[bytes, bytes] = {}  # block key -> namespace
        self._slots = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._dirty: set[str] = set()
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
            self._by_slot[record.slot] = record
            for key, tier in keys.items():
                self._holders.setdefault(key, {})[record.slot] = tier
        if self._nodes:
            log.info(
                "directory: loaded %d nodes and %d blocks from %s (epoch %d)",
                len(self._nodes),
                len(self._holders),
                db.path,
                self.epoch,
            )

    def flush(self) -> int:
        """Write the nodes changed since the last flush to RocksDB. Returns how many."""
        if self._db is None:
            return 0
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            rows = [(self._nodes.get(nid), nid) for nid in dirty]
            snapshot = [(r.public(), dict(r.keys)) if r is not None else (None, nid) for r, nid in rows]
            namespaces = dict(self._namespaces)
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
            used = {key[:16] for key in self._holders}
            for unused in [ns for ns in self._namespaces if ns not in used]:
                del self._namespaces[unused]
            if len(self._namespaces) >= MAX_NAMESPACES:
                raise CapacityExhausted(
                    f"the directory knows {MAX_NAMESPACES} namespaces and every one has blocks",
                    hint="remove the blocks of namespaces no longer used",
                )
        self._namespaces[namespace] = spec_digest

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
                self._drop_keys(old)
                node.slot = old.slot
            else:
                node.slot = next(self._slots)
            node.alive = True
            node.confirmed = True
            node.last_heartbeat_ms = node.last_registered_ms = self._clock.now_ms()
            node.keys = {}
            self._nodes[node.node_id] = node
            self._by_slot[node.slot] = node
            for i, key in enumerate(hashes):
                self._add(node, key, tiers[i] if tiers else 0)
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
                self._add(node, key, tier)
        elif event.kind == "removed":
            for key in event.hashes:
                self._discard(node, key)
        elif event.kind == "cleared":
            self._drop_keys(node)
        else:
            raise InvalidArgument(f"unknown event kind {event.kind!r}")

    def _add(self, node: NodeRecord, key: bytes, tier: int) -> None:
        node.keys[key] = tier
        self._holders.setdefault(key, {})[node.slot] = tier

    def _discard(self, node: NodeRecord, key: bytes) -> None:
        if node.keys.pop(key, None) is None:
            return
        holders = self._holders.get(key)
        if holders is not None:
            holders.pop(node.slot, None)
            if not holders:
                del self._holders[key]

    def _drop_keys(self, node: NodeRecord) -> None:
        for key in node.keys:
            holders = self._holders.get(key)
            if holders is not None:
                holders.pop(node.slot, None)
                if not holders:
                    del self._holders[key]
        node.keys = {}

    def mark_dead(self, node_id: str, why: str) -> bool:
        """Stop offering a node's blocks (lease expired in etcd, or heartbeats stopped)."""
        with self._lock:
            node = self._nodes.pop(node_id, None)
            if node is None:
                return False
            self._drop_keys(node)
            self._by_slot.pop(node.slot, None)
            node.alive = False
            self._dirty.add(node_id)
            self.counters["nodes_expired"] += 1
            log.warning("directory: node %s is gone (%s): its blocks are no longer offered", node_id, why)
            return True

    def expire(self) -> list[str]:
        """Drop nodes whose last heartbeat is older than node_ttl_ms; sweep leases."""
        now = self._clock.now_ms()
        with self._lock:
            late = [n.node_id for n in self._nodes.values() if now - n.last_heartbeat_ms > self.node_ttl_ms]
            for node_id in late:
                self.mark_dead(node_id, f"no heartbeat for {self.node_ttl_ms} ms")
            for lease_id in [i for i, lease in self._leases.items() if lease.expires_ms <= now]:
                self._drop_lease(lease_id)
            return late

    # -- reads ---------------------------------------------------------------------------
    def lookup(
        self, keys: Sequence[bytes], client_node: str = "", lease_ms: int = 0, for_read: bool = False
    ) -> LookupResult:
        """Per leading block, which live nodes hold it (stops at the first block nobody holds).

        The reply names at most ``MAX_HOLDERS_IN_REPLY`` nodes, and every block counted as a
        hit has at least one of them in its mask: a hit the client cannot read from is worse
        than a miss (it plans a read with no holder). The usual prompt has a few holders and
        takes one pass; one whose holders do not fit goes through ``_reply_slots``.
        """
        with self._lock:
            run: list[dict[int, int]] = []  # holders of each leading held block
            bit_of: dict[int, int] = {}
            masks: list[int] = []
            tiers = bytearray()
            overflow = False
            for key in keys:
                holders = self._holders.get(key)
                if not holders:
                    break
                run.append(holders)
                if overflow:
                    continue
                mask = 0
                best = 3
                for slot, tier in holders.items():
                    bit = bit_of.get(slot)
                    if bit is None:
                        if len(bit_of) >= MAX_HOLDERS_IN_REPLY:
                            overflow = True  # redone below by _reply_slots
                            break
                        bit = bit_of[slot] = len(bit_of)
                    mask |= 1 << bit
                    if TIER_RANK.get(tier, 3) < TIER_RANK.get(best, 3):
                        best = tier
                else:
                    masks.append(mask)
                    tiers.append(best if best != 3 else 0)
            if overflow:
                slots, hits = self._reply_slots(run)
                bit_of = {slot: bit for bit, slot in enumerate(slots)}
                masks, tiers = [], bytearray()
                for holders in run[:hits]:
                    self._mask_block(holders, bit_of, masks, tiers)
            hits = len(masks)
            nodes = [self._by_slot[slot] for slot in bit_of]
            if for_read:  # the read that follows a lookup asked no new question
                self.counters["read_locates"] += 1
            else:
                self.counters["lookups"] += 1
                self.counters["lookup_blocks"] += len(keys)
                self.counters["lookup_hits"] += hits
                for code in tiers[:hits]:
                    self.lookup_hit_blocks_by_tier[TIER_NAMES.get(code, "host")] += 1
            lease_id = 0
            if lease_ms > 0 and hits:
                lease_id = next(self._lease_ids)
                leased = frozenset(keys[:hits])
                self._leases[lease_id] = _Lease(self._clock.now_ms() + min(lease_ms, self.max_lease_ms), leased)
                for key in leased:
                    self._leased_count[key] = self._leased_count.get(key, 0) + 1
            return LookupResult(hits, nodes, masks, bytes(tiers), lease_id)

    @staticmethod
    def _mask_block(holders: dict[int, int], bit_of: dict[int, int], masks: list[int], tiers: bytearray) -> None:
        """Append one block's holder mask (over the reply's nodes) and the best tier among them."""
        mask = 0
        best = 3
        for slot, tier in holders.items():
            bit = bit_of.get(slot)
            if bit is None:
                continue  # not in the reply: the client cannot read from it
            mask |= 1 << bit
            if TIER_RANK.get(tier, 3) < TIER_RANK.get(best, 3):
                best = tier
        masks.append(mask)
        tiers.append(best if best != 3 else 0)

    @staticmethod
    def _reply_slots(run: Sequence[dict[int, int]]) -> tuple[list[int], int]:
        """For a prompt whose holders do not all fit in a reply: the node slots to name (in
        bit order, at most ``MAX_HOLDERS_IN_REPLY``) and how many leading blocks of ``run``
        they cover (the hits).

        Greedy cover: walking the blocks, a block none of the chosen nodes holds gets the
        holder whose contiguous run from there reaches furthest (the longest prefix any
        choice could cover when each node holds a contiguous run, which chain hashes make the
        usual case); the hits stop at the first block that would need a node past the cap.
        The spare room is then filled with further holders, earliest blocks first, so the
        client still has replicas to choose from.
        """
        chosen: dict[int, None] = {}  # insertion-ordered set
        hits = 0
        while hits < len(run):
            if not any(slot in chosen for slot in run[hits]):
                if len(chosen) >= MAX_HOLDERS_IN_REPLY:
                    break
                # the holders whose contiguous run from here reaches furthest: lockstep scan
                furthest = set(run[hits])
                for holders in itertools.islice(run, hits + 1, None):
                    still = furthest.intersection(holders)
                    if not still:
                        break
                    furthest = still
                chosen[min(furthest)] = None
            hits += 1
        for holders in run[:hits]:
            for slot in holders:
                if len(chosen) >= MAX_HOLDERS_IN_REPLY:
                    return list(chosen), hits
                chosen.setdefault(slot)
        return list(chosen), hits

    def release(self, lease_ids: Iterable[int]) -> int:
        with self._lock:
            return sum(1 for lease_id in lease_ids if self._drop_lease(lease_id))

    def _drop_lease(self, lease_id: int) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        for key in lease.keys:
            left = self._leased_count.get(key, 1) - 1
            if left <= 0:
                self._leased_count.pop(key, None)
            else:
                self._leased_count[key] = left
        return True

    def take_due_removes(self) -> dict[bytes, dict[str, list[bytes]]]:
        """Deferred removes whose leases are gone: namespace -> node -> keys to forward."""
        with self._lock:
            due = [k for k in self._deferred_removes if k not in self._leased_count]
            by_ns: dict[bytes, list[bytes]] = {}
            for key in due:
                by_ns.setdefault(self._deferred_removes.pop(key), []).append(key)
            return {ns: self._holders_by_node(keys, forget=True) for ns, keys in by_ns.items()}

    def remove(self, keys: Sequence[bytes], namespace: bytes = b"") -> tuple[dict[str, list[bytes]], int]:
        """Blocks to remove now (grouped by holder node) and how many wait for a lease."""
        with self._lock:
            now_keys = [k for k in keys if k not in self._leased_count]
            deferred = [k for k in keys if k in self._leased_count and k in self._holders]
            for key in deferred:
                self._deferred_removes[key] = namespace
            return self._holders_by_node(now_keys, forget=True), len(deferred)

    def holders_by_node(self, keys: Sequence[bytes]) -> dict[str, list[bytes]]:
        with self._lock:
            return self._holders_by_node(keys, forget=False)

    def _holders_by_node(self, keys: Iterable[bytes], forget: bool) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        for key in keys:
            for slot in list(self._holders.get(key, {})):
                node = self._by_slot.get(slot)
                if node is None:
                    continue
                out.setdefault(node.node_id, []).append(key)
                if forget:
                    self._discard(node, key)
        return out

    # -- placement -----------------------------------------------------------------------
    def place(self, blocks: int, block_bytes: int, client_node: str = "", replicas: int = 1) -> list[NodeRecord]:
        """Nodes to write a batch to: the client's own node first if it has room, then the
        nodes with the largest free ratio, ``replicas`` distinct nodes in all."""
        if replicas <= 0:
            raise InvalidArgument("replicas must be >= 1")
        need = blocks * block_bytes
        with self._lock:
            live = [n for n in self._nodes.values() if n.alive]
            if not live:
                raise NotFound(
                    "no live node is registered with the directory",
                    hint="start 'kvpool serve --directory ...' on at least one node",
                )

            def fits(n: NodeRecord) -> bool:
                free = n.capacity_bytes - n.used_bytes
                return n.free_ratio >= self.min_free_ratio and free >= need

            chosen: list[NodeRecord] = []
            local = self._nodes.get(client_node)
            if local is not None and local.alive and fits(local):
                chosen.append(local)
            rest = sorted((n for n in live if n not in chosen), key=lambda n: (-n.free_ratio, n.node_id))
            for node in rest:
                if len(chosen) >= replicas:
                    break
                chosen.append(node)
            return chosen[:replicas]

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
                "blocks": len(self._holders),
                "namespaces": len(self._namespaces),
                "leases_active": len(self._leases),
                "deferred_removes": len(self._deferred_removes),
                **self.counters,
                "lookup_hit_blocks_by_tier": dict(self.lookup_hit_blocks_by_tier),
            }
