"""The stats -> Prometheus mapping (no daemon): names follow the conventions (counters end
in _total, units in the name), labels are bounded, a missing stats key is simply absent, and
every metric the Grafana dashboard in docs/ queries is one the exporters produce."""

from __future__ import annotations

import json
import re
from typing import Any

from conftest import REPO_ROOT
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kvpool.daemon import metrics as node_metrics
from kvpool.directory import metrics as directory_metrics
from kvpool.rpc.metrics import RpcMetrics
from kvpool.scheduler import router_metrics

TIER = {"capacity_bytes": 10, "used_bytes": 4, "blocks": 2, "hits": 3, "misses": 1, "bytes_in": 8, "bytes_out": 6,
        "evictions": 5, "checksum_failures": 1, "demotions": 2, "promotions": 1, "queued_blocks": 7}  # fmt: skip
STATS: dict[str, Any] = {
    "node_id": "n1", "hash_scheme": "kvpool-h1", "lookup_calls": 2, "lookup_missed_blocks": 3,
    "lookup_missed_tokens": 48, "read_calls": 1, "read_hit_blocks": 2, "read_missed_blocks": 0,
    "read_hit_tokens": 32, "puts": 4, "put_bytes": 400, "skipped_present": 1, "removed": 1,
    "expired_leases": 0, "reclaimed_puts": 0, "leases_active": 1, "pending_puts": 0,
    "namespaces_total": 1, "namespaces_max": 8, "last_event_seq": 9,
    "gc_frozen_objects": 100, "gc_full_collections": 2, "gc_full_pause_seconds_last": 0.01,
    "gc_full_pause_seconds_max": 0.02, "gc_whole_passes": 1, "gc_whole_pass_seconds_last": 0.2,
    "lookup_hit_blocks_by_tier": {"host": 2, "disk": 1}, "lookup_hit_tokens_by_tier": {"host": 32, "disk": 16},
    "tiers": {"host": TIER, "disk": {"enabled": True, **TIER}, "device": {"enabled": False, "fault": ""}},
}  # fmt: skip


class _Fixed(Collector):
    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> Any:
        return iter(self._families)


def samples(*collectors: Collector, observe: bool = False) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    if observe:
        RpcMetrics(registry, "pool").duration.labels("pool", "Lookup", "OK").observe(0.001)
        router_metrics.HttpMetrics(registry).observe("/route", 200, 0.002)
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_node_stats_map_to_counters_and_gauges_by_tier() -> None:
    m = samples(_Fixed(list(node_metrics.families_from_stats(STATS))))
    assert m[("kvpool_put_blocks_total", ())] == 4
    assert m[("kvpool_lookup_hit_blocks_total", (("tier", "disk"),))] == 1
    assert m[("kvpool_lookup_hit_blocks_total", (("tier", "device"),))] == 0  # every tier always present
    assert m[("kvpool_tier_evicted_blocks_total", (("tier", "disk"),))] == 5
    assert m[("kvpool_tier_queue_blocks", (("tier", "host"),))] == 7
    assert not any(("tier", "device") in labels for name, labels in m if name.startswith("kvpool_tier_"))
    for name, _ in m:  # Prometheus conventions: snake case, kvpool_ prefix
        assert re.fullmatch(r"kvpool_[a-z0-9_]+", name), name


def test_a_host_only_store_reports_its_top_level_keys_as_the_host_tier() -> None:
    host_only = {k: v for k, v in STATS.items() if k != "tiers"} | {"capacity_bytes": 99, "evictions": 3}
    m = samples(_Fixed(list(node_metrics.families_from_stats(host_only))))
    assert m[("kvpool_tier_capacity_bytes", (("tier", "host"),))] == 99
    assert m[("kvpool_tier_evicted_blocks_total", (("tier", "host"),))] == 3


def test_a_missing_key_is_absent_not_zero() -> None:
    m = samples(_Fixed(list(node_metrics.families_from_stats({"node_id": "n"}))))
    assert ("kvpool_put_blocks_total", ()) not in m


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    directory = {"epoch": 1, "blocks": 2, "namespaces": 1, "leases_active": 0, "deferred_removes": 0, "lookups": 1,
                 "lookup_blocks": 2, "lookup_hits": 1, "read_locates": 0, "registrations": 1, "resyncs": 0,
                 "nodes_expired": 0, "events": 3, "lookup_hit_blocks_by_tier": {"host": 1},
                 "nodes": [{"node_id": "a", "blocks": 2, "capacity_bytes": 1, "used_bytes": 1}]}  # fmt: skip
    router = {"policy": "kv-centric", "instances": ["p0"], "indexed_blocks": 1, "events_applied": 1, "resyncs": 0,
              "last_seq": 1, "decisions": 2, "rejections": 0}  # fmt: skip
    m = samples(
        _Fixed(list(node_metrics.families_from_stats(STATS))),
        _Fixed(list(directory_metrics.families_from_summary(directory, is_leader=True))),
        _Fixed(list(router_metrics.families_from_stats(router))),
        observe=True,
    )
    exported = {name for name, _ in m}
    dashboard = json.loads((REPO_ROOT / "docs" / "grafana-kvpool.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\bkvpool_[a-z0-9_]+", target["expr"])
    }
    assert queried and queried <= exported, sorted(queried - exported)
