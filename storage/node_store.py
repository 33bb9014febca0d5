"""Builds a node's store from its configuration: the composition point of the tiers.

The daemon calls ``build_node_store`` and uses only the ``HostStore`` interface
(lookup, lease, release, put_start, put_commit, put_abort, remove, pin, unpin, sweep,
summary, snapshot_keys), so tiering can grow behind it.
"""

from __future__ import annotations

import numpy as np

from kvpool.core.clock import Clock
from kvpool.core.config import DaemonConfig
from kvpool.storage.eviction import make_policy
from kvpool.storage.host_store import EventSink, HostStore


def build_node_store(config: DaemonConfig, buffer: np.ndarray, clock: Clock, on_event: EventSink | None) -> HostStore:
    return HostStore(buffer, config.store, clock, policy=make_policy(config.tiers.host_policy), on_event=on_event)
