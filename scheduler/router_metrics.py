"""Prometheus metrics of the router, read from ``RouterCore.stats()`` at scrape time (the
router's own counters: one set of numbers), plus the HTTP endpoint's request latency.

Served at ``GET /metrics`` on the router's HTTP listener (``--http-listen``, 127.0.0.1 by
default); the gRPC ``Route`` / ``Report`` latency comes from the shared interceptor
(``kvpool.rpc.metrics``). docs/metrics.md lists every metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpool.rpc.metrics import LATENCY_BUCKETS_S, scalar_families

Family = CounterMetricFamily | GaugeMetricFamily

#: HTTP paths that get their own label value; anything else is "other" (bounded labels)
HTTP_PATHS = ("/route", "/report", "/stats", "/metrics")

ROUTER_COUNTERS = (
    ("kvpool_router_decisions", "decisions", "Requests routed (placements decided, rejections included)."),
    ("kvpool_router_rejections", "rejections", "Requests rejected: no placement met the SLOs."),
    ("kvpool_router_events_applied", "events_applied", "Pool KV events applied to the router's block index."),
    ("kvpool_router_resyncs", "resyncs", "Resyncs from a pool snapshot after an event gap."),
)
ROUTER_GAUGES = (
    ("kvpool_router_indexed_blocks", "indexed_blocks", "Blocks in the router's index of the pool."),
    ("kvpool_router_event_seq", "last_seq", "Latest pool event seq applied."),
)


def families_from_stats(stats: Mapping[str, Any]) -> Iterator[Family]:
    info = GaugeMetricFamily("kvpool_router_info", "The router's policy (value 1).", labels=("policy",))
    info.add_metric((str(stats.get("policy", "")),), 1.0)
    yield info
    yield from scalar_families(stats, ROUTER_COUNTERS, ROUTER_GAUGES)
    yield GaugeMetricFamily(
        "kvpool_router_instances", "Instances the router places on.", value=len(stats.get("instances") or [])
    )


class RouterCollector(Collector):
    def __init__(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Family]:
        yield from families_from_stats(self._stats())


class HttpMetrics:
    """``kvpool_http_request_duration_seconds{path, code}`` of the router's HTTP endpoint."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "kvpool_http_request_duration_seconds",
            "Wall time of a router HTTP request, by path and status code.",
            ("path", "code"),
            registry=registry,
            buckets=LATENCY_BUCKETS_S,
        )

    def observe(self, path: str, status: int, seconds: float) -> None:
        label = path if path in HTTP_PATHS else "other"
        self.duration.labels(label, str(status)).observe(seconds)
