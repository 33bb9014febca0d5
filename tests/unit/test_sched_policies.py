"""Each policy on a small hand-built cluster where the right answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.core.errors import InvalidArgument
from kvpool.scheduler.cluster import ClusterSpec, ClusterState, RouteRequest, Slo
from kvpool.scheduler.cost_model import get_preset
from kvpool.scheduler.policies import make_policy, policy_names
from kvpool.scheduler.policy_kv_centric import KvCentricPolicy
from kvpool.scheduler.policy_remote_prefill import RemotePrefillPolicy

COST = get_preset("llama3-70b-a800x8")
BT = 512


def hashes(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(16, b".")[:16] for i in range(n)]


def state(prefill: int = 3, decode: int = 2, remote: int = 0, pool: int | None = 1000) -> ClusterState:
    return ClusterState(
        ClusterSpec(num_prefill=prefill, num_decode=decode, num_remote_prefill=remote, pool_blocks=pool), COST
    )


def req(hs: list[bytes], slo: Slo | None = None, out: int = 100) -> RouteRequest:
    return RouteRequest(hs, len(hs) * BT, out, slo or Slo(10_000, 200))


def test_prefix_only_takes_the_longest_local_prefix() -> None:
    st = state()
    hs = hashes("a", 8)
    st.index.add_many(hs[:2], 0)
    st.index.add_many(hs[:6], 2)
    d = make_policy("prefix-only").decide(req(hs), st)
    assert (d.prefill_member, d.expected_hit_blocks) == (2, 6)


def test_least_loaded_takes_the_shortest_queue_and_lightest_decode() -> None:
    st = state()
    st.busy_until_ms[:3] = [500, 100, 900]
    st.decode_context_tokens[3:5] = [50_000, 10]
    d = make_policy("least-loaded").decide(req(hashes("b", 4)), st)
    assert (d.prefill_member, d.decode_member) == (1, 4)


def test_round_robin_cycles() -> None:
    st = state()
    pol = make_policy("round-robin")
    seen = []
    for _ in range(4):
        d = pol.decide(req(hashes("c", 2)), st)
        pol.observe(req(hashes("c", 2)), d, st)
        seen.append(d.prefill_member)
    assert seen == [0, 1, 2, 0]


def test_random_is_seeded_and_valid() -> None:
    st = state()
    a = [make_policy("random", 7).decide(req(hashes("d", 2)), st).prefill_member for _ in range(1)]
    p1, p2 = make_policy("random", 7), make_policy("random", 7)
    seq1 = [p1.decide(req(hashes("d", 2)), st).prefill_member for _ in range(20)]
    seq2 = [p2.decide(req(hashes("d", 2)), st).prefill_member for _ in range(20)]
    assert seq1 == seq2 and set(seq1) <= {0, 1, 2} and a[0] in {0, 1, 2}


def test_kv_centric_trades_cache_against_queue() -> None:
    st = state()
    hs = hashes("e", 20)  # 10k tokens: ~1.5 s uncached prefill
    st.index.add_many(hs, 0)  # instance 0 holds everything...
    st.busy_until_ms[0] = 60_000  # ...but is busy for a minute
    st.index.add_many(hs[:10], 1)  # instance 1 holds half, idle
    d = make_policy("kv-centric").decide(req(hs, Slo(100_000, 200)), st)
    assert d.prefill_member == 1 and not d.rejected
    assert d.expected_ttft_ms < 60_000
    st.busy_until_ms[0] = 0  # now the full holder is idle: it wins
    assert make_policy("kv-centric").decide(req(hs, Slo(100_000, 200)), st).prefill_member == 0


def test_kv_centric_charges_a_recompute_for_the_instance_time_it_takes() -> None:
    """A holder whose queue costs this request more than an idle recompute, but less than the
    recompute's occupancy on top of it, keeps the request (TTFT alone would move it)."""
    st = ClusterState(ClusterSpec(num_prefill=2, num_decode=1, pool_blocks=0, peer_fetch=False), COST)
    hs = hashes("o", 20)
    st.index.add_many(hs, 0)
    r = req(hs, Slo(1e9, 1e9))
    saved_ms = COST.prefill_ms(r.input_tokens, 0) - COST.prefill_ms(1, r.input_tokens - 1)
    st.busy_until_ms[0] = 1.5 * saved_ms  # TTFT on 0 is ~0.5x saved_ms worse than recomputing on 1
    assert KvCentricPolicy(occupancy_weight=0.0).decide(r, st).prefill_member == 1
    assert KvCentricPolicy(occupancy_weight=1.0).decide(r, st).prefill_member == 0
    st.busy_until_ms[0] = 2.5 * saved_ms  # now the wait costs more than the recompute's occupancy
    assert KvCentricPolicy(occupancy_weight=1.0).decide(r, st).prefill_member == 1


