"""A pool node: the shared-memory arena, its store, the namespaces it knows and its
event log. The gRPC service is a thin layer over this object."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kvpool.core.clock import Clock
from kvpool.core.config import DaemonConfig
from kvpool.core.errors import InvalidArgument, SpecMismatch, UnknownNamespace, VersionMismatch
from kvpool.core.events import EventKind
from kvpool.core.hashing import HASH_SCHEME
from kvpool.core.spec import KVSpec
from kvpool.daemon.event_log import EventLog
from kvpool.storage.allocator import check_block_fits
from kvpool.storage.arena import SharedArena
from kvpool.storage.node_store import build_node_store

log = logging.getLogger("kvpool.node")

MAX_NAMESPACES = 4096


@dataclass(frozen=True)
class NamespaceInfo:
    digest: bytes
    spec: KVSpec


class PoolNode:
    def __init__(self, config: DaemonConfig, clock: Clock) -> None:
        self.config = config
        self.node_id = config.node_id or config.listen
        self.events = EventLog(self.node_id)
        for stale in SharedArena.reap_stale(config.arena_dir):
            log.warning("removed the arena %s of a daemon that died without cleaning up", stale)
        self.arena = SharedArena.create(
            config.arena_dir, config.store.capacity_bytes, allow_overcommit=config.store.allow_overcommit
        )
        self._namespaces: dict[bytes, NamespaceInfo] = {}
        self._ns_lock = threading.Lock()
        self.store = build_node_store(config, self.arena.view, clock, self._on_event)
        log.info("node %s: arena %s (%d bytes)", self.node_id, self.arena.path, self.arena.capacity_bytes)

    def _on_event(self, kind: EventKind, hashes: list[bytes], namespace: bytes, tier: str = "host", /) -> None:
        info = self._namespaces.get(namespace)
        self.events.append(kind, hashes, namespace, info.spec.block_tokens if info else 0, tier=tier)

    def register(self, hash_scheme: str, spec: KVSpec, namespace: bytes, spec_digest: bytes) -> NamespaceInfo:
        if hash_scheme != HASH_SCHEME:
            raise VersionMismatch(
                f"client hashes with scheme {hash_scheme!r}, this node with {HASH_SCHEME!r}",
                hint="upgrade the client and the daemon to the same kvpool version",
            )
        if len(namespace) != 16:
            raise InvalidArgument(f"namespace digest must be 16 bytes, got {len(namespace)}")
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
                return known
            if len(self._namespaces) >= MAX_NAMESPACES:
                raise InvalidArgument(f"this node already serves {MAX_NAMESPACES} namespaces")
            info = NamespaceInfo(namespace, spec)
            self._namespaces[namespace] = info
            log.info("namespace %s registered: %s", namespace.hex(), spec.describe())
            return info

    def namespace(self, digest: bytes) -> NamespaceInfo:
        info = self._namespaces.get(digest)
        if info is None:
            raise UnknownNamespace(
                f"namespace {digest.hex() or '(empty)'} is not registered on node {self.node_id}",
                hint="call Hello first (PoolClient.connect does); the daemon may have restarted",
            )
        return info

    def namespaces(self) -> list[NamespaceInfo]:
        with self._ns_lock:
            return list(self._namespaces.values())

    def close(self) -> None:
        self.events.close()
        closer = getattr(self.store, "close", None)
        if closer is not None:
            closer()
        self.arena.close()
