"""Prefix-only placement: the instance with the longest local cached prefix (max hit),
ties to the shortest queue. Load-blind, so hot prefixes pile onto one instance."""

from __future__ import annotations

import numpy as np

from kvpool.scheduler.cluster import ClusterState, Decision, RouteRequest
from kvpool.scheduler.policy_base import Policy, explain, least_loaded_decode, prefill_candidates


class PrefixPolicy(Policy):
    name = "prefix-only"

    def decide(self, req: RouteRequest, state: ClusterState) -> Decision:
        cands, kind = prefill_candidates(state)
        lens = state.prefix_lengths(req.hashes)
        order = np.lexsort((cands, state.queues_ms(cands), -lens[cands]))
        p = int(cands[order[0]])
        return explain(state, req, p, kind, least_loaded_decode(state), lens, reason=f"prefix {int(lens[p])} blocks")
