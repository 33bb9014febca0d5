"""SGLang-router-style cache-aware placement (sgl-router ``cache_aware`` policy).

The router does not see the engines' caches: it keeps an *approximate* tree of the
prefixes it sent to each worker (here: a bounded LRU of block hashes per instance in
its own ``LocationIndex``), and decides:

1. if the load is imbalanced (``max - min > balance_abs_threshold`` and
   ``max > balance_rel_threshold * min``), go to the least-loaded worker;
2. else, if the best worker's match rate (matched blocks / request blocks) exceeds
   ``cache_threshold``, go to it;
3. else go to the worker with the smallest tree (most room for a new prefix).

Load is what sgl-router measures: outstanding requests per worker (queued or
running), blind to their length. Defaults follow sgl-router: cache_threshold 0.5,
balance_abs_threshold 32 requests, balance_rel_threshold 1.0001 -- scaled here to
an abs threshold of 4 requests because a prefill instance holds a handful of
requests at a time, not a decode batch.
"""

from __future__ import annotations

import numpy as np

from kvpool.scheduler.cluster import ClusterState, Decision, RouteRequest
from kvpool.scheduler.index import LocationIndex, LruCache
from kvpool.scheduler.policy_base import Policy, explain, least_loaded_decode, prefill_candidates


class SglangCacheAwarePolicy(Policy):
    name = "sglang"

    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 4,
        balance_rel_threshold: float = 1.0001,
        max_tree_blocks: int = 10_000,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_blocks = max_tree_blocks
        self._tree: LocationIndex | None = None
        self._lru: dict[int, LruCache] = {}

    def _ensure(self, state: ClusterState) -> LocationIndex:
        if self._tree is None:
            tree = LocationIndex(state.spec.num_instances)
            self._tree = tree
            for m in range(state.spec.num_instances):
                self._lru[m] = LruCache(self.max_tree_blocks, on_leave=lambda h, m=m: tree.remove(h, m))
        return self._tree

    def decide(self, req: RouteRequest, state: ClusterState) -> Decision:
        tree = self._ensure(state)
        cands, kind = prefill_candidates(state)
        load = state.outstanding_requests[cands]
        lo, hi = float(load.min()), float(load.max())
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            p = int(cands[int(np.argmin(load))])
            reason = "sglang: imbalanced -> least outstanding"
            return explain(state, req, p, kind, least_loaded_decode(state), reason=reason)
        approx, _ = tree.prefix_lengths(req.hashes)
        best_i = int(np.argmax(approx[cands]))
        rate = float(approx[cands][best_i]) / max(1, len(req.hashes))
        if rate > self.cache_threshold:
            p = int(cands[best_i])
            reason = f"sglang: match {rate:.2f}"
        else:
            sizes = np.array([len(self._lru[int(m)]) for m in cands])
            p = int(cands[int(np.argmin(sizes))])
            reason = "sglang: low match -> smallest tree"
        return explain(state, req, p, kind, least_loaded_decode(state), reason=reason)

    def observe(self, req: RouteRequest, decision: Decision, state: ClusterState) -> None:
        if decision.rejected or self._tree is None:
            return
        m = decision.prefill_member
        lru, tree = self._lru[m], self._tree
        for h in req.hashes:
            lru.insert(h)
            tree.add(h, m)
