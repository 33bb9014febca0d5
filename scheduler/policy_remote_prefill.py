"""Selective remote prefill ("Prefill-as-a-Service").

The decode instance is chosen first (the one holding the longest usable prefix among
those whose predicted TPOT meets the SLO). If the request's *uncached* length there
exceeds a threshold, it is prefilled on the remote prefill cluster and its KV sent
back over the bandwidth-limited link; otherwise it prefills on the decode node
itself (short or well-cached prompts: no transfer, a small stall of the running
decodes).

The threshold comes from a throughput model: over a sliding window of recent
requests, the longest uncached prompts go remote until the remote path carries its
share of the prefill demand, remote / (remote + local) capacity, where remote =
min(link tokens/s, remote prefill tokens/s) and local = the decode nodes' spare
prefill capacity -- and never more than ``target_utilization`` of the remote path.
It is then adapted multiplicatively: raised when the
link backlog or the remote queues exceed their limits (send fewer), lowered when
the decode nodes' local prefill queues do (send more).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from kvpool.scheduler.cluster import ClusterState, Decision, RouteRequest
from kvpool.scheduler.policy_base import Policy, explain


class RemotePrefillPolicy(Policy):
    name = "remote-prefill"

    def __init__(
        self,
        initial_threshold_tokens: int = 4096,
        auto: bool = True,
        target_utilization: float = 0.8,
        local_prefill_fraction: float = 0.5,
        window: int = 512,
        recompute_every: int = 64,
        adapt_factor: float = 1.25,
        saturation_ms: float = 2000.0,
    ) -> None:
        self.threshold_tokens = float(initial_threshold_tokens)
        self.auto = auto
        self.target_utilization = target_utilization
        self.local_prefill_fraction = local_prefill_fraction
        self.recompute_every = recompute_every
        self.adapt_factor = adapt_factor
        self.saturation_ms = saturation_ms
        self._window: deque[tuple[float, int]] = deque(maxlen=window)
        self._scale = 1.0
        self._base = float(initial_threshold_tokens)
        self._seen = 0
        self._last_uncached = 0

    def decide(self, req: RouteRequest, state: ClusterState) -> Decision:
        dec = state.decode_arr
        lens = state.prefix_lengths(req.hashes)
        reach = state.reachable_blocks(lens)[dec]
        tpot = state.predicted_tpot_ms(req, dec)
        ok = tpot <= req.slo.tpot_ms
        pool = np.flatnonzero(ok) if ok.any() else np.arange(len(dec))
        order = np.lexsort((state.queues_ms(dec[pool]), tpot[pool], -reach[pool]))
        k = int(pool[order[0]])
        d = int(dec[k])
        uncached = state.plan_prefill(req, d, lens, d).new_tokens  # the shared hit arithmetic, not a copy
        self._last_uncached = uncached
        remote = state.remote_arr
        if len(remote) and uncached > self.threshold_tokens:
            ttft = [state.plan_prefill(req, int(r), lens, d).ttft_ms for r in remote]
            r = int(remote[int(np.argmin(ttft))])
            return explain(
                state,
                req,
                r,
                "remote",
                d,
                lens,
                reason=f"uncached {uncached} > threshold {self.threshold_tokens:.0f}: remote",
            )
        return explain(
            state,
            req,
            d,
            "decode_local",
            d,
            lens,
            reason=f"uncached {uncached} <= threshold {self.threshold_tokens:.0f}: local",
        )

    def observe(self, req: RouteRequest, decision: Decision, state: ClusterState) -> None:
        self._window.append((state.now_ms, self._last_uncached))
        self._seen += 1
        if not self.auto or self._seen % self.recompute_every:
            return
        self._base = self._model_threshold(state)
        backlog = state.link_free_ms(state.now_ms) - state.now_ms  # the transfer on the link + those placed
        remote_q = float(state.queues_ms(state.remote_arr).min()) if len(state.remote_arr) else 0.0
        local_q = float(state.queues_ms(state.decode_arr).mean())
        if backlog > self.saturation_ms or remote_q > self.saturation_ms:
            self._scale *= self.adapt_factor
        elif local_q > self.saturation_ms:
            self._scale /= self.adapt_factor
        self._scale = min(max(self._scale, 1 / 64), 64.0)
        self.threshold_tokens = self._base * self._scale

    def _model_threshold(self, state: ClusterState) -> float:
        """The uncached length above which the remote path gets its fair share of the prefill work.

        Capacities in prefill tokens per ms: remote = min(link, remote instances);
        local = decode instances x ``local_prefill_fraction`` (the share of a decode
        node's time it may spend prefilling). The remote path takes the longest
        prompts until it carries remote / (remote + local) of the window's demand,
        never more than ``target_utilization`` of its capacity.
        """
        if len(self._window) < 2 or not len(state.remote_arr):
            return self._base
        span_ms = max(1.0, self._window[-1][0] - self._window[0][0])
        spec, cost = state.spec, state.cost
        lengths = np.sort(np.array([u for _, u in self._window], dtype=np.float64))[::-1]
        mean_len = max(1.0, float(lengths.mean()))
        # a hybrid model's fixed linear state crosses the link with each request's KV
        bytes_per_token = cost.kv_bytes_per_token + cost.state_bytes_per_request / mean_len
        link_tokens_per_ms = spec.remote_link_bandwidth_bytes_per_s / 1000.0 / bytes_per_token
        remote_one = mean_len / float(state.role_cost["remote"].prefill_ms(mean_len, 0))
        local_one = mean_len / float(state.role_cost["decode"].prefill_ms(mean_len, 0))
        remote_cap = min(link_tokens_per_ms, len(state.remote_arr) * remote_one)
        local_cap = len(state.decode_arr) * self.local_prefill_fraction * local_one
        demand = np.cumsum(lengths) / span_ms  # remote demand if the top-k lengths go remote
        target = min(demand[-1] * remote_cap / (remote_cap + local_cap), self.target_utilization * remote_cap)
        k = int(np.searchsorted(demand, target, side="right"))
        if k >= len(lengths):
            return 0.0
        return float(lengths[k])
