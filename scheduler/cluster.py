"""The cluster a scheduler places requests on: its description, its live state and the
physics of one placement (what a request would hit, move and wait for).

Why one module for both: the router (fed by worker reports and pool events) and the
simulator (fed by its own event loop) hold the *same* ``ClusterState``, and the
policies and the simulator's execution use the *same* ``plan_prefill`` arithmetic, so
a prediction and its outcome can only differ by what changed in between.

Members of the location index: prefill instances ``0..P-1``, decode instances
``P..P+D-1``, remote prefill instances ``P+D..P+D+R-1``, then the global pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvpool.core.errors import InvalidArgument
from kvpool.scheduler.cost_model import CostModel, transfer_ms
from kvpool.scheduler.index import LocationIndex

PrefillKind = Literal["instance", "decode_local", "remote"]
#: ``plan_ttft_vector`` prices up to this many prefix holders one by one, more all at once.
_SPARSE_HOLDERS = 8


@dataclass(frozen=True)
class ClusterSpec:
    """Shape and limits of a PD-disaggregated cluster (capacities in 512-token blocks)."""

    num_prefill: int = 8
    num_decode: int = 4
    num_remote_prefill: int = 0
    hbm_blocks: int = 2_000  # per instance, local HBM KV cache beyond the running batch
    dram_blocks: int = 8_000  # per instance, local pinned DRAM cache
    pool_blocks: int | None = 97_656  # global pool; 97,656 blocks = 50M tokens; None = unbounded
    decode_kv_capacity_tokens: int = 1_200_000  # KV a decode instance can hold for running requests
    max_decode_batch: int = 128
    pool_bandwidth_bytes_per_s: float = 100e9  # per instance RDMA (4 x 200 Gbps, Mooncake's A800 nodes)
    pcie_bandwidth_bytes_per_s: float = 100e9  # host DRAM -> HBM, 8 GPUs x ~12.5 GB/s effective
    link_latency_ms: float = 0.05
    remote_link_bandwidth_bytes_per_s: float = 12.5e9  # 100 Gbps to the remote prefill cluster
    remote_link_latency_ms: float = 5.0
    block_tokens: int = 512
    peer_fetch: bool = True  # an instance may read another instance's DRAM cache (Mooncake Store)
    eviction: str = "lru"  # of the pool and the DRAM tiers (HBM is LRU): any kvpool.storage.eviction policy
    # How a decode node runs a prefill it was given (co-located / decode-local prefill): "stall" runs it
    # whole between two decode iterations (every running decode waits for all of it); "chunked" splits it
    # into ``chunk_tokens`` pieces that ride along with the decode iterations (Sarathi-style): decodes are
    # slowed by the chunks' compute only, the prefill takes longer by the decode steps it interleaves.
    decode_prefill_mode: Literal["stall", "chunked"] = "stall"
    chunk_tokens: int = 2048
    # Every instance's NIC is a full-duplex FIFO (ingress, egress): fetches into an instance, reads served
    # by a peer and KV sent to a decode node queue on them. False: the contention-free network of before.
    nic_contention: bool = True

    def __post_init__(self) -> None:
        if self.num_decode <= 0:
            raise InvalidArgument(
                "the cluster has no decode instance: nothing could generate tokens",
                hint="set num_decode >= 1 (--decode)",
            )
        if self.num_prefill < 0 or self.num_remote_prefill < 0:
            raise InvalidArgument("instance counts must be >= 0")
        if self.decode_prefill_mode not in ("stall", "chunked"):
            raise InvalidArgument(f"decode_prefill_mode must be 'stall' or 'chunked', got {self.decode_prefill_mode!r}")
        if self.chunk_tokens <= 0:
            raise InvalidArgument("chunk_tokens must be positive")
        for name in ("hbm_blocks", "dram_blocks", "decode_kv_capacity_tokens", "max_decode_batch", "block_tokens"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"ClusterSpec.{name} must be >= 0")
        if self.pool_blocks is not None and self.pool_blocks < 0:
            raise InvalidArgument("pool_blocks must be >= 0 (or None for unbounded)")
        for name in ("pool_bandwidth_bytes_per_s", "pcie_bandwidth_bytes_per_s", "remote_link_bandwidth_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"ClusterSpec.{name} must be positive")
        from kvpool.storage.eviction import POLICIES

        if self.eviction not in POLICIES:
            raise InvalidArgument(
                f"eviction policy {self.eviction!r} is not known", hint=f"use one of {sorted(POLICIES)}"
            )

    @property
    def num_instances(self) -> int:
        return self.num_prefill + self.num_decode + self.num_remote_prefill

    @property
    def pool_member(self) -> int:
        return self.num_instances

    def role(self, member: int) -> str:
        if member < self.num_prefill:
            return "prefill"
        if member < self.num_prefill + self.num_decode:
            return "decode"
        if member < self.num_instances:
            return "remote"
        return "pool"


@dataclass(frozen=True)
class Slo:
    ttft_ms: float = 10_000.0
    tpot_ms: float = 100.0

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise InvalidArgument(f"SLOs must be positive, got ttft_ms={self.ttft_ms} tpot_ms={self.tpot_ms}")


@dataclass(frozen=True)
class RouteRequest:
    """What a policy sees of a request."""

    hashes: tuple[bytes, ...] | list[bytes]
    input_tokens: int
    output_tokens: int
    slo: Slo = field(default_factory=Slo)
    request_id: int = 0

    def cached_tokens(self, hit_blocks: int, block_tokens: int) -> int:
        """Prompt tokens a hit of ``hit_blocks`` saves: never the last one, whose logits
        the first output token needs, so it is always computed."""
        return min(hit_blocks * block_tokens, self.input_tokens - 1)


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request runs, what it is expected to hit and how long its first token takes."""

    prefill_kind: PrefillKind
    prefill_member: int  # an instance (prefill / decode node / remote prefill), -1 when rejected
    decode_member: int  # -1 when rejected
    expected_hit_blocks: int = 0
    expected_ttft_ms: float = 0.0
    expected_tpot_ms: float = 0.0
    rejected: bool = False
    reason: str = ""
    replicate_hashes: tuple[bytes, ...] = ()  # hot blocks to (re)place in the global pool

    @staticmethod
    def reject(reason: str, expected_ttft_ms: float = 0.0, expected_tpot_ms: float = 0.0) -> Decision:
        return Decision("instance", -1, -1, 0, expected_ttft_ms, expected_tpot_ms, True, reason)


