"""Discrete-event trace replay of a policy over a cluster.

Time comes from the cost model only (never the wall clock), so a fixed seed gives
identical results. Requests are taken in arrival order; before each arrival the
simulator applies every event due by then, updates the shared ``ClusterState``, asks
the policy, and executes the decision with the same arithmetic the policies predict
with (``ClusterState.plan_prefill``) plus what a prediction cannot see: which local
blocks only sit in DRAM (a PCIe copy) and waiting for decode KV room.

Guarantees (each checked by a test in tests/property/test_sched_sim_invariants.py or
tests/unit/test_sched_sim.py):

* a block enters a tier only when its bytes have arrived: the prefill member at the
  end of the prefill, the decode member when the KV transfer ends, the pool when the
  write-through after the prefill ends;
* the index and the caches agree at every step (``check_consistency``): an index bit
  is set before the cache insert that may evict it, so eviction always clears it;
* a prefill on a decode node slows the decodes *running while it runs*: an event at
  its start stalls them ("stall" mode: by the whole prefill; "chunked": by the chunks'
  compute), and a decode admitted during it starts late by the part still to come;
* the decode node receives the whole prefix's KV (not only the new tokens), minus the
  prefix it already holds.

Modelled simplifications (documented in docs/scheduler.md): each prefill instance
runs one prefill at a time, FIFO; a request's TPOT is fixed when it joins a decode
batch (from the batch it joins) plus the stalls it later suffers; NICs are FIFO
reservations in decision order (full duplex), the pool's own NICs are not modelled,
and the remote-prefill link is one FIFO.
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpool.core.errors import InternalError, InvalidArgument
from kvpool.scheduler.cluster import ClusterSpec, ClusterState, Decision, RouteRequest, Slo
from kvpool.scheduler.cost_model import CostModel, transfer_ms
from kvpool.scheduler.index import LruCache, PolicyCache, TieredCache, make_cache
from kvpool.scheduler.policy_base import Policy
from kvpool.scheduler.trace import TraceHasher, TraceRequest

_INSERT, _PREFILL_DONE, _DECODE_JOIN, _DECODE_DONE, _PREFILL_START, _SEND = 0, 1, 2, 3, 4, 5


@dataclass
class RequestOutcome:
    """Per-request results, as parallel arrays (index = trace order)."""

    n: int
    arrival_ms: np.ndarray = field(init=False)
    ttft_ms: np.ndarray = field(init=False)
    tpot_ms: np.ndarray = field(init=False)
    finish_ms: np.ndarray = field(init=False)
    prefill_start_ms: np.ndarray = field(init=False)
    send_start_ms: np.ndarray = field(init=False)  # the KV transfer to the decode node began (NaN: none)
    rejected: np.ndarray = field(init=False)
    blocks: np.ndarray = field(init=False)
    hit_local: np.ndarray = field(init=False)
    hit_pool: np.ndarray = field(init=False)
    hit_peer: np.ndarray = field(init=False)
    new_tokens: np.ndarray = field(init=False)
    input_tokens: np.ndarray = field(init=False)
    bytes_moved: np.ndarray = field(init=False)
    max_pause_ms: np.ndarray = field(init=False)  # the longest extra gap between two output tokens (local prefill)
    prefill_kind: np.ndarray = field(init=False)  # 0 instance, 1 decode-local, 2 remote, -1 rejected
    decision_ns: np.ndarray = field(init=False)
    decided: np.ndarray = field(init=False)  # how many times the request was decided (must be 1)

    def __post_init__(self) -> None:
        n = self.n
        for name in (
            "arrival_ms",
            "ttft_ms",
            "tpot_ms",
            "finish_ms",
            "prefill_start_ms",
            "send_start_ms",
            "bytes_moved",
            "max_pause_ms",
        ):
            setattr(self, name, np.full(n, np.nan))
        for name in (
            "blocks",
            "hit_local",
            "hit_pool",
            "hit_peer",
            "new_tokens",
            "input_tokens",
            "decision_ns",
            "decided",
        ):
            setattr(self, name, np.zeros(n, dtype=np.int64))
        self.rejected = np.zeros(n, dtype=bool)
        self.prefill_kind = np.full(n, -1, dtype=np.int64)


_KIND_CODE = {"instance": 0, "decode_local": 1, "remote": 2}


class Simulator:
    def __init__(
        self,
        spec: ClusterSpec,
        cost: CostModel,
        policy: Policy,
        slo: Slo,
        *,
        speedup: float = 1.0,
        hasher: TraceHasher | None = None,
        progress: Callable[[int, int], None] | None = None,
        check_every: int = 0,
        role_costs: Mapping[str, CostModel] | None = None,
    ) -> None:
        if not speedup > 0:
            raise InvalidArgument(f"speedup must be positive, got {speedup}")
        self.spec, self.cost, self.policy, self.slo, self.speedup = spec, cost, policy, slo, speedup
        self.hasher = hasher or TraceHasher()
        self.progress = progress
        self.check_every = check_every  # > 0: check_consistency after every N-th request (tests)
        self.state = ClusterState(spec, cost, role_costs)
        index = self.state.index
        self.local: list[TieredCache] = [
            TieredCache(spec.hbm_blocks, spec.dram_blocks, lambda h, m=m: index.remove(h, m), spec.eviction)
            for m in range(spec.num_instances)
        ]
        pool_member = spec.pool_member
        self.pool = make_cache(spec.pool_blocks, spec.eviction, on_leave=lambda h: index.remove(h, pool_member))
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        # per decode member: running [finish_ms, kv_tokens, request index, decode start ms], and a FIFO of waiters
        self._running: dict[int, list[list[float]]] = {int(m): [] for m in self.state.decode_arr}
        self._waiting: dict[int, deque[int]] = {int(m): deque() for m in self.state.decode_arr}
        # per decode member: the local prefill running now, (start ms, end ms, stall it adds to a decode)
        self._window: dict[int, tuple[float, float, float]] = {int(m): (0.0, 0.0, 0.0) for m in self.state.decode_arr}
        self.replicated_blocks = 0
        self.last_time_ms = 0.0

    # ---- events -------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def _advance(self, now: float) -> None:
        if now < self.last_time_ms:
            raise InternalError(f"simulated time ran backwards: {now} < {self.last_time_ms}")
        ev = self._events
        while ev and ev[0][0] <= now:
            t, _, kind, payload = heapq.heappop(ev)
            if t < self.last_time_ms:
                raise InternalError(f"simulated time ran backwards: event at {t} < {self.last_time_ms}")
            self.last_time_ms = t
            self.state.now_ms = t
            if kind == _INSERT:
                members, hashes = payload
                self._insert(members, hashes)
            elif kind == _PREFILL_DONE:
                member, tokens = payload
                self.state.outstanding_tokens[member] -= tokens
                self.state.outstanding_requests[member] -= 1
            elif kind == _PREFILL_START:
                d, end, stall, pause = payload
                for a in self._running[d]:  # every decode running now waits for (or shares with) the prefill
                    a[0] += stall
                    a[4] = max(a[4], pause)
                self._window[d] = (t, end, stall)
            elif kind == _SEND:
                self._send(t, payload)
            elif kind == _DECODE_JOIN:
                d, idx = payload
                self._waiting[d].append(idx)
                self._admit(d, t)
            else:
                d, entry = payload
                if entry[0] > t:  # stalled by a local prefill after it was scheduled: finish later
                    self._push(entry[0], _DECODE_DONE, payload)
                    continue
                self._retire(d, entry)
                self._admit(d, t)
        if now != float("inf"):
            self.last_time_ms = now
            self.state.now_ms = now

    def _push_pool_write(self, writer_ms: float, put_bytes: int, hashes: Sequence[bytes]) -> None:
        spec = self.spec
        arrive = writer_ms + float(transfer_ms(put_bytes, spec.pool_bandwidth_bytes_per_s, spec.link_latency_ms))
        self._push(arrive, _INSERT, ((spec.pool_member,), hashes))

    def _send(self, t: float, payload: tuple[Any, ...]) -> None:
        """A prefill finished at ``t``: its KV crosses to the decode node when the sender's egress and
        the receiver's ingress are free (or the remote link is), then the request joins the batch.

        A NIC is taken only from the moment a transfer is ready: reserving it at decision time until
        the (seconds later) end of the transfer would block the earlier, idle part for every other
        transfer (a 10 s prefill held its decode node's ingress for 10 s)."""
        i, m, dm, to_bytes, pending, put_bytes, hashes = payload
        state, spec = self.state, self.spec
        start = first = t
        if pending is not None:  # a remote prefill's KV: (ready ms, ms on the link), placed -> on the link
            state.link_pending.remove(pending)
            start = max(t, state.link_busy_until_ms)
            first = start + pending[1]
            state.link_busy_until_ms = first
            if spec.pool_blocks != 0:
                self._push_pool_write(first, put_bytes, hashes)
        elif to_bytes:
            if spec.nic_contention:
                start = max(t, float(state.nic_out_busy_until_ms[m]), float(state.nic_in_busy_until_ms[dm]))
            first = start + float(transfer_ms(to_bytes, spec.pool_bandwidth_bytes_per_s, spec.link_latency_ms))
            state.nic_out_busy_until_ms[m] = max(state.nic_out_busy_until_ms[m], first)
            state.nic_in_busy_until_ms[dm] = max(state.nic_in_busy_until_ms[dm], first)
        self.out.send_start_ms[i] = start
        self._push(first, _INSERT, ((dm,), hashes))  # the decode node holds the KV once it arrives
        self._push(first, _DECODE_JOIN, (dm, i))

    def _admit(self, d: int, t: float) -> None:
        """Start waiting requests on decode node ``d`` (FIFO) while KV room and batch slots allow."""
        state, spec, out = self.state, self.spec, self.out
        waiting = self._waiting[d]
        while waiting:
            i = waiting[0]
            kv_tokens = int(out.input_tokens[i] + self._out_tokens[i])
            ctx = int(state.decode_context_tokens[d])
            active = int(state.decode_active[d])
            fits = ctx + kv_tokens <= spec.decode_kv_capacity_tokens and active < spec.max_decode_batch
            if not fits and active > 0:
                return
            waiting.popleft()  # an idle node always admits (a request larger than the node still runs)
            n_out = int(self._out_tokens[i])
            tpot = float(
                self.state.role_cost["decode"].decode_step_ms(active + 1, ctx + int(out.input_tokens[i]) + n_out // 2)
            )
            w_start, w_end, w_stall = self._window[d]
            delay = w_stall * (w_end - t) / (w_end - w_start) if w_start <= t < w_end else 0.0
            entry = [t + delay + max(0, n_out - 1) * tpot, float(kv_tokens), float(i), t, 0.0]
            self._running[d].append(entry)
            state.decode_active[d] += 1
            state.decode_context_tokens[d] += kv_tokens
            out.ttft_ms[i] = t - out.arrival_ms[i]
            self._push(entry[0], _DECODE_DONE, (d, entry))

    def _retire(self, d: int, a: list[float]) -> None:
        finish, kv_tokens, idx, start, pause = a
        i = int(idx)
        out = self.out
        out.max_pause_ms[i] = pause
        out.finish_ms[i] = finish
        out.tpot_ms[i] = (finish - start) / max(1, self._out_tokens[i] - 1)
        self.state.decode_active[d] -= 1
        self.state.decode_context_tokens[d] -= int(kv_tokens)
        self._running[d].remove(a)

    def _insert(self, members: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Blocks whose bytes have arrived at ``members`` (instances or the pool member).

        The index bit is set *before* the cache insert: an insert can evict (even the block
        itself, at capacity 0), and the eviction's callback must find the bit to clear it, so
        a bit is never left behind for a block the cache no longer holds.
        """
        index = self.state.index
        pool_member = self.spec.pool_member
        for m in members:
            if m == pool_member:
                if self.spec.pool_blocks == 0:
                    continue
                cache: TieredCache | LruCache | PolicyCache = self.pool
            else:
                cache = self.local[m]
            hot = cache.hbm.recency() if isinstance(cache, TieredCache) else None
            for h in hashes:
                if hot is not None and h in hot:  # fast path: already in HBM, its bit is set
                    hot.move_to_end(h)
                    continue
                index.add(h, m)
                cache.insert(h)

    def check_consistency(self) -> None:
        """Every index bit names a member whose cache holds the block, and vice versa."""
        index, pool_member = self.state.index, self.spec.pool_member
        held: dict[bytes, int] = {}
        tiers: list[tuple[int, list[bytes]]] = [(m, c.keys()) for m, c in enumerate(self.local)]
        tiers.append((pool_member, self.pool.keys()))
        for m, blocks in tiers:
            for h in blocks:
                held[h] = held.get(h, 0) | (1 << m)
        for h, mask in index.items():
            if held.get(h, 0) != mask:
                raise InternalError(f"index says {mask:b} holds {h.hex()}, the caches say {held.get(h, 0):b}")
        if len(held) != len(index):
            raise InternalError(f"{len(held)} blocks cached but {len(index)} indexed")

    # ---- the run ------------------------------------------------------------------
    def run(self, trace: Sequence[TraceRequest]) -> RequestOutcome:
        n = len(trace)
        self.out = out = RequestOutcome(n)
        self._out_tokens = np.array([r.output_tokens for r in trace], dtype=np.int64)
        state = self.state
        step = max(1, n // 100)
        for i, r in enumerate(trace):
            now = r.arrival_ms / self.speedup
            self._advance(now)
            hashes = self.hasher.hashes(r.block_ids)
            req = RouteRequest(hashes, r.input_tokens, r.output_tokens, self.slo, i)
            t0 = time.perf_counter_ns()
            decision = self.policy.decide(req, state)
            out.decision_ns[i] = time.perf_counter_ns() - t0  # reported only; never feeds simulated time
            out.arrival_ms[i] = now
            out.blocks[i] = len(hashes)
            out.input_tokens[i] = r.input_tokens
            out.decided[i] += 1
            if decision.rejected:
                out.rejected[i] = True
            else:
                self._execute(i, req, decision, now)
            self.policy.observe(req, decision, state)
            if self.check_every and i % self.check_every == 0:
                self.check_consistency()
            if self.progress is not None and (i % step == 0 or i == n - 1):
                self.progress(i + 1, n)
        self._advance(float("inf"))  # every remaining event (decode completions may re-queue after stalls)
        if self.check_every:
            self.check_consistency()
        return out

    def _check(self, d: Decision) -> None:
        spec = self.spec
        role = spec.role(d.prefill_member) if 0 <= d.prefill_member < spec.num_instances else "none"
        want = {"instance": "prefill", "decode_local": "decode", "remote": "remote"}[d.prefill_kind]
        if role != want or spec.role(d.decode_member) != "decode":
            raise InternalError(f"policy {self.policy.name} returned an invalid placement {d}")
        if d.prefill_kind == "decode_local" and d.prefill_member != d.decode_member:
            raise InternalError(f"policy {self.policy.name}: a decode-local prefill must decode on the same node")

    def _execute(self, i: int, req: RouteRequest, d: Decision, now: float) -> None:
        self._check(d)
        state, spec, out = self.state, self.spec, self.out
        m, dm = d.prefill_member, d.decode_member
        lens = state.prefix_lengths(req.hashes)
        local_len = min(int(lens[m]), len(req.hashes))
        cache = self.local[m]
        dram_only = cache.dram_only(req.hashes[:local_len])
        plan = state.plan_prefill(req, m, lens, dm, dram_only)
        for h in req.hashes[:local_len]:  # a hit refreshes recency where it was found
            cache.insert(h)
        if plan.pool_blocks:
            for h in req.hashes[local_len : local_len + plan.pool_blocks]:
                self.pool.touch(h)
        bb = state.block_bytes
        moved = plan.hit_blocks * bb - local_len * bb + plan.to_decode_bytes
        if plan.fetch_source >= 0:  # the fetch holds the receiver's NIC and a serving peer's
            state.nic_in_busy_until_ms[m] = max(state.nic_in_busy_until_ms[m], plan.fetch_end_ms)
            state.nic_out_busy_until_ms[plan.fetch_source] = max(
                state.nic_out_busy_until_ms[plan.fetch_source], plan.fetch_end_ms
            )
        done, first = plan.done_ms, plan.first_token_ms
        state.busy_until_ms[m] = done
        state.outstanding_tokens[m] += plan.new_tokens
        state.outstanding_requests[m] += 1
        self._push(done, _PREFILL_DONE, (m, plan.new_tokens))
        self._push(done, _INSERT, ((m,), req.hashes))  # computed or fetched: on the prefill member now
        kind = d.prefill_kind
        put_bytes = 0
        if spec.pool_blocks != 0:
            # new blocks are written to the pool after the prefill (from the decode node after a remote
            # prefill: the pool is local); they are in the pool once their bytes are
            missing = sum(1 for h in req.hashes if h not in self.pool)  # write-through: the pool gets the prefix
            self.replicated_blocks += sum(1 for h in d.replicate_hashes if h not in self.pool)
            put_bytes = missing * bb
            moved += put_bytes
            if kind != "remote":
                self._push_pool_write(done, put_bytes, req.hashes)
        if kind == "decode_local":
            pieces = -(-plan.new_tokens // spec.chunk_tokens) if spec.decode_prefill_mode == "chunked" else 1
            self._push(plan.prefill_start_ms, _PREFILL_START, (dm, done, plan.stall_ms, plan.stall_ms / pieces))
            self._push(first, _DECODE_JOIN, (dm, i))
        else:
            # the KV goes to the decode node once the prefill is done: its NICs (or the remote link) are
            # taken then, in the order transfers become ready, not reserved from now on; a remote one is
            # pending on it until then (``ClusterState.link_pending``)
            pending = None
            if kind == "remote":
                link = spec.remote_link_bandwidth_bytes_per_s, spec.remote_link_latency_ms
                pending = (done, float(transfer_ms(plan.to_decode_bytes, *link)))
                bisect.insort(state.link_pending, pending)
            self._push(done, _SEND, (i, m, dm, plan.to_decode_bytes, pending, put_bytes, req.hashes))
        out.prefill_start_ms[i] = plan.prefill_start_ms
        out.hit_local[i] = plan.local_blocks
        out.hit_pool[i] = plan.pool_blocks
        out.hit_peer[i] = plan.peer_blocks
        out.new_tokens[i] = plan.new_tokens
        out.bytes_moved[i] = moved
        out.prefill_kind[i] = _KIND_CODE[kind]
