"""Builds a node's store from its configuration: the composition point of the tiers.

The daemon calls ``build_node_store`` and uses only the ``HostStore`` interface
(lookup, lease, release, put_start, put_commit, put_abort, remove, pin, unpin, sweep,
summary, snapshot_keys), so tiering grows behind it: with a disk directory or a device
capacity configured it gets a ``TieredStore`` (same methods, plus ``close`` and per-tier
stats under ``summary()["tiers"]``); otherwise the plain ``HostStore``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvpool.core.clock import Clock
from kvpool.core.config import DaemonConfig
from kvpool.storage.eviction import make_policy
from kvpool.storage.host_store import EventSink, HostStore
from kvpool.storage.tiered_store import TieredStore


def build_node_store(
    config: DaemonConfig,
    buffer: np.ndarray,
    clock: Clock,
    on_event: EventSink | None,
    id_source: Callable[[], int] | None = None,
) -> HostStore | TieredStore:
    """``id_source``: lease and put ids (the daemon passes unguessable ones, see HostStore)."""
    tiers, segment_bytes = config.tiers, config.segment_bytes  # per-tenant arena: the allocator's segments
    if tiers.disk_dir or tiers.device_capacity_bytes > 0:
        return TieredStore(
            buffer, config.store, tiers, clock, on_event=on_event, id_source=id_source, segment_bytes=segment_bytes
        )
    return HostStore(
        buffer,
        config.store,
        clock,
        policy=make_policy(tiers.host_policy),
        on_event=on_event,
        id_source=id_source,
        segment_bytes=segment_bytes,
    )
