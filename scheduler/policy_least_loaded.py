"""Least-loaded placement: shortest prefill queue, lightest decode instance; cache-blind."""

from __future__ import annotations

import numpy as np

from kvpool.scheduler.cluster import ClusterState, Decision, RouteRequest
from kvpool.scheduler.policy_base import Policy, explain, least_loaded_decode, prefill_candidates


class LeastLoadedPolicy(Policy):
    name = "least-loaded"

    def decide(self, req: RouteRequest, state: ClusterState) -> Decision:
        cands, kind = prefill_candidates(state)
        q = state.queues_ms(cands)
        p = int(cands[int(np.argmin(q))])
        return explain(state, req, p, kind, least_loaded_decode(state), reason="least-loaded")
