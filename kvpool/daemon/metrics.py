"""Prometheus metrics of a pool node, read from the node's own counters at scrape time.

Nothing here counts anything: ``NodeCollector.collect`` turns one ``store.summary()`` and
one ``TrafficCounters.summary()`` (``kvpool.daemon.counters``) into metric families, so
``/metrics`` says exactly what ``kvpool inspect stats --json`` says (docs/metrics.md lists
each metric and the stats key it comes from). Call latency comes from the gRPC interceptor
(``kvpool.rpc.metrics.RpcMetrics``) registered in the same registry.

Labels are bounded: ``tier`` is host / device / disk; there are no per-namespace or
per-block labels (a namespace digest is a tenant's identity: docs/security.md), so a
scrape is the same size whatever the traffic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpool.daemon.counters import TIERS
from kvpool.rpc.metrics import scalar_families

if TYPE_CHECKING:
    from kvpool.daemon.node import PoolNode

Family = CounterMetricFamily | GaugeMetricFamily

#: node-wide counters: (metric name without _total, stats key, help)
NODE_COUNTERS = (
    ("kvpool_lookup_calls", "lookup_calls", "Lookup calls answered."),
    (
        "kvpool_lookup_missed_blocks",
        "lookup_missed_blocks",
        "Looked-up blocks from the first miss on.",
    ),
    ("kvpool_lookup_missed_tokens", "lookup_missed_tokens", "Tokens of those missed blocks."),
    ("kvpool_read_calls", "read_calls", "Reads (leases) answered, local and from peers."),
    ("kvpool_read_hit_blocks", "read_hit_blocks", "Blocks leased to readers."),
    ("kvpool_read_missed_blocks", "read_missed_blocks", "Blocks readers asked for and did not get."),
    ("kvpool_read_hit_tokens", "read_hit_tokens", "Tokens of the blocks leased to readers."),
    ("kvpool_put_blocks", "puts", "Blocks committed by puts."),
    ("kvpool_put_bytes", "put_bytes", "Bytes committed by puts."),
    ("kvpool_put_skipped_present_blocks", "skipped_present", "Blocks a put named that were already stored."),
    (
        "kvpool_put_commit_checked_blocks",
        "commit_checked_blocks",
        "Blocks checksummed at put commit (a data-plane write's all, a same-host put's sample).",
    ),
    ("kvpool_removed_blocks", "removed", "Blocks removed on request (Remove, clear)."),
    ("kvpool_leases_expired", "expired_leases", "Read leases dropped at their TTL without a release."),
    ("kvpool_puts_reclaimed", "reclaimed_puts", "Puts reclaimed at their TTL (writer presumed dead)."),
    ("kvpool_local_connections_admitted", "local_connections_served", "Same-host socket connections admitted."),
    (
        "kvpool_local_connections_refused",
        "local_connections_refused",
        "Same-host socket connections refused (busy, unknown token, stopping).",
    ),
    ("kvpool_gc_full_collections", "gc_full_collections", "CPython's own full garbage collections (--gc-freeze)."),
    ("kvpool_gc_whole_passes", "gc_whole_passes", "Collections over frozen objects too (--gc-full-interval-s)."),
)

#: node-wide gauges: (metric name, stats key, help)
NODE_GAUGES = (
    ("kvpool_leases_active", "leases_active", "Read leases held now."),
    ("kvpool_puts_pending", "pending_puts", "Puts between start and commit now."),
    ("kvpool_namespaces", "namespaces_total", "Namespaces registered now."),
    ("kvpool_namespaces_max", "namespaces_max", "Most namespaces registered at once (--max-namespaces)."),
    ("kvpool_event_seq", "last_event_seq", "Sequence number of the node's latest KV event."),
    ("kvpool_local_connections", "local_connections_open", "Same-host socket connections open now (--local-calls)."),
    ("kvpool_gc_frozen_objects", "gc_frozen_objects", "Objects kept out of full garbage collections (--gc-freeze)."),
    ("kvpool_gc_full_pause_last_seconds", "gc_full_pause_seconds_last", "The latest full collection's pause."),
    ("kvpool_gc_full_pause_max_seconds", "gc_full_pause_seconds_max", "The longest full collection's pause."),
    ("kvpool_gc_whole_pass_last_seconds", "gc_whole_pass_seconds_last", "The latest whole pass's length."),
)

#: per-tier counters, from each tier's summary: (metric name without _total, key, help)
TIER_COUNTERS = (
    ("kvpool_tier_read_hit_blocks", "hits", "Blocks a read found in this tier."),
    ("kvpool_tier_read_missed_blocks", "misses", "Blocks a read looked for in this tier and did not find."),
    ("kvpool_tier_written_bytes", "bytes_in", "Bytes written into this tier."),
    ("kvpool_tier_read_bytes", "bytes_out", "Bytes read out of this tier."),
    ("kvpool_tier_evicted_blocks", "evictions", "Blocks this tier evicted by its policy (demoted or dropped)."),
    ("kvpool_tier_checksum_failures", "checksum_failures", "Blocks that failed their checksum here and were dropped."),
    ("kvpool_tier_demoted_blocks", "demotions", "Blocks this tier handed to the tier below on eviction."),
    ("kvpool_tier_promoted_blocks", "promotions", "Blocks copied up into this tier on a hit below."),
)

#: per-tier gauges: (metric name, key, help)
TIER_GAUGES = (
    ("kvpool_tier_capacity_bytes", "capacity_bytes", "Capacity of the tier."),
    ("kvpool_tier_used_bytes", "used_bytes", "Bytes the tier holds now."),
    ("kvpool_tier_blocks", "blocks", "Blocks the tier holds now."),
    ("kvpool_tier_queue_blocks", "queued_blocks", "Blocks waiting in the tier's write-behind queue."),
)


def tier_summaries(summary: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Each enabled tier's stats. A host-only store has no ``tiers`` table: its top-level
    keys are the host tier's."""
    tiers = summary.get("tiers")
    if not isinstance(tiers, Mapping):
        return {"host": summary}
    return {name: t for name, t in tiers.items() if isinstance(t, Mapping) and t.get("enabled", True)}


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