def test_kv_centric_counts_pool_hits_anywhere() -> None:
    st = state()
    hs = hashes("f", 10)
    st.index.add_many(hs, st.spec.pool_member)
    st.busy_until_ms[:3] = [300, 200, 100]
    d = make_policy("kv-centric").decide(req(hs), st)
    assert d.prefill_member == 2 and d.expected_hit_blocks == 10


def test_kv_centric_rejects_an_slo_no_placement_can_meet() -> None:
    st = state()
    hs = hashes("g", 100)  # 51k uncached tokens: ~8 s of prefill anywhere
    d = make_policy("kv-centric").decide(req(hs, Slo(ttft_ms=1_000, tpot_ms=200)), st)
    assert d.rejected and "TTFT" in d.reason and d.expected_ttft_ms > 1_000
    st.decode_context_tokens[3:5] = 10_000_000  # decode saturated: TPOT SLO cannot be met
    d2 = make_policy("kv-centric").decide(req(hashes("h", 2), Slo(ttft_ms=10_000, tpot_ms=50)), st)
    assert d2.rejected and "TPOT" in d2.reason


def test_sglang_follows_its_own_tree_then_balances() -> None:
    st = state()
    pol = make_policy("sglang")
    hs = hashes("i", 10)
    first = pol.decide(req(hs), st)
    pol.observe(req(hs), first, st)
    again = pol.decide(req(hs), st)
    assert again.prefill_member == first.prefill_member  # match rate 1.0 > 0.5
    st.outstanding_requests[first.prefill_member] = 50  # heavily imbalanced: go to the least loaded
    bal = pol.decide(req(hs), st)
    assert bal.prefill_member != first.prefill_member and "imbalanced" in bal.reason


def test_dynamo_weighs_overlap_against_active_blocks() -> None:
    st = state()
    hs = hashes("j", 10)
    st.index.add_many(hs, 0)
    assert make_policy("dynamo").decide(req(hs), st).prefill_member == 0
    st.outstanding_tokens[0] = 20 * BT  # 20 active blocks > 10 saved blocks
    assert make_policy("dynamo").decide(req(hs), st).prefill_member != 0


def test_llmd_scores_prefix_queue_and_kv() -> None:
    st = state()
    hs = hashes("k", 10)
    st.index.add_many(hs, 2)
    assert make_policy("llm-d").decide(req(hs), st).prefill_member == 2
    st.outstanding_requests[2] = 10
    st.outstanding_tokens[2] = st.spec.decode_kv_capacity_tokens  # full: prefix 3 < queue 2 + kv 2
    assert make_policy("llm-d").decide(req(hs), st).prefill_member != 2


def test_remote_prefill_sends_only_long_uncached_prompts_remote() -> None:
    st = state(prefill=0, decode=2, remote=2)
    pol = RemotePrefillPolicy(initial_threshold_tokens=4096, auto=False)
    short = pol.decide(req(hashes("l", 4)), st)  # 2k tokens
    assert short.prefill_kind == "decode_local" and short.prefill_member == short.decode_member
    long = hashes("m", 40)  # 20k tokens
    d = pol.decide(req(long), st)
    assert d.prefill_kind == "remote" and st.spec.role(d.prefill_member) == "remote"
    st.index.add_many(long[:38], 1)  # decode-1 holds most of it: uncached is small -> prefill locally
    d2 = pol.decide(req(long), st)
    assert d2.prefill_kind == "decode_local" and d2.expected_hit_blocks == 38


def test_remote_prefill_threshold_rises_when_the_link_saturates() -> None:
    st = state(prefill=0, decode=2, remote=1)
    pol = RemotePrefillPolicy(initial_threshold_tokens=4096, recompute_every=4)
    st.link_busy_until_ms = 1e9  # a saturated link
    before = pol.threshold_tokens
    for i in range(8):
        st.now_ms = float(i * 100)
        r = req(hashes(f"n{i}", 20))
        pol.observe(r, pol.decide(r, st), st)
    assert pol.threshold_tokens > before


def test_every_policy_returns_a_valid_placement() -> None:
    st = state(prefill=2, decode=2, remote=1)
    for name in policy_names():
        d = make_policy(name).decide(req(hashes("o", 6), Slo(1e9, 1e9)), st)
        assert not d.rejected, name
        assert st.spec.role(d.decode_member) == "decode", name


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(InvalidArgument, match="unknown policy"):
        make_policy("nope")


def test_a_cluster_without_decode_instances_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="no decode instance"):
        ClusterSpec(num_prefill=2, num_decode=0)
    with pytest.raises(InvalidArgument):
        Slo(ttft_ms=0)
    assert np.all(state().queues_ms(np.arange(3)) == 0)
