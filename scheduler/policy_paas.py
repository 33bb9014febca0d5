"""Prefill-as-a-Service over a local PD cluster *and* a remote prefill cluster: one policy.

The decode instance is the one with the lowest predicted TPOT. The prefill target is the
candidate with the lowest predicted TTFT among

* the local prefill instances (``plan_ttft_vector``: queue, fetch-vs-recompute of the
  prefix from peers / the pool, prefill on the local hardware, KV to the decode node), and
* the remote prefill instances (``plan_prefill``: their queue, their own cached prefix,
  prefill on the remote hardware, then the *whole* prefix's KV the decode node lacks over
  the FIFO cross-cluster link, behind its backlog),

so the offload threshold is not a constant: a request goes remote when the remote
side's faster compute saves more than the link costs *now* -- long uncached prompts
while the local queues are long and the link is idle; nothing while the link has a
backlog or the local caches hold the prefix. ``remote_margin`` (a fraction) asks the
remote side to be that much better, a hedge against the link's latency variance.
When the cluster has no local prefill instances, the decode node itself is the local
candidate (decode-local prefill).

The link's backlog is what ``ClusterState`` knows of it: in the simulator, the transfer on the
link and every remote transfer placed but not yet sent (``link_pending``); the router daemon
(``router_core``) tracks neither yet, so live routing prices the link as idle.
"""

from __future__ import annotations

import numpy as np

from kvpool.scheduler.cluster import ClusterState, Decision, RouteRequest
from kvpool.scheduler.policy_base import Policy


class PaasPolicy(Policy):
    name = "paas"

    def __init__(self, remote_margin: float = 0.1) -> None:
        self.remote_margin = remote_margin
        self.remote_picks = 0

    def decide(self, req: RouteRequest, state: ClusterState) -> Decision:
        dec = state.decode_arr
        tpot = state.predicted_tpot_ms(req, dec)
        j = int(np.argmin(tpot))
        d, best_tpot = int(dec[j]), float(tpot[j])
        lens = state.prefix_lengths(req.hashes)
        if state.spec.num_prefill:
            ttft, reach = state.plan_ttft_vector(req, state.prefill_arr, lens, d)
            i = int(np.argmin(ttft))
            kind, p, best, hit = "instance", int(state.prefill_arr[i]), float(ttft[i]), int(reach[i])
        else:
            plan = state.plan_prefill(req, d, lens, d)
            kind, p, best, hit = "decode_local", d, plan.ttft_ms, plan.hit_blocks
        for r in state.remote_arr:
            plan = state.plan_prefill(req, int(r), lens, d)
            if plan.ttft_ms * (1.0 + self.remote_margin) < best:
                kind, p, best, hit = "remote", int(r), plan.ttft_ms, plan.hit_blocks
        if kind == "remote":
            self.remote_picks += 1
        return Decision(kind, p, d, hit, best, best_tpot, False, f"paas: {kind} ttft {best:.0f} ms")  # type: ignore[arg-type]