def families_from_stats(stats: Mapping[str, Any]) -> Iterator[Family]:
    """The metric families of one node's merged stats (``Stats`` JSON). Pure, so that the
    mapping is tested without a daemon and a stats key that goes missing is simply absent."""
    info = GaugeMetricFamily("kvpool_node_info", "The node's identity (value 1).", labels=("node_id", "hash_scheme"))
    info.add_metric((str(stats.get("node_id", "")), str(stats.get("hash_scheme", ""))), 1.0)
    yield info
    yield from scalar_families(stats, NODE_COUNTERS, NODE_GAUGES)
    for name, key, text in (
        (
            "kvpool_lookup_hit_blocks",
            "lookup_hit_blocks_by_tier",
            "Leading blocks lookups found, by tier.",
        ),
        ("kvpool_lookup_hit_tokens", "lookup_hit_tokens_by_tier", "Tokens of those blocks, by tier."),
    ):
        family = CounterMetricFamily(name, text, labels=("tier",))
        by_tier = stats.get(key) or {}
        for tier in TIERS:
            family.add_metric((tier,), float(by_tier.get(tier, 0)))
        yield family
    yield from _tier_families(tier_summaries(stats))


def _tier_families(tiers: Mapping[str, Mapping[str, Any]]) -> Iterable[Family]:
    for name, key, text in TIER_COUNTERS:
        counter = CounterMetricFamily(name, text, labels=("tier",))
        for tier, values in tiers.items():
            value = _number(values.get(key))
            if value is not None:
                counter.add_metric((tier,), value)
        yield counter
    for name, key, text in TIER_GAUGES:
        gauge = GaugeMetricFamily(name, text, labels=("tier",))
        for tier, values in tiers.items():
            value = _number(values.get(key))
            if value is not None:
                gauge.add_metric((tier,), value)
        yield gauge


class NodeCollector(Collector):
    """Reads a ``PoolNode``'s counters each scrape (one store lock, one counters lock)."""

    def __init__(self, node: PoolNode, extra: Callable[[], Mapping[str, Any]] | None = None) -> None:
        """``extra``: more counters read at each scrape (the process's: the same-host socket's,
        the garbage collector's)."""
        self._node = node
        self._extra = extra

    def collect(self) -> Iterator[Family]:
        node = self._node
        stats: dict[str, Any] = dict(node.store.summary())
        stats.update(node.counters.summary())
        stats["node_id"] = node.node_id
        stats["hash_scheme"] = _hash_scheme()
        stats["last_event_seq"] = node.events.last_seq
        stats["namespaces_total"] = len(node.namespaces())
        stats["namespaces_max"] = node.config.max_namespaces
        if self._extra is not None:
            stats.update(self._extra())
        yield from families_from_stats(stats)


def _hash_scheme() -> str:
    from kvpool.core.hashing import HASH_SCHEME

    return HASH_SCHEME
