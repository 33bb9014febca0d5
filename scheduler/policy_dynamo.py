"""NVIDIA Dynamo KV-router-style cost placement.

Dynamo scores each worker with ``logit = overlap_score_weight * potential_prefill_blocks
+ potential_decode_blocks`` and takes the lowest (temperature 0): prefill blocks are
the request's blocks *not* already cached on the worker, decode blocks the blocks the
worker is already busy with (here: its outstanding prefill tokens in blocks). The
decode instance is chosen by the same formula with no overlap (its active KV blocks).
Default ``overlap_score_weight`` is 1.0 as in Dynamo.
"""

from __future__ import annotations

import numpy as np

from kvpool.scheduler.cluster import ClusterState, Decision, RouteRequest
from kvpool.scheduler.policy_base import Policy, explain, prefill_candidates


class DynamoCostPolicy(Policy):
    name = "dynamo"

    def __init__(self, overlap_score_weight: float = 1.0) -> None:
        self.overlap_score_weight = overlap_score_weight

    def decide(self, req: RouteRequest, state: ClusterState) -> Decision:
        cands, kind = prefill_candidates(state)
        bt = state.spec.block_tokens
        lens = state.prefix_lengths(req.hashes)
        n = len(req.hashes)
        prefill_blocks = n - np.minimum(lens[cands], n)
        active_blocks = state.outstanding_tokens[cands] / bt
        logit = self.overlap_score_weight * prefill_blocks + active_blocks
        p = int(cands[int(np.argmin(logit))])
        dec = state.decode_arr
        d_logit = state.decode_context_tokens[dec] / bt + n
        d = int(dec[int(np.argmin(d_logit))])
        return explain(state, req, p, kind, d, lens, reason=f"dynamo: logit {float(logit.min()):.1f}")
