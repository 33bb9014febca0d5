"""KV-centric placement (Mooncake's Conductor, FAST'25 section 5).

The decode instance is the one with the lowest predicted TPOT. For every prefill
instance, predict TTFT = queue + fetch-or-recompute of the part of the best prefix it
does not hold (from the pool or a peer, behind their NIC queues) + prefill of the
missed tokens + the whole prefix's KV to that decode instance, all from the cost model
(``ClusterState.plan_ttft_vector``). Then:

* prefix affinity balanced against load: the pick minimises predicted TTFT -
  ``occupancy_weight`` (3.0) x the prefill time its hit saves the instance. TTFT alone is
  greedy: recomputing a prefix on an idle instance may win this request a few ms but
  holds that instance for the whole recompute, and every request queued behind it
  waits that long; a hit costs the cluster less. With capacities smaller than the
  reused working set this sends a prefix back where it lives (the caches stay
  partitioned instead of every instance caching every prefix) unless the holder's queue
  costs more than the recompute (docs/scheduler.md, "The regime"). A ms of occupancy
  delays each request queued behind it by a ms, so the weight is roughly how many wait;
  3.0 came from a sweep (0, 0.5, 1, 3) on the conversation trace, the trace it is
  measured on;
* optionally (``affinity_slack`` > 0, off by default): among the instances within that
  fraction of the best score, the one holding the longest local prefix;
* prediction-based early rejection (``reject``): if even the best TTFT or TPOT misses
  the request's SLO, reject now rather than waste prefill on a request that would fail
  (reported apart: rejected requests and their input tokens);
* hot-block replication: blocks hit at least ``hot_threshold`` times are listed in the
  decision to be (re)placed in the global pool.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvpool.scheduler import kv_centric_kernel
from kvpool.scheduler.cluster import ClusterState, Decision, PrefillKind, RouteRequest
from kvpool.scheduler.cost_model import CostModel
from kvpool.scheduler.policy_base import Policy, prefill_candidates


class KvCentricPolicy(Policy):
    name = "kv-centric"

    def __init__(
        self,
        hot_threshold: int = 4,
        max_tracked_blocks: int = 200_000,
        reject: bool = True,
        affinity_slack: float = 0.0,
        occupancy_weight: float = 3.0,
    ) -> None:
        self.hot_threshold = hot_threshold
        self.affinity_slack = affinity_slack
        self.occupancy_weight = occupancy_weight
        self.max_tracked_blocks = max_tracked_blocks
        self.reject = reject
        self._hits: dict[bytes, int] = {}  # insertion-ordered: the oldest-seen counts go first
        self._kernel: Callable[..., tuple[int, int, int, float, float]] | None = None
        self._kernel_state: ClusterState | None = None  # the state the buffers below were made for
        self._prm = np.zeros(0)
        self._lens = np.zeros(0, dtype=np.int64)

    def decide(self, req: RouteRequest, state: ClusterState) -> Decision:
        """The compiled path (``kv_centric_kernel``) when numba is there and the cluster has prefill
        instances; otherwise, or with ``affinity_slack``, ``decide_reference`` (same decisions).
        Not reentrant (one prefix-length buffer per policy): the router decides under its lock."""
        if self.affinity_slack > 0 or state.spec.num_prefill == 0:
            return self.decide_reference(req, state)
        if self._kernel_state is not state:
            self._kernel = kv_centric_kernel.load()
            if self._kernel is None:
                return self.decide_reference(req, state)
            self._kernel_state = state
            self._prm = kv_centric_kernel.static_params(state)
            self._lens = np.zeros(state.index.num_members, dtype=np.int64)
        kernel, lens, index = self._kernel, self._lens, state.index
        assert kernel is not None
        written = index.prefix_lengths_into(req.hashes, lens)
        p, d, hit, best_ttft, best_tpot = kernel(
            state.f_rows,
            state.i_rows,
            lens,
            self._prm,
            state.now_ms,
            req.input_tokens,
            req.output_tokens,
            len(req.hashes),
            self.occupancy_weight,
        )
        index.reset_lengths(lens, written)
        return self._finish(req, "instance", p, d, hit, best_ttft, best_tpot)

    def decide_reference(self, req: RouteRequest, state: ClusterState) -> Decision:
        """The numpy path: every candidate priced by ``plan_ttft_vector`` (or ``plan_prefill``)."""
        cands, kind = prefill_candidates(state)
        lens = state.prefix_lengths(req.hashes)
        if kind == "instance":
            tpot = state.predicted_tpot_ms(req, state.decode_slice)
            j = int(tpot.argmin())
            d, best_tpot = int(state.decode_arr[j]), float(tpot[j])
            ttft, reach = state.plan_ttft_vector(req, state.prefill_slice, lens, d)
        else:  # no prefill instances: prefill on the decode node that would also decode
            plans = [state.plan_prefill(req, int(m), lens, int(m)) for m in cands]
            ttft = np.array([pl.ttft_ms for pl in plans])
            reach = np.array([pl.hit_blocks for pl in plans])
        score = ttft
        if self.occupancy_weight > 0:
            role = "prefill" if kind == "instance" else "decode"
            score = ttft - self.occupancy_weight * self._saved_ms(req, state.role_cost[role], state, reach)
        i = int(score.argmin())
        if self.affinity_slack > 0:
            i = self._affinity(i, score, lens[cands])
        p, best_ttft, hit = int(cands[i]), float(ttft[i]), int(reach[i])
        if kind != "instance":
            d, best_tpot = p, float(state.predicted_tpot_ms(req, np.array([p]))[0])
        return self._finish(req, kind, p, d, hit, best_ttft, best_tpot)

    def _finish(
        self, req: RouteRequest, kind: PrefillKind, p: int, d: int, hit: int, best_ttft: float, best_tpot: float
    ) -> Decision:
        """Early rejection, hot-block counting and the Decision, shared by both paths."""
        if self.reject and best_ttft > req.slo.ttft_ms:
            return Decision.reject(
                f"predicted TTFT {best_ttft:.0f} ms > SLO {req.slo.ttft_ms:.0f} ms", best_ttft, best_tpot
            )
        if self.reject and best_tpot > req.slo.tpot_ms:
            return Decision.reject(
                f"predicted TPOT {best_tpot:.1f} ms > SLO {req.slo.tpot_ms:.1f} ms", best_ttft, best_tpot
            )
        hot = self._count_hits(req.hashes, hit)
        return Decision(kind, p, d, hit, best_ttft, best_tpot, False, f"kv-centric: ttft {best_ttft:.0f} ms", hot)

    @staticmethod
    def _saved_ms(req: RouteRequest, cost: CostModel, state: ClusterState, hit_blocks: np.ndarray) -> np.ndarray:
        """Prefill time ``hit_blocks`` cached blocks save on each candidate (``prefill_ms(inp, 0) -
        prefill_ms(inp - c, c)`` = c * (a + b/2 * c), inlined): the occupancy a hit spares the
        instance, i.e. the wait it spares every request queued behind this one there."""
        cached = np.minimum(hit_blocks * state.spec.block_tokens, req.input_tokens - 1)
        return cached * (0.5 * cost.prefill_ms_per_token_pair * cached + cost.prefill_ms_per_token)

    def _affinity(self, i: int, ttft: np.ndarray, local: np.ndarray) -> int:
        """Keep a prefix where it already lives when that costs little now: among the candidates
        within ``affinity_slack`` of the best TTFT (``i``), the longest local prefix, ties to the lower
        TTFT -- a duplicate on another instance would evict other prefixes there, so the caches stay
        partitioned. Only holders (local > 0) can beat ``i``; they are usually a few."""
        holders = local.nonzero()[0]
        if not holders.size:
            return i
        limit = float(ttft[i]) * (1.0 + self.affinity_slack)
        best, best_len, best_ttft = i, int(local[i]), float(ttft[i])
        for j in holders.tolist():
            t, n = float(ttft[j]), int(local[j])
            if t <= limit and (n > best_len or (n == best_len and t < best_ttft)):
                best, best_len, best_ttft = j, n, t
        return best

    def _count_hits(self, hashes: tuple[bytes, ...] | list[bytes], hit: int) -> tuple[bytes, ...]:
        """Count a hit on each of the first ``hit`` blocks; the blocks reaching ``hot_threshold`` now.
        No slice, no list unless a block turns hot: fewer allocations, fewer garbage collections."""
        hits = self._hits
        hot: list[bytes] | None = None
        threshold = self.hot_threshold
        for i in range(hit):
            h = hashes[i]
            c = hits.get(h, 0) + 1
            hits[h] = c
            if c == threshold:
                if hot is None:
                    hot = []
                hot.append(h)
        if len(hits) > self.max_tracked_blocks:  # bounded: forget the oldest-seen half
            for h in list(hits)[: len(hits) // 2]:
                del hits[h]
        return () if hot is None else tuple(hot)
