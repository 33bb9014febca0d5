"""Round-robin placement: balances request counts, blind to length, load and cache."""

from __future__ import annotations

from kvpool.scheduler.cluster import ClusterState, Decision, RouteRequest
from kvpool.scheduler.policy_base import Policy, explain, prefill_candidates


class RoundRobinPolicy(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next_prefill = 0
        self._next_decode = 0

    def decide(self, req: RouteRequest, state: ClusterState) -> Decision:
        cands, kind = prefill_candidates(state)
        p = int(cands[self._next_prefill % len(cands)])
        d = int(state.decode_arr[self._next_decode % len(state.decode_arr)])
        return explain(state, req, p, kind, d, reason="round-robin")

    def observe(self, req: RouteRequest, decision: Decision, state: ClusterState) -> None:
        self._next_prefill += 1
        self._next_decode += 1
