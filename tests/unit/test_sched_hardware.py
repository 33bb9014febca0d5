"""Node presets (HBM left for KV, per-hop bandwidths) and heterogeneous clusters: the
paas policy offloads a long uncached prompt to a faster remote prefill cluster when the
remote side wins after the link: not over a slow link, not when the prefix is cached
locally."""

from __future__ import annotations

import pytest

from kvpool.core.errors import InvalidArgument
from kvpool.scheduler.cluster import ClusterState, RouteRequest, Slo
from kvpool.scheduler.cost_model import LLAMA3_8B, get_preset
from kvpool.scheduler.hardware import NODE_PRESETS, NodePreset, cluster_from_preset, get_node_preset
from kvpool.scheduler.policy_paas import PaasPolicy

A800 = get_node_preset("llama3-70b-a800x8")
H800 = get_node_preset("llama3-70b-h800x8")


def test_hbm_left_for_kv_is_capacity_minus_weights_and_activations() -> None:
    usable = 8 * 80e9 * 0.9
    left = usable - 70.6e9 * 2 - 8 * 4 * (1 << 30)
    assert A800.kv_capacity_tokens() == int(left // 327_680)
    assert 1_100_000 < A800.kv_capacity_tokens() < 1_300_000  # ~1.2M tokens, not "10,000 blocks"
    spec = cluster_from_preset(A800, num_prefill=2, num_decode=1)
    assert spec.hbm_blocks == (A800.kv_capacity_tokens() - A800.max_prefill_tokens) // 512
    assert spec.dram_blocks == int(1e12 // (512 * 327_680)) and spec.pool_blocks == 0
    assert spec.pool_bandwidth_bytes_per_s == A800.nic_bytes_per_s
    for p in NODE_PRESETS.values():
        if p.name.startswith("llama3-70b"):
            assert p.cost_model().kv_bytes_per_token == 327_680


def test_a_model_that_does_not_fit_is_a_clear_error() -> None:
    with pytest.raises(InvalidArgument, match="no HBM for KV"):
        NodePreset(
            "tiny",
            "",
            LLAMA3_8B,
            A800.hw,
            hbm_bytes_per_gpu=1e9,
            host_dram_kv_bytes=0,
            nic_bytes_per_s=1e9,
            pcie_bytes_per_s=1e9,
        )
    with pytest.raises(InvalidArgument, match="unknown node preset"):
        get_node_preset("nope")


def test_role_costs_must_serve_the_same_model() -> None:
    spec = cluster_from_preset(A800, num_prefill=1, num_decode=1)
    with pytest.raises(InvalidArgument, match="same model"):
        ClusterState(spec, A800.cost_model(), {"prefill": get_preset("llama3-8b-a100x1")})
    with pytest.raises(InvalidArgument, match="unknown role"):
        ClusterState(spec, A800.cost_model(), {"gpu": H800.cost_model()})


@pytest.mark.parametrize(
    ("link_gbps", "busy_local_ms", "expect"), [(400, 20_000, "remote"), (1, 20_000, "instance"), (400, -1, "instance")]
)
def test_paas_offloads_only_when_the_faster_remote_side_wins_after_the_link(
    link_gbps: float, busy_local_ms: float, expect: str
) -> None:
    spec = cluster_from_preset(
        A800, num_prefill=2, num_decode=1, num_remote_prefill=1, remote_link_bandwidth_bytes_per_s=link_gbps * 1e9 / 8
    )
    st = ClusterState(spec, A800.cost_model(), {"remote": H800.cost_model()})
    r = RouteRequest([bytes([i]) * 16 for i in range(40)], 40 * 512, 100, Slo())
    if busy_local_ms < 0:  # idle, and the local prefill instance 0 holds the prefix
        st.index.add_many(r.hashes[:39], 0)
    else:
        st.busy_until_ms[:2] = busy_local_ms  # local prefill queues
    d = PaasPolicy().decide(r, st)
    assert d.prefill_kind == expect and d.decode_member == 2
