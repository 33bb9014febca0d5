"""Simulator invariants on generated traces and clusters: every request is decided once
and finishes or is rejected, events never run backwards, hits never exceed the prompt,
a rerun with the same seed is identical, and the location index names exactly the
blocks the caches hold (so a cluster without caches hits nothing)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.scheduler.cluster import ClusterSpec, Slo
from kvpool.scheduler.cost_model import get_preset
from kvpool.scheduler.policies import make_policy, policy_names
from kvpool.scheduler.policy_kv_centric import KvCentricPolicy
from kvpool.scheduler.runner import Workload, run_policy
from kvpool.scheduler.simulator import Simulator
from kvpool.scheduler.trace import TraceRequest

COST = get_preset("llama3-70b-a800x8")


def cluster(prefill: int, decode: int, remote: int, **kw: object) -> ClusterSpec:
    """A small cluster: tiny decode budget and batch, so waits and evictions happen."""
    base: dict[str, object] = dict(decode_kv_capacity_tokens=20_000, max_decode_batch=4)
    base.update(kw)
    return ClusterSpec(num_prefill=prefill, num_decode=decode, num_remote_prefill=remote, **base)  # type: ignore[arg-type]


@st.composite
def traces(draw: st.DrawFn) -> list[TraceRequest]:
    n = draw(st.integers(1, 25))
    sessions: list[list[int]] = []
    next_id = 0
    t = 0.0
    out = []
    for i in range(n):
        t += draw(st.floats(0, 5_000))
        reuse = draw(st.booleans())
        if sessions and reuse:
            s = sessions[draw(st.integers(0, len(sessions) - 1))]
        else:
            s = []
            sessions.append(s)
        for _ in range(draw(st.integers(1, 8))):
            s.append(next_id)
            next_id += 1
        ids = tuple(s)
        n_in = len(ids) * 512 - draw(st.integers(0, 511))
        out.append(TraceRequest(i, t, n_in, draw(st.integers(1, 300)), ids))
    return out


@settings(max_examples=40, deadline=None)
@given(
    traces(),
    st.sampled_from(policy_names()),
    st.integers(0, 3),
    st.integers(1, 3),
    st.integers(0, 2),
    st.sampled_from([None, 0, 20]),
    st.floats(0.5, 50),
    st.integers(0, 3),
)
def test_replay_invariants(
    trace: list[TraceRequest],
    policy: str,
    prefill: int,
    decode: int,
    remote: int,
    pool: int | None,
    speedup: float,
    seed: int,
) -> None:
    spec = cluster(prefill, decode, remote, hbm_blocks=8, dram_blocks=8, pool_blocks=pool)
    slo = Slo(5_000, 100)
    s1, o1 = run_policy(Workload.of(trace), spec, COST, policy, slo, speedup=speedup, seed=seed)
    assert (o1.decided == 1).all()
    served = ~o1.rejected
    assert np.isfinite(o1.finish_ms[served]).all() and np.isnan(o1.ttft_ms[~served]).all()
    assert (o1.prefill_start_ms[served] >= o1.arrival_ms[served]).all()
    assert (o1.ttft_ms[served] > 0).all()
    assert (o1.finish_ms[served] + 1e-6 >= o1.arrival_ms[served] + o1.ttft_ms[served]).all()
    assert (o1.hit_local + o1.hit_pool + o1.hit_peer <= o1.blocks).all()
    assert (o1.new_tokens[served] >= 1).all()
    assert s1.served + s1.rejected == len(trace)
    _, o2 = run_policy(Workload.of(trace), spec, COST, policy, slo, speedup=speedup, seed=seed)
    np.testing.assert_array_equal(o1.ttft_ms, o2.ttft_ms)
    np.testing.assert_array_equal(o1.finish_ms, o2.finish_ms)


@settings(max_examples=40, deadline=None)
@given(
    traces(),
    st.sampled_from(policy_names()),
    st.integers(0, 3),
    st.integers(1, 3),
    st.integers(0, 2),
    st.sampled_from([0, 1, 3, 8]),
    st.sampled_from([0, 1, 5]),
    st.sampled_from([0, 2, 20]),
    st.booleans(),
    st.sampled_from(["stall", "chunked"]),
)
def test_the_index_names_exactly_the_blocks_the_caches_hold(
    trace: list[TraceRequest],
    policy: str,
    prefill: int,
    decode: int,
    remote: int,
    hbm: int,
    dram: int,
    pool: int,
    peers: bool,
    mode: str,
) -> None:
    """Checked after every request and at the end: an index bit is set iff that member's cache
    (HBM, DRAM or the pool) holds the block, so no hit is ever counted on an evicted block."""
    spec = cluster(
        prefill,
        decode,
        remote,
        hbm_blocks=hbm,
        dram_blocks=dram,
        pool_blocks=pool,
        peer_fetch=peers,
        decode_prefill_mode=mode,
        chunk_tokens=512,
    )
    work = Workload.of(trace)
    sim = Simulator(spec, COST, make_policy(policy, 0), Slo(5_000, 100), hasher=work.hasher, check_every=1)
    out = sim.run(trace)
    if hbm == 0 and dram == 0 and pool == 0:
        assert int((out.hit_local + out.hit_pool + out.hit_peer).sum()) == 0


@settings(max_examples=25, deadline=None)
@given(traces(), st.sampled_from(policy_names()), st.integers(0, 3), st.integers(1, 3), st.integers(0, 2))
def test_an_empty_cluster_without_caches_hits_nothing(
    trace: list[TraceRequest], policy: str, prefill: int, decode: int, remote: int
) -> None:
    """No HBM cache, no DRAM, no pool, no peers: nothing can hit (the phantom-hit regression)."""
    spec = cluster(prefill, decode, remote, hbm_blocks=0, dram_blocks=0, pool_blocks=0, peer_fetch=False)
    s, out = run_policy(Workload.of(trace), spec, COST, policy, Slo(5_000, 100))
    assert s.hit_rate == 0.0
    assert int((out.hit_local + out.hit_pool + out.hit_peer).sum()) == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.0, 1e5, allow_nan=False), min_size=1, max_size=12),
    st.lists(st.integers(0, 20), min_size=12, max_size=12),
    st.floats(0.0, 1.0),
)
def test_kv_centric_affinity_keeps_the_longest_prefix_within_the_slack(
    ttfts: list[float], locals_: list[int], slack: float
) -> None:
    """The pick is within ``slack`` of the best TTFT, and no candidate within it holds a longer prefix
    (nor the same prefix with a lower TTFT)."""
    ttft = np.array(ttfts)
    local = np.array(locals_[: len(ttfts)], dtype=np.int64)
    i = int(np.argmin(ttft))
    j = KvCentricPolicy(affinity_slack=slack)._affinity(i, ttft, local)
    limit = ttft[i] * (1.0 + slack)
    assert ttft[j] <= limit
    within = ttft <= limit
    assert local[j] == local[within].max()
    assert ttft[j] == ttft[within & (local == local[j])].min()
