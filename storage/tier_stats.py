"""The tiered store's counters of the host tier and the ``summary()`` it builds from them
and the tiers' own summaries (what ``kvpool inspect`` and the metrics read)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class HostTierStats:
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0  # committed puts + promotions into the host arena
    bytes_out: int = 0  # bytes of blocks leased to readers
    promotions: int = 0  # blocks promoted into host from a lower/other tier (by a lease or a pin)
    lower_hits: int = 0  # host misses that a lease served after promoting them
    promotion_failures: int = 0  # promotions that found no host room
    demotions: int = 0  # host evictions handed to the disk queue
    demotion_drops: int = 0  # evictions that could not be demoted (queue full / tier down)
    admission_skips: int = 0  # evictions kept off disk by second-hit admission
    checksum_failures: int = 0  # host bytes that failed their checksum on the way down


def tiered_summary(
    host_summary: dict[str, int], h: HostTierStats, disk: dict[str, Any], device: dict[str, Any]
) -> dict[str, Any]:
    """The host store's keys, with hits and misses counting every tier, plus ``tiers``
    (host from ``h`` and the host store, ``disk`` and ``device`` as their tiers report)."""
    out: dict[str, Any] = dict(host_summary)
    host = {
        "capacity_bytes": out["capacity_bytes"],
        "used_bytes": out["used_bytes"],
        "blocks": out["blocks"],
        "hits": h.hits,
        "misses": h.misses,
        "bytes_in": h.bytes_in + out["put_bytes"],
        "bytes_out": h.bytes_out,
        "promotions": h.promotions,
        "lower_hits": h.lower_hits,
        "promotion_failures": h.promotion_failures,
        "demotions": h.demotions,
        "demotion_drops": h.demotion_drops,
        "admission_skips": h.admission_skips,
        "evictions": out["evictions"],
        "checksum_failures": out["checksum_failures"] + h.checksum_failures,
    }
    tiers: dict[str, Any] = {"host": host, "disk": disk, "device": device}
    out["tiers"] = tiers
    # every tier's failed checks: host (at commit, on eviction, reported by readers),
    # disk and device (on their reads); each such block was dropped
    out["checksum_failures"] = sum(int(t.get("checksum_failures", 0)) for t in tiers.values())
    out["hits"] = host["hits"] + host["lower_hits"]  # blocks served through leases, any tier
    out["misses"] = host["misses"] - host["lower_hits"]  # asked for and not served by any tier
    return out
