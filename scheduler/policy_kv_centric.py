"""KV-centric placement (Mooncake's Conductor, FAST'25 section 5).

The decode instance is the one with the lowest predicted TPOT. For every prefill
instance, predict TTFT = queue + fetch-or-recompute of the part of the best prefix it
does not hold (from the pool or a peer, behind their NIC queues) + prefill of the
missed tokens + the whole prefix's KV to that decode instance, all from the cost model
(``ClusterState.plan_ttft_vector``). Then:

* prefix affinity balanced against load: among the instances within ``affinity_slack``
  (10%) of the best predicted TTFT, take the one holding the longest local prefix, so a
  prefix stays where it lives instead of being copied into -- and evicting other
  prefixes from -- another instance's cache; with capacities smaller than the reused
  working set this keeps the caches partitioned (docs/scheduler.md, "The regime");
* prediction-based early rejection (``reject``): if even the best TTFT or TPOT misses
  the request's SLO, reject now rather than waste prefill on a request that would fail
  (reported apart: rejected requests and their input tokens);
* hot-block replication: blocks hit at least ``hot_threshold`` times are listed in the
  decision to be (re)placed in the global pool.
"""

from __future__ import annotations

import numpy as np

from kvpool.scheduler.cluster import ClusterState, Decision, RouteRequest
from kvpool.scheduler.policy_base import Policy, prefill_candidates


class KvCentricPolicy(Policy):
    name = "kv-centric"

    def __init__(
        self,
        hot_threshold: int = 4,
        max_tracked_blocks: int = 200_000,
        reject: bool = True,
        affinity_slack: float = 0.1,
    ) -> None:
        self.hot_threshold = hot_threshold
        self.affinity_slack = affinity_slack
        self.max_tracked_blocks = max_tracked_blocks
        self.reject = reject
        self._hits: dict[bytes, int] = {}  # insertion-ordered: the oldest-seen counts go first

    def decide(self, req: RouteRequest, state: ClusterState) -> Decision:
        cands, kind = prefill_candidates(state)
        lens = state.prefix_lengths(req.hashes)
        if kind == "instance":
            tpot = state.predicted_tpot_ms(req, state.decode_slice)
            j = int(np.argmin(tpot))
            d, best_tpot = int(state.decode_arr[j]), float(tpot[j])
            ttft, reach = state.plan_ttft_vector(req, state.prefill_slice, lens, d)
        else:  # no prefill instances: prefill on the decode node that would also decode
            plans = [state.plan_prefill(req, int(m), lens, int(m)) for m in cands]
            ttft = np.array([pl.ttft_ms for pl in plans])
            reach = np.array([pl.hit_blocks for pl in plans])
        i = int(np.argmin(ttft))
        if self.affinity_slack > 0:
            # keep a prefix where it already lives when that costs little now: a duplicate on
            # another instance would evict other prefixes there (the caches stay partitioned)
            # the longest local prefix within the slack, ties to the lower TTFT (TTFTs are < 1e12 ms)
            key = np.where(ttft <= ttft[i] * (1.0 + self.affinity_slack), lens[cands] * 1e12 - ttft, -np.inf)
            i = int(np.argmax(key))
        p, best_ttft, hit = int(cands[i]), float(ttft[i]), int(reach[i])
        if kind != "instance":
            d, best_tpot = p, float(state.predicted_tpot_ms(req, np.array([p]))[0])
        if self.reject and best_ttft > req.slo.ttft_ms:
            return Decision.reject(
                f"predicted TTFT {best_ttft:.0f} ms > SLO {req.slo.ttft_ms:.0f} ms", best_ttft, best_tpot
            )
        if self.reject and best_tpot > req.slo.tpot_ms:
            return Decision.reject(
                f"predicted TPOT {best_tpot:.1f} ms > SLO {req.slo.tpot_ms:.1f} ms", best_ttft, best_tpot
            )
        hot = self._count_hits(req.hashes[:hit])
        return Decision(kind, p, d, hit, best_ttft, best_tpot, False, f"kv-centric: ttft {best_ttft:.0f} ms", hot)

    def _count_hits(self, hashes: tuple[bytes, ...] | list[bytes]) -> tuple[bytes, ...]:
        hits = self._hits
        hot: list[bytes] = []
        threshold = self.hot_threshold
        for h in hashes:
            c = hits.get(h, 0) + 1
            hits[h] = c
            if c == threshold:
                hot.append(h)
        if len(hits) > self.max_tracked_blocks:  # bounded: forget the oldest-seen half
            for h in list(hits)[: len(hits) // 2]:
                del hits[h]
        return tuple(hot)
