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

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from kvpool.core.errors import InvalidArgument
from kvpool.scheduler.cost_model import CostModel, transfer_ms
from kvpool.scheduler.index import LocationIndex

PrefillKind = Literal["instance", "decode_local", "remote"]


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

    def __post_init__(self) -> None:
        if self.num_decode <= 0:
            raise InvalidArgument(
                "the cluster has no decode instance: nothing could generate tokens",
                hint="set num_decode >= 1 (--decode)",
            )
        if self.num_prefill < 0 or self.num_remote_prefill < 0:
            raise InvalidArgument("instance counts must be >= 0")
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


@dataclass(frozen=True)
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
    """The arithmetic of prefilling one request on one member."""

    member: int
    local_blocks: int
    pool_blocks: int  # fetched from the global pool
    peer_blocks: int  # fetched from another instance's cache
    cached_tokens: int
    new_tokens: int
    queue_ms: float
    fetch_ms: float
    prefill_ms: float
    to_decode_ms: float  # moving the KV to the decode instance (0 when prefilled there)
    ttft_ms: float

    @property
    def hit_blocks(self) -> int:
        return self.local_blocks + self.pool_blocks + self.peer_blocks


class ClusterState:
    """Live state: queues, decode load and block locations, at time ``now_ms``."""

    def __init__(self, spec: ClusterSpec, cost: CostModel) -> None:
        self.spec = spec
        self.cost = cost
        self.now_ms = 0.0
        n = spec.num_instances
        self.busy_until_ms = np.zeros(n, dtype=np.float64)  # prefill queue drains at (decode: local prefill)
        self.decode_active = np.zeros(n, dtype=np.int64)  # running requests (decode members only)
        self.decode_context_tokens = np.zeros(n, dtype=np.int64)  # their KV tokens
        self.outstanding_tokens = np.zeros(n, dtype=np.int64)  # prefill tokens queued or running
        self.outstanding_requests = np.zeros(n, dtype=np.int64)  # prefills queued or running
        self.link_busy_until_ms = 0.0  # the remote prefill link
        self.index = LocationIndex(n + 1)
        self.block_bytes = cost.kv_bytes_per_token * spec.block_tokens
        self.prefill_arr = np.arange(spec.num_prefill)
        self.decode_arr = np.arange(spec.num_prefill, spec.num_prefill + spec.num_decode)
        self.remote_arr = np.arange(spec.num_prefill + spec.num_decode, n)
        self._local_mask = (1 << (spec.num_prefill + spec.num_decode)) - 1

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

    def predicted_tpot_ms(self, req: RouteRequest, members: np.ndarray) -> np.ndarray:
        ctx = self.decode_context_tokens[members] + req.input_tokens + req.output_tokens // 2
        return np.asarray(self.cost.decode_step_ms(self.decode_active[members] + 1, ctx), dtype=np.float64)

    def plan_prefill(
        self,
        req: RouteRequest,
        member: int,
        lens: np.ndarray,
        decode_member: int,
        dram_only_blocks: int = 0,
    ) -> PrefillPlan:
        """Prefill ``req`` on ``member`` then decode on ``decode_member``: hits, moves, times."""
        spec, cost = self.spec, self.cost
        role = spec.role(member)
        n_blocks = len(req.hashes)
        local = min(int(lens[member]), n_blocks)
        pool_len = int(lens[spec.pool_member]) if spec.pool_blocks != 0 else 0
        peer_len = int(lens[: spec.num_prefill + spec.num_decode].max()) if spec.peer_fetch else 0
        pool_b = peer_b = 0
        if role != "remote":
            if pool_len > local and pool_len >= peer_len:
                pool_b = pool_len - local
            elif peer_len > local:
                peer_b = peer_len - local
        hit = local + pool_b + peer_b
        cached_tokens = req.cached_tokens(hit, spec.block_tokens)
        new_tokens = req.input_tokens - cached_tokens
        queue = self.queue_ms(member)
        fetch = float(
            transfer_ms((pool_b + peer_b) * self.block_bytes, spec.pool_bandwidth_bytes_per_s, spec.link_latency_ms)
        )
        fetch += float(transfer_ms(dram_only_blocks * self.block_bytes, spec.pcie_bandwidth_bytes_per_s))
        prefill = float(cost.prefill_ms(new_tokens, cached_tokens))
        kv_bytes = req.input_tokens * cost.kv_bytes_per_token
        if role == "remote":
            done = self.now_ms + queue + fetch + prefill
            link_wait = max(0.0, self.link_busy_until_ms - done)
            to_decode = link_wait + float(
                transfer_ms(
                    new_tokens * cost.kv_bytes_per_token,
                    spec.remote_link_bandwidth_bytes_per_s,
                    spec.remote_link_latency_ms,
                )
            )
        elif member == decode_member:
            to_decode = 0.0
        else:
            to_decode = float(transfer_ms(kv_bytes, spec.pool_bandwidth_bytes_per_s, spec.link_latency_ms))
        return PrefillPlan(
            member,
            local,
            pool_b,
            peer_b,
            cached_tokens,
            new_tokens,
            queue,
            fetch,
            prefill,
            to_decode,
            queue + fetch + prefill + to_decode,
        )

    def plan_ttft_vector(self, req: RouteRequest, members: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, ...]:
        """Vectorised ``plan_prefill`` for disaggregated prefill instances (not decode-local, not remote).

        Returns (ttft_ms, hit_blocks) per member in ``members``.
        """
        spec, cost = self.spec, self.cost
        reach = self.reachable_blocks(lens)[members]
        local = lens[members]
        cached_tokens = np.minimum(reach * spec.block_tokens, req.input_tokens - 1)
        new_tokens = req.input_tokens - cached_tokens
        fetch = transfer_ms((reach - local) * self.block_bytes, spec.pool_bandwidth_bytes_per_s, spec.link_latency_ms)
        to_decode = float(
            transfer_ms(
                req.input_tokens * cost.kv_bytes_per_token, spec.pool_bandwidth_bytes_per_s, spec.link_latency_ms
            )
        )
        ttft = self.queues_ms(members) + fetch + cost.prefill_ms(new_tokens, cached_tokens) + to_decode
        return np.asarray(ttft, dtype=np.float64), reach