@dataclass(frozen=True)
class PrefillPlan:
    """The arithmetic of prefilling one request on one member (times absolute, in ms)."""

    member: int
    local_blocks: int
    pool_blocks: int  # fetched from the global pool
    peer_blocks: int  # fetched from another instance's cache
    fetch_source: int  # the peer read from, the pool member, or -1 (nothing fetched)
    cached_tokens: int
    new_tokens: int
    queue_ms: float
    fetch_end_ms: float  # the fetched blocks have arrived (== decision time when nothing is fetched)
    prefill_start_ms: float
    prefill_ms: float  # how long the prefill occupies ``member`` (chunked: with the decode steps it interleaves)
    stall_ms: float  # what the prefill adds to each decode running on ``member`` (decode-local only)
    done_ms: float
    # the KV the decode instance lacks (the whole prefix minus what it already holds) + a hybrid model's
    # fixed linear state (``CostModel.state_bytes_per_request``)
    to_decode_bytes: int
    to_decode_start_ms: float
    first_token_ms: float
    ttft_ms: float

    @property
    def hit_blocks(self) -> int:
        return self.local_blocks + self.pool_blocks + self.peer_blocks


class ClusterState:
    """Live state: queues, decode load and block locations, at time ``now_ms``."""

    def __init__(self, spec: ClusterSpec, cost: CostModel, role_costs: Mapping[str, CostModel] | None = None) -> None:
        """``cost`` for every instance, or per role ("prefill", "decode", "remote") from ``role_costs``
        (heterogeneous hardware: a compute-dense prefill part, a bandwidth-rich decode part)."""
        self.spec = spec
        self.cost = cost
        self.role_cost: dict[str, CostModel] = {r: cost for r in ("prefill", "decode", "remote")}
        for role, c in (role_costs or {}).items():
            if role not in self.role_cost:
                raise InvalidArgument(f"unknown role {role!r} in role_costs", hint="prefill, decode or remote")
            if c.kv_bytes_per_token != cost.kv_bytes_per_token:
                raise InvalidArgument(
                    f"role {role} runs a model with {c.kv_bytes_per_token} KV bytes/token, "
                    f"not {cost.kv_bytes_per_token}",
                    hint="every instance must serve the same model for KV to move between them",
                )
            self.role_cost[role] = c
        self.now_ms = 0.0
        n = spec.num_instances
        # The per-member figures are rows of two matrices (views below, updated in place by everyone), so
        # a compiled decision (scheduler/kv_centric_kernel.py) takes the whole load in two arguments.
        self.f_rows = np.zeros((3, n + 1), dtype=np.float64)
        self.i_rows = np.zeros((4, n + 1), dtype=np.int64)
        self.busy_until_ms = self.f_rows[0, :n]  # prefill queue drains at (decode: local prefill)
        self.nic_in_busy_until_ms = self.f_rows[1]  # per member (the pool's entry unused)
        self.nic_out_busy_until_ms = self.f_rows[2]
        self.decode_active = self.i_rows[0, :n]  # running requests (decode members only)
        self.decode_context_tokens = self.i_rows[1, :n]  # their KV tokens
        self.outstanding_tokens = self.i_rows[2, :n]  # prefill tokens queued or running
        self.outstanding_requests = self.i_rows[3, :n]  # prefills queued or running
        self.link_busy_until_ms = 0.0  # the remote prefill link: the transfer on it ends then
        # (ready ms, ms on the link) of each remote prefill placed but not yet on the link (its prefill is
        # queued or running), sorted: the link is a FIFO in the order transfers become ready, so a plan
        # waits behind those ready before it. Without them the link looked idle while transfers queued
        # up behind the remote prefills, and paas kept offloading behind a slow link.
        self.link_pending: list[tuple[float, float]] = []
        self.index = LocationIndex(n + 1)
        self.block_bytes = cost.kv_bytes_per_token * spec.block_tokens
        self.prefill_arr = np.arange(spec.num_prefill)
        self.decode_arr = np.arange(spec.num_prefill, spec.num_prefill + spec.num_decode)
        self.remote_arr = np.arange(spec.num_prefill + spec.num_decode, n)
        self.prefill_slice = slice(0, spec.num_prefill)  # views of the per-member arrays, for hot paths
        self.decode_slice = slice(spec.num_prefill, spec.num_prefill + spec.num_decode)
        self._local_mask = (1 << (spec.num_prefill + spec.num_decode)) - 1
        self._ids = np.arange(n)

    def queue_ms(self, member: int) -> float:
        return max(0.0, float(self.busy_until_ms[member]) - self.now_ms)

    def queues_ms(self, members: np.ndarray) -> np.ndarray:
        return np.maximum(self.busy_until_ms[members] - self.now_ms, 0.0)

    def prefix_lengths(self, hashes: tuple[bytes, ...] | list[bytes]) -> np.ndarray:
        """Longest cached prefix (blocks) per member, pool last."""
        lens, _ = self.index.prefix_lengths(hashes)
        return lens

    def reachable_blocks(self, lens: np.ndarray) -> np.ndarray:
        """Per instance: the longest prefix it can use (own cache, or fetched from pool / peers)."""
        spec = self.spec
        reach = lens[: spec.num_instances].copy()
        local_n = spec.num_prefill + spec.num_decode
        if local_n:
            best = int(lens[spec.pool_member]) if spec.pool_blocks != 0 else 0
            if spec.peer_fetch:
                best = max(best, int(lens[:local_n].max()))
            reach[:local_n] = np.maximum(reach[:local_n], best)
        return reach

    def _fetch_source(self, lens: np.ndarray) -> tuple[int, int]:
        """(member to read missing blocks from, its prefix length): the pool when it holds at least
        as much as the best peer, else that peer; (-1, 0) when nothing is reachable."""
        spec = self.spec
        pool_len = int(lens[spec.pool_member]) if spec.pool_blocks != 0 else 0
        local_n = spec.num_prefill + spec.num_decode
        peer, peer_len = -1, 0
        if spec.peer_fetch and local_n:
            peer = int(lens[:local_n].argmax())
            peer_len = int(lens[peer])
        if pool_len > 0 and pool_len >= peer_len:
            return spec.pool_member, pool_len
        if peer_len > 0:
            return peer, peer_len
        return -1, 0

    def _nic_free_ms(self, busy: np.ndarray, member: Any) -> Any:
        if not self.spec.nic_contention:
            return self.now_ms
        return np.maximum(busy[member], self.now_ms)

    def plan_prefill(
        self,
        req: RouteRequest,
        member: int,
        lens: np.ndarray,
        decode_member: int,
        dram_only_blocks: int = 0,
    ) -> PrefillPlan:
        """Prefill ``req`` on ``member`` then decode on ``decode_member``: hits, moves, times.

        Missing prefix blocks are fetched (issued at decision time, so the fetch overlaps the
        queue) only when that finishes the prefill sooner than recomputing them: a fetch queued
        behind a busy NIC can lose to recompute. Then the decode node receives the whole prefix's
        KV except what it already holds.
        """
        spec, now = self.spec, self.now_ms
        role = spec.role(member)
        cost = self.role_cost[role]
        n_blocks = len(req.hashes)
        local = min(int(lens[member]), n_blocks)
        src, src_len = self._fetch_source(lens) if role != "remote" else (-1, 0)
        extra = max(0, min(src_len, n_blocks) - local) if src != member else 0
        queue = self.queue_ms(member)
        pcie = float(transfer_ms(dram_only_blocks * self.block_bytes, spec.pcie_bandwidth_bytes_per_s))
        best: tuple[float, ...] | None = None
        for k in (extra, 0) if extra else (0,):
            fetch_end = now
            if k:
                begin = float(self._nic_free_ms(self.nic_in_busy_until_ms, member))
                if src != spec.pool_member:
                    begin = max(begin, float(self._nic_free_ms(self.nic_out_busy_until_ms, src)))
                fetch_end = begin + float(
                    transfer_ms(k * self.block_bytes, spec.pool_bandwidth_bytes_per_s, spec.link_latency_ms)
                )
            cached = req.cached_tokens(local + k, spec.block_tokens)
            new = req.input_tokens - cached
            start = max(now + queue, fetch_end) + pcie
            compute = float(cost.prefill_ms(new, cached))
            duration, stall = compute, 0.0
            if role == "decode":
                stall = compute
                batch = int(self.decode_active[member])
                if spec.decode_prefill_mode == "chunked" and batch:
                    # fused iterations: the chunk's compute plus the decodes' per-sequence and KV-read
                    # terms; the weight read and step overhead are shared, so running decodes lose
                    # less than the whole prefill
                    steps = -(-new // spec.chunk_tokens)
                    ctx = int(self.decode_context_tokens[member])
                    duration += steps * (cost.decode_ms_per_seq * batch + cost.decode_ms_per_context_token * ctx)
                    stall = max(0.0, duration - steps * float(cost.decode_step_ms(batch, ctx)))
            if best is None or start + duration < best[0]:
                best = (start + duration, float(k), fetch_end, start, duration, stall, float(cached), float(new))
        assert best is not None
        done, kf, fetch_end, start, duration, stall, cached_f, new_f = best
        k = int(kf)
        cached_tokens, new_tokens = int(cached_f), int(new_f)
        pool_b = k if src == spec.pool_member else 0
        peer_b = k - pool_b
        dec_has = req.cached_tokens(min(int(lens[decode_member]), n_blocks), spec.block_tokens)
        to_bytes = (
            0
            if member == decode_member
            else (req.input_tokens - dec_has) * cost.kv_bytes_per_token + cost.state_bytes_per_request
        )
        if role == "remote":
            send = max(done, self.link_free_ms(done))
            first = send + float(
                transfer_ms(to_bytes, spec.remote_link_bandwidth_bytes_per_s, spec.remote_link_latency_ms)
            )
        elif to_bytes:
            send = max(
                done,
                float(self._nic_free_ms(self.nic_out_busy_until_ms, member)),
                float(self._nic_free_ms(self.nic_in_busy_until_ms, decode_member)),
            )
            first = send + float(transfer_ms(to_bytes, spec.pool_bandwidth_bytes_per_s, spec.link_latency_ms))
        else:
            send = first = done
        return PrefillPlan(
            member,
            local,
            pool_b,
            peer_b,
            src if k else -1,
            cached_tokens,
            new_tokens,
            queue,
            fetch_end,
            start,
            duration,
            stall,
            done,
            to_bytes,
            send,
            first,
            first - now,
        )

    def link_free_ms(self, ready_ms: float) -> float:
        """When the remote link can take a transfer ready at ``ready_ms``: after the one on it and every
        placed transfer ready before it (FIFO by ready time, as the simulator sends them)."""
        t = self.link_busy_until_ms
        for ready, on_link in self.link_pending:
            if ready > ready_ms:
                break
            t = max(t, ready) + on_link
        return t

    def predicted_tpot_ms(self, req: RouteRequest, members: np.ndarray | slice) -> np.ndarray:
        """Decode step time on each of ``members`` once ``req`` joins (``decode_step_ms``, inlined)."""
        c = self.role_cost["decode"]
        base = (
            c.decode_base_ms
            + c.decode_ms_per_seq
            + c.decode_ms_per_context_token * (req.input_tokens + req.output_tokens // 2)
        )
        ctx_ms = self.decode_context_tokens[members] * c.decode_ms_per_context_token
        return ctx_ms + self.decode_active[members] * c.decode_ms_per_seq + base

    def plan_ttft_vector(
        self, req: RouteRequest, members: np.ndarray | slice, lens: np.ndarray, decode_member: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised ``plan_prefill`` for disaggregated prefill instances (not decode-local, not remote).

        Returns (ttft_ms, hit_blocks) per member in ``members`` (an index array, or a slice such as
        ``prefill_slice``: a view, cheaper on the router's hot path); the same arithmetic,
        fetch-vs-recompute included, so a prediction and ``plan_prefill`` agree (a unit test checks
        it). Written for the 50 us decision budget at 64 instances: a request's prefix usually lives
        on a few members, so every member is first priced as holding nothing locally (one short
        chain of numpy calls, each ~1 us, shared by all of them), then the few holders are priced
        exactly in scalar arithmetic; with many holders, the dense form prices all at once.
        """
        local_all = lens[members]
        holders = local_all.nonzero()[0]
        if holders.size > _SPARSE_HOLDERS:
            return self._plan_ttft_dense(req, members, lens, decode_member)
        spec, cost, now = self.spec, self.role_cost["prefill"], self.now_ms
        n_blocks = len(req.hashes)
        inp = req.input_tokens
        bt = spec.block_tokens
        a, half_b = cost.prefill_ms_per_token, 0.5 * cost.prefill_ms_per_token_pair
        k = cost.prefill_base_ms + inp * (a + half_b * inp)  # prefill_ms(inp - c, c) = k - c * (a + half_b * c)
        busy = self.busy_until_ms[members]
        start_q = np.maximum(busy, now)
        done = start_q + k  # nothing cached: the whole prompt computed
        hit = np.zeros(local_all.shape[0], dtype=np.int64)
        src, src_len = self._fetch_source(lens)
        reach = min(src_len, n_blocks)
        contention = spec.nic_contention
        per_block_ms = self.block_bytes * 1000.0 / spec.pool_bandwidth_bytes_per_s
        floor = now
        if contention and src >= 0 and src != spec.pool_member:
            floor = max(now, float(self.nic_out_busy_until_ms[src]))
        c1 = min(reach * bt, inp - 1)
        k1 = k - c1 * (half_b * c1 + a)
        if src >= 0 and reach > 0:
            begin = np.maximum(self.nic_in_busy_until_ms[members], floor) if contention else floor
            done1 = np.maximum(start_q, begin + (spec.link_latency_ms + reach * per_block_ms)) + k1
            take = done1 < done
            done = np.where(take, done1, done)
            hit = np.where(take, reach, 0)
        dec_has = req.cached_tokens(min(int(lens[decode_member]), n_blocks), bt)
        to_bytes = (inp - dec_has) * cost.kv_bytes_per_token + cost.state_bytes_per_request
        move = float(transfer_ms(to_bytes, spec.pool_bandwidth_bytes_per_s, spec.link_latency_ms))
        floor_dec = now
        if contention:
            floor_dec = max(now, float(self.nic_in_busy_until_ms[decode_member]))
            out_busy = self.nic_out_busy_until_ms[members]
            send = np.maximum(np.maximum(done, out_busy), floor_dec)
        else:
            send = done
        ttft = send + (move - now)
        if holders.size:
            ids = self._ids[members]
            for j in holders.tolist():
                m = int(ids[j])
                local = min(int(local_all[j]), n_blocks)
                sq = max(float(busy[j]), now)
                c0 = min(local * bt, inp - 1)
                d, h = sq + (k - c0 * (half_b * c0 + a)), local
                if src >= 0 and reach > local:
                    beg = max(float(self.nic_in_busy_until_ms[m]), floor) if contention else floor
                    d1 = max(sq, beg + (spec.link_latency_ms + (reach - local) * per_block_ms)) + k1
                    if d1 < d:
                        d, h = d1, reach
                if contention:
                    d = max(d, float(self.nic_out_busy_until_ms[m]), floor_dec)
                ttft[j] = d + (move - now)
                hit[j] = h
        return ttft, hit

    def _plan_ttft_dense(
        self, req: RouteRequest, members: np.ndarray | slice, lens: np.ndarray, decode_member: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """``plan_ttft_vector`` with every member priced by the same numpy arithmetic (many holders)."""
        spec, cost, now = self.spec, self.role_cost["prefill"], self.now_ms
        n_blocks = len(req.hashes)
        inp = req.input_tokens
        bt = spec.block_tokens
        local = np.minimum(lens[members], n_blocks)
        start_q = np.maximum(self.busy_until_ms[members], now)
        cached0 = np.minimum(local * bt, inp - 1)
        # prefill_ms(inp - c, c) = base + (inp - c) * (a + b * (inp + c) / 2) = k - c * (a + b/2 * c)
        a, half_b = cost.prefill_ms_per_token, 0.5 * cost.prefill_ms_per_token_pair
        k = cost.prefill_base_ms + inp * (a + half_b * inp)
        done = start_q + (k - cached0 * (half_b * cached0 + a))
        hit = local
        src, src_len = self._fetch_source(lens)
        reach = min(src_len, n_blocks)
        if src >= 0 and reach > int(local.min()):
            # fetch what ``src`` has beyond the local prefix; where nothing is missing, the fetch
            # "costs" a latency and the same compute, so it never wins over recompute there
            extra = np.maximum(reach - local, 0)
            # (``src`` itself gets 0: its own prefix is at least ``reach``)
            begin = self.nic_in_busy_until_ms[members] if spec.nic_contention else now
            floor = now
            if spec.nic_contention and src != spec.pool_member:
                floor = max(now, float(self.nic_out_busy_until_ms[src]))
            begin = np.maximum(begin, floor)
            fetch_end = begin + (
                spec.link_latency_ms + extra * (self.block_bytes * 1000.0 / spec.pool_bandwidth_bytes_per_s)
            )
            cached1 = np.minimum((local + extra) * bt, inp - 1)
            done1 = np.maximum(start_q, fetch_end) + (k - cached1 * (half_b * cached1 + a))
            take = (done1 < done) & (extra > 0)
            done = np.where(take, done1, done)
            hit = np.where(take, local + extra, local)
        dec_has = req.cached_tokens(min(int(lens[decode_member]), n_blocks), bt)
        to_bytes = (inp - dec_has) * cost.kv_bytes_per_token + cost.state_bytes_per_request
        move = float(transfer_ms(to_bytes, spec.pool_bandwidth_bytes_per_s, spec.link_latency_ms))
        if spec.nic_contention:
            floor = max(now, float(self.nic_in_busy_until_ms[decode_member]))
            send = np.maximum(np.maximum(done, self.nic_out_busy_until_ms[members]), floor)
        else:
            send = done
        return send + (move - now), hit
