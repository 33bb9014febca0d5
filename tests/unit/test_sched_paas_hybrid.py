"""Hybrid-attention models in the cost model, their node presets, the remote link's backlog, and
when Prefill-as-a-Service on heterogeneous hardware wins: a hybrid model (little KV per prefill
FLOP) offloads long uncached prompts to a compute-dense remote cluster and beats a homogeneous
decode-class (H20) cluster of the same GPU count; a dense model behind a slow link does not beat a
homogeneous compute-dense cluster. Simulated figures, deterministic (seeded workloads)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvpool.core.errors import InvalidArgument
from kvpool.scheduler.cluster import ClusterSpec, ClusterState, RouteRequest, Slo
from kvpool.scheduler.cost_model import (
    H800X8,
    LLAMA3_8B,
    LLAMA3_70B,
    QWEN3_NEXT_80B,
    Architecture,
    from_architecture,
)
from kvpool.scheduler.hardware import NodePreset, cluster_from_preset, get_node_preset
from kvpool.scheduler.policy_paas import PaasPolicy
from kvpool.scheduler.runner import Workload, run_policy
from kvpool.scheduler.simulator import Simulator
from kvpool.scheduler.workloads import generate, workload_spec

Q_H20 = get_node_preset("qwen3-next-80b-h20x8")
Q_H200 = get_node_preset("qwen3-next-80b-h200x8")
H800 = get_node_preset("llama3-70b-h800x8")
H20 = get_node_preset("llama3-70b-h20x8")
SLO = Slo(10_000.0, 100.0)


@pytest.mark.parametrize("arch", [LLAMA3_70B, LLAMA3_8B])
def test_full_attention_default_gives_exactly_the_dense_numbers(arch: Architecture) -> None:
    """full_attention_layers=None (and every other new field at its default) is the old model, bit for bit."""
    flops_per_ms = 8 * 989e12 * 0.5 / 1000.0
    bytes_per_ms = 8 * 3.35e12 * 0.7 / 1000.0
    c = from_architecture("x", "", arch, H800X8)
    assert c.kv_bytes_per_token == 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
    assert c.prefill_ms_per_token == 2.0 * arch.params / flops_per_ms
    assert c.prefill_ms_per_token_pair == 4.0 * arch.num_layers * arch.hidden / flops_per_ms
    assert c.decode_base_ms == 2.0 + arch.params * 2 / bytes_per_ms
    assert c.decode_ms_per_seq == 2.0 * arch.params / flops_per_ms
    assert c.decode_ms_per_context_token == c.kv_bytes_per_token / bytes_per_ms
    assert c.state_bytes_per_request == 0
    explicit = dataclasses.replace(arch, full_attention_layers=arch.num_layers, active_params=arch.params)
    assert from_architecture("x", "", explicit, H800X8) == c


def test_hybrid_kv_and_flops_scale_with_the_full_attention_layers() -> None:
    full = dataclasses.replace(LLAMA3_70B, full_attention_layers=None)
    quarter = dataclasses.replace(LLAMA3_70B, full_attention_layers=20)
    cf, cq = from_architecture("f", "", full, H800X8), from_architecture("q", "", quarter, H800X8)
    assert cq.kv_bytes_per_token * 4 == cf.kv_bytes_per_token
    assert cq.prefill_ms_per_token_pair * 4 == pytest.approx(cf.prefill_ms_per_token_pair, rel=1e-12)
    assert cq.decode_ms_per_context_token * 4 == pytest.approx(cf.decode_ms_per_context_token, rel=1e-12)
    assert cq.prefill_ms_per_token == cf.prefill_ms_per_token  # the projections: every layer has them
    # Qwen3-Next-80B-A3B: 12 of 48 layers keep 2 KV heads of 256; 3B active params set FLOPs, 80B the weights
    q = QWEN3_NEXT_80B
    assert q.kv_bytes_per_token == 2 * 12 * 2 * 256 * 2 == 24_576
    assert q.linear_state_bytes == 36 * 548_864 * 2 == 39_518_208
    c = from_architecture("q", "", q, H800X8)
    flops_per_ms = 8 * 989e12 * 0.5 / 1000.0
    assert c.prefill_ms_per_token == (2.0 * 3e9 + q.linear_flops_per_token) / flops_per_ms
    assert c.prefill_ms_per_token_pair == 4.0 * 12 * 4096 / flops_per_ms
    assert c.decode_base_ms == 2.0 + 80e9 * 2 / (8 * 3.35e12 * 0.7 / 1000.0)
    assert c.state_bytes_per_request == q.linear_state_bytes
    # beyond the linear (per-token) terms, an uncached prompt pays only the 12 full-attention layers' pairs
    lin = c.prefill_ms(20_000) - c.prefill_base_ms - 20_000 * c.prefill_ms_per_token
    assert lin == pytest.approx(c.prefill_ms_per_token_pair * 20_000 * 10_000)


def test_invalid_hybrid_configs_are_clear_errors() -> None:
    with pytest.raises(InvalidArgument, match="full_attention_layers"):
        dataclasses.replace(LLAMA3_8B, full_attention_layers=33)
    with pytest.raises(InvalidArgument, match="linear layers"):
        dataclasses.replace(LLAMA3_8B, linear_state_bytes=1)
    with pytest.raises(InvalidArgument, match="linear layers"):  # every layer full attention: no linear layer
        dataclasses.replace(LLAMA3_8B, full_attention_layers=32, linear_flops_per_token=1.0)
    with pytest.raises(InvalidArgument, match="active_params"):
        dataclasses.replace(LLAMA3_8B, active_params=9e9)


def test_hybrid_presets_load_and_the_linear_state_travels_with_the_kv() -> None:
    for name in ("qwen3-next-80b-h800x8", "qwen3-next-80b-h200x8", "qwen3-next-80b-h20x8"):
        p = get_node_preset(name)
        assert p.cost_model().kv_bytes_per_token == 24_576
        assert p.kv_capacity_tokens() > 10 * H800.kv_capacity_tokens()  # 13x less KV per token
    # H200 and H800: same datasheet FLOPs; H20: a seventh of them, more HBM bandwidth than the H800
    assert (
        Q_H200.cost_model().prefill_ms_per_token
        == get_node_preset("qwen3-next-80b-h800x8").cost_model().prefill_ms_per_token
    )
    assert Q_H20.cost_model().prefill_ms(10_000) > 6 * Q_H200.cost_model().prefill_ms(10_000)
    spec = cluster_from_preset(Q_H20, num_prefill=1, num_decode=1)
    st = ClusterState(spec, Q_H20.cost_model())
    r = RouteRequest([bytes([i]) * 16 for i in range(4)], 2000, 10, SLO)
    plan = st.plan_prefill(r, 0, st.prefix_lengths(r.hashes), 1)
    assert plan.to_decode_bytes == 2000 * 24_576 + 39_518_208
    ttft, _ = st.plan_ttft_vector(r, st.prefill_arr, st.prefix_lengths(r.hashes), 1)
    assert float(ttft[0]) == pytest.approx(plan.ttft_ms, rel=1e-12)  # the vector form counts it too


def test_paas_counts_the_remote_transfers_already_placed() -> None:
    """The link backlog includes transfers placed but not yet on the link (their prefill runs): a remote
    side that looks idle while placed transfers queue for the link is no longer picked."""
    spec = cluster_from_preset(
        Q_H20, num_prefill=1, num_decode=1, num_remote_prefill=1, remote_link_bandwidth_bytes_per_s=25e9 / 8
    )
    st = ClusterState(spec, Q_H20.cost_model(), {"remote": Q_H200.cost_model()})
    r = RouteRequest([bytes([i]) * 16 for i in range(60)], 60 * 512, 100, SLO)
    st.busy_until_ms[0] = 2_000.0  # the local prefill node is 2 s behind
    assert PaasPolicy().decide(r, st).prefill_kind == "remote"
    lens = st.prefix_lengths(r.hashes)
    alone = st.plan_prefill(r, 2, lens, 1)
    st.link_pending = [(alone.done_ms + 1.0, 5_000.0)]  # ready after this one: behind it in the FIFO
    assert st.plan_prefill(r, 2, lens, 1).to_decode_start_ms == alone.to_decode_start_ms
    st.link_pending = [(0.0, 2_500.0), (1.0, 2_500.0)]  # 5 s of placed transfers ready before it
    assert st.plan_prefill(r, 2, lens, 1).to_decode_start_ms == 5_000.0
    assert PaasPolicy().decide(r, st).prefill_kind == "instance"


def test_every_placed_remote_transfer_leaves_the_pending_list() -> None:
    """The simulator adds each remote transfer to ``link_pending`` when it places it and removes it when
    the transfer takes the link; after a replay nothing is left (a leak would inflate every later plan)."""
    work = _docqa(150, 8.0)
    roles = {"prefill": Q_H20.cost_model(), "decode": Q_H20.cost_model(), "remote": Q_H200.cost_model()}
    sim = Simulator(_hetero(Q_H20, Q_H20, 25.0), Q_H20.cost_model(), PaasPolicy(), SLO, role_costs=roles)
    pending = _Watched()
    sim.state.link_pending = pending
    out = sim.run(work.trace)
    assert (out.prefill_kind == 2).sum() > 10
    assert pending.inserted == (out.prefill_kind == 2).sum() and pending.most >= 2  # placed, and queued up
    assert sim.state.link_pending == []


class _Watched(list[tuple[float, float]]):
    """``link_pending`` that counts what the simulator puts in it (``bisect.insort`` calls ``insert``
    on a list subclass) and the most it held at once."""

    inserted = 0
    most = 0

    def insert(self, index: int, item: tuple[float, float]) -> None:  # type: ignore[override]
        super().insert(index, item)
        self.inserted += 1
        self.most = max(self.most, len(self))


def _docqa(requests: int, rate_rps: float) -> Workload:
    return Workload.of(generate(workload_spec("docqa", requests=requests, rate_rps=rate_rps)))


def _hetero(local: NodePreset, decode: NodePreset, link_gbps: float) -> ClusterSpec:
    return cluster_from_preset(
        local,
        num_prefill=1,
        num_decode=1,
        num_remote_prefill=1,
        decode_kv_capacity_tokens=decode.kv_capacity_tokens(),
        remote_link_bandwidth_bytes_per_s=link_gbps * 1e9 / 8,
        remote_link_latency_ms=10.0,
    )


def test_hybrid_paas_beats_homogeneous_h20_at_equal_gpu_count() -> None:
    """3 nodes each: 1 H20 prefill + 1 H20 decode + 1 remote H200 prefill (100 Gbit/s) vs 2 + 1 H20.
    Long uncached documents go remote (~a fifth), and the link carries them cheaply (24 KiB/token)."""
    work = _docqa(400, 8.0)
    roles = {"prefill": Q_H20.cost_model(), "decode": Q_H20.cost_model(), "remote": Q_H200.cost_model()}
    paas, out = run_policy(work, _hetero(Q_H20, Q_H20, 100.0), Q_H20.cost_model(), "paas", SLO, role_costs=roles)
    homo, _ = run_policy(
        work, cluster_from_preset(Q_H20, num_prefill=2, num_decode=1), Q_H20.cost_model(), "kv-centric-noreject", SLO
    )
    remote_share = float(np.mean(out.prefill_kind == 2))
    assert 0.1 < remote_share < 0.4
    assert paas.ttft_mean_ms * 10 < homo.ttft_mean_ms  # 52 vs 4,531 ms when written
    assert paas.slo_attainment >= homo.slo_attainment


def test_dense_paas_behind_a_slow_link_loses_to_homogeneous_h800() -> None:
    """LLaMA3-70B (320 KiB/token) behind 25 Gbit/s: 1 H800 prefill + 1 H20 decode + 1 remote H800 vs
    2 + 1 H800: the remote prefill's KV takes longer on the link than its compute saves."""
    work = _docqa(300, 1.0)
    roles = {"prefill": H800.cost_model(), "decode": H20.cost_model(), "remote": H800.cost_model()}
    paas, _ = run_policy(work, _hetero(H800, H20, 25.0), H800.cost_model(), "paas", SLO, role_costs=roles)
    homo, _ = run_policy(
        work, cluster_from_preset(H800, num_prefill=2, num_decode=1), H800.cost_model(), "kv-centric-noreject", SLO
    )
    assert paas.ttft_mean_ms > 1.5 * homo.ttft_mean_ms  # 1,528 vs 649 ms when written
    assert paas.slo_attainment <= homo.slo_attainment
