"""Random placement: the floor every other policy must beat."""

from __future__ import annotations

import numpy as np

from kvpool.scheduler.cluster import ClusterState, Decision, RouteRequest
from kvpool.scheduler.policy_base import Policy, explain, prefill_candidates


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def decide(self, req: RouteRequest, state: ClusterState) -> Decision:
        cands, kind = prefill_candidates(state)
        p = int(cands[self.rng.integers(len(cands))])
        d = int(state.decode_arr[self.rng.integers(len(state.decode_arr))])
        return explain(state, req, p, kind, d, reason="random")
