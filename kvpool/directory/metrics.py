"""Prometheus metrics of a directory instance, read from ``DirectoryState.summary()`` at
scrape time (the directory's own counters: one set of numbers, docs/metrics.md).

Per-node series carry a ``node`` label: the members of a cluster are few (they are bounded
by the node registry) and "which node is full" is the question an operator asks. There are
no per-namespace or per-block labels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpool.rpc.metrics import scalar_families

Family = CounterMetricFamily | GaugeMetricFamily

#: (metric name without _total, key in DirectoryState.counters, help)
DIRECTORY_COUNTERS = (
    ("kvpool_directory_lookup_calls", "lookups", "Prefix lookups answered (reads' locates not counted)."),
    ("kvpool_directory_lookup_blocks", "lookup_blocks", "Blocks named in those lookups."),
    ("kvpool_directory_lookup_hit_blocks_all", "lookup_hits", "Leading blocks those lookups found on some node."),
    ("kvpool_directory_read_locates", "read_locates", "Locates sent by reads (for_read)."),
    ("kvpool_directory_registrations", "registrations", "Node registrations (start-up and re-registration)."),
    ("kvpool_directory_resyncs", "resyncs", "Nodes told to resync (a gap in their event stream)."),
    ("kvpool_directory_nodes_expired", "nodes_expired", "Nodes dropped: heartbeat timeout or etcd lease gone."),
    ("kvpool_directory_events", "events", "KV event batches applied."),
)

#: (metric name, key in the summary, help)
DIRECTORY_GAUGES = (
    ("kvpool_directory_blocks", "blocks", "Distinct blocks some node holds."),
    ("kvpool_directory_namespaces", "namespaces", "Namespaces the directory knows."),
    ("kvpool_directory_leases_active", "leases_active", "Directory leases held now."),
    ("kvpool_directory_deferred_removes", "deferred_removes", "Removes waiting for a lease to end (a queue)."),
    ("kvpool_directory_epoch", "epoch", "The directory's epoch (grows on every restart)."),
)


def families_from_summary(summary: Mapping[str, Any], is_leader: bool) -> Iterator[Family]:
    """Metric families of one ``DirectoryState.summary()`` (pure: tested without a server)."""
    yield GaugeMetricFamily("kvpool_directory_leader", "1 if this instance leads now.", value=1.0 if is_leader else 0.0)
    yield from scalar_families(summary, DIRECTORY_COUNTERS, DIRECTORY_GAUGES)
    hits = CounterMetricFamily(
        "kvpool_directory_lookup_hit_blocks", "Lookup hits by the best tier among the holders.", labels=("tier",)
    )
    for tier, count in sorted((summary.get("lookup_hit_blocks_by_tier") or {}).items()):
        hits.add_metric((str(tier),), float(count))
    yield hits
    nodes = list(summary.get("nodes") or [])
    yield GaugeMetricFamily("kvpool_directory_nodes", "Nodes registered (alive or not yet expired).", value=len(nodes))
    per_node = {
        "kvpool_directory_node_blocks": ("blocks", "Blocks the directory records on the node."),
        "kvpool_directory_node_capacity_bytes": ("capacity_bytes", "Host capacity the node reported."),
        "kvpool_directory_node_used_bytes": ("used_bytes", "Host bytes used the node reported."),
        "kvpool_directory_node_confirmed": ("confirmed", "1 once the node heartbeated since this instance started."),
        "kvpool_directory_node_event_seq": ("last_seq", "Last event seq the directory applied from the node."),
    }
    for name, (key, text) in per_node.items():
        family = GaugeMetricFamily(name, text, labels=("node",))
        for node in nodes:
            family.add_metric((str(node.get("node_id", "")),), float(node.get(key, 0) or 0))
        yield family


class DirectoryCollector(Collector):
    def __init__(self, summary: Callable[[], Mapping[str, Any]], is_leader: Callable[[], bool]) -> None:
        self._summary = summary
        self._is_leader = is_leader

    def collect(self) -> Iterator[Family]:
        yield from families_from_summary(self._summary(), self._is_leader())
