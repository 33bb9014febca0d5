"""llm-d inference-scheduler-style weighted scorers.

Each scorer maps a candidate to [0, 1] (higher is better); the pick is the max of
the weighted sum. Scorers and default weights follow llm-d's precise-prefix-cache
profile: prefix-cache (matched fraction of the request's blocks) x3, queue (min-max
normalised count of waiting requests, fewer is better) x2, kv-cache utilisation (free fraction
of the instance's KV budget) x2. Decode: queue (running requests) and kv utilisation.
"""

from __future__ import annotations

import numpy as np

from kvpool.scheduler.cluster import ClusterState, Decision, RouteRequest
from kvpool.scheduler.policy_base import Policy, explain, prefill_candidates


def _minmax_low_is_good(x: np.ndarray) -> np.ndarray:
    lo, hi = float(x.min()), float(x.max())
    if hi - lo <= 0:
        return np.ones_like(x, dtype=np.float64)
    return (hi - x) / (hi - lo)


class LlmdWeightedPolicy(Policy):
    name = "llm-d"

    def __init__(self, prefix_weight: float = 3.0, queue_weight: float = 2.0, kv_weight: float = 2.0) -> None:
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_weight = kv_weight

    def decide(self, req: RouteRequest, state: ClusterState) -> Decision:
        cands, kind = prefill_candidates(state)
        lens = state.prefix_lengths(req.hashes)
        n = max(1, len(req.hashes))
        prefix = np.minimum(lens[cands], n) / n
        queue = _minmax_low_is_good(state.outstanding_requests[cands].astype(np.float64))
        budget = float(max(1, state.spec.decode_kv_capacity_tokens))
        kv_free = 1.0 - np.minimum(state.outstanding_tokens[cands] / budget, 1.0)
        score = self.prefix_weight * prefix + self.queue_weight * queue + self.kv_weight * kv_free
        p = int(cands[int(np.argmax(score))])
        dec = state.decode_arr
        d_score = self.queue_weight * _minmax_low_is_good(state.decode_active[dec].astype(np.float64)) + (
            self.kv_weight * (1.0 - np.minimum(state.decode_context_tokens[dec] / budget, 1.0))
        )
        d = int(dec[int(np.argmax(d_score))])
        return explain(state, req, p, kind, d, lens, reason=f"llm-d: score {float(score.max()):.2f}")
