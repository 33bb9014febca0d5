"""Simulator invariants, trace parsing, oracle and LRU figures, cost model and fitter."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from kvpool.core.errors import InvalidArgument
from kvpool.scheduler.cluster import ClusterSpec, Slo
from kvpool.scheduler.cost_model import PRESETS, fit, get_preset, load_cost_model, transfer_ms
from kvpool.scheduler.index import LocationIndex, LruCache
from kvpool.scheduler.metrics import goodput_search
from kvpool.scheduler.policies import PD_POLICIES
from kvpool.scheduler.runner import Workload, run_policy
from kvpool.scheduler.trace import TraceHasher, TraceRequest, oracle_hit_rate, parse_trace_lines, synth_block_tokens

COST = get_preset("llama3-70b-a800x8")
TRACE = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "conversation_trace.jsonl"


def synthetic_trace(n: int = 300, seed: int = 1) -> list[TraceRequest]:
    """Conversations: each turn extends a previous prompt of its session by a few blocks."""
    rng = np.random.default_rng(seed)
    sessions: list[list[int]] = []
    next_id = 1
    out = []
    t = 0.0
    for i in range(n):
        t += float(rng.exponential(300.0))
        if sessions and rng.random() < 0.6:
            s = sessions[int(rng.integers(len(sessions)))]
        else:
            s = [0]
            sessions.append(s)
        for _ in range(int(rng.integers(1, 6))):
            s.append(next_id)
            next_id += 1
        ids = tuple(s)
        out.append(TraceRequest(i, t, len(ids) * 512 - int(rng.integers(0, 500)), int(rng.integers(1, 400)), ids))
    return out


def small_spec(**kw: object) -> ClusterSpec:
    base: dict[str, object] = dict(num_prefill=3, num_decode=2, hbm_blocks=20, dram_blocks=40, pool_blocks=300)
    base.update(kw)
    return ClusterSpec(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", [*PD_POLICIES, "kv-centric-noreject"])
def test_every_request_finishes_or_is_rejected_once_and_time_moves_forward(policy: str) -> None:
    trace = synthetic_trace()
    summary, out = run_policy(Workload.of(trace), small_spec(), COST, policy, Slo(3000, 100), speedup=4.0)
    assert (out.decided == 1).all()
    served = ~out.rejected
    assert np.isfinite(out.finish_ms[served]).all() and np.isnan(out.finish_ms[~served]).all()
    assert (out.prefill_start_ms[served] >= out.arrival_ms[served]).all()
    assert (out.ttft_ms[served] > 0).all()
    assert (out.finish_ms[served] >= out.arrival_ms[served] + out.ttft_ms[served] - 1e-6).all()
    assert (out.hit_local + out.hit_pool + out.hit_peer <= out.blocks).all()
    assert summary.served + summary.rejected == len(trace)
    assert 0 <= summary.slo_attainment <= 1


@pytest.mark.parametrize("eviction", ["s3fifo", "arc"])
def test_storage_eviction_policies_run_in_the_simulator(eviction: str) -> None:
    trace = synthetic_trace()
    s, out = run_policy(Workload.of(trace), small_spec(eviction=eviction), COST, "kv-centric", Slo(), speedup=2.0)
    assert (out.decided == 1).all() and s.hit_rate > 0


def test_unknown_eviction_policy_is_a_clear_error() -> None:
    with pytest.raises(InvalidArgument, match="eviction policy"):
        small_spec(eviction="mru")


def test_remote_prefill_cluster_invariants() -> None:
    trace = synthetic_trace()
    spec = small_spec(num_prefill=0, num_remote_prefill=2)
    _, out = run_policy(Workload.of(trace), spec, COST, "remote-prefill", Slo(3000, 100), speedup=2.0)
    assert (out.decided == 1).all() and not out.rejected.any()
    assert set(np.unique(out.prefill_kind)) <= {1, 2}
    assert np.isfinite(out.finish_ms).all()


def test_a_fixed_seed_gives_identical_results() -> None:
    trace = synthetic_trace()
    runs = [run_policy(Workload.of(trace), small_spec(), COST, "random", Slo(), speedup=3.0, seed=5) for _ in range(2)]
    (s1, o1), (s2, o2) = runs
    for name in ("ttft_ms", "tpot_ms", "finish_ms", "hit_local", "hit_pool", "rejected", "bytes_moved"):
        np.testing.assert_array_equal(getattr(o1, name), getattr(o2, name))
    other = run_policy(Workload.of(trace), small_spec(), COST, "random", Slo(), speedup=3.0, seed=6)[1]
    assert not np.array_equal(o1.ttft_ms, other.ttft_ms)
    assert {k: v for k, v in s1.to_dict().items() if "decision" not in k} == {
        k: v for k, v in s2.to_dict().items() if "decision" not in k
    }


def test_more_load_means_longer_ttft() -> None:
    trace = synthetic_trace()
    lo = run_policy(Workload.of(trace), small_spec(), COST, "least-loaded", Slo(), speedup=1.0)[0]
    hi = run_policy(Workload.of(trace), small_spec(), COST, "least-loaded", Slo(), speedup=20.0)[0]
    assert hi.ttft_p90_ms > lo.ttft_p90_ms


def test_an_unbounded_pool_reaches_the_oracle() -> None:
    trace = synthetic_trace(200)
    # widely spaced arrivals: every earlier prefill has finished, so every earlier block is cached
    spaced = [TraceRequest(r.index, r.index * 60_000.0, r.input_tokens, r.output_tokens, r.block_ids) for r in trace]
    s, _ = run_policy(Workload.of(spaced), small_spec(pool_blocks=None), COST, "least-loaded", Slo())
    assert s.oracle_fraction == pytest.approx(1.0)
    assert s.hit_rate == pytest.approx(oracle_hit_rate(spaced)[0])


def test_trace_lines_with_missing_or_bad_fields_are_clear_errors() -> None:
    good = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
    assert parse_trace_lines([json.dumps(good)])[0].block_ids == (1, 2)
    for bad, msg in [
        ({k: v for k, v in good.items() if k != "hash_ids"}, "missing field"),
        ({**good, "input_length": -3}, "input_length"),
        ({**good, "hash_ids": "x"}, "hash_ids"),
    ]:
        with pytest.raises(InvalidArgument, match=msg):
            parse_trace_lines([json.dumps(good), json.dumps(bad)])
    with pytest.raises(InvalidArgument, match="earlier"):
        parse_trace_lines([json.dumps({**good, "timestamp": 5}), json.dumps(good)])
    with pytest.raises(InvalidArgument, match="not JSON"):
        parse_trace_lines(["{"])


def test_synthesised_tokens_and_hashes_are_a_function_of_the_id() -> None:
    a = synth_block_tokens(np.array([7, 8]), 512)
    assert a.shape == (2, 512) and a.dtype == np.uint32
    np.testing.assert_array_equal(a[0], synth_block_tokens(np.array([7]), 512)[0])
    assert not np.array_equal(a[0], a[1])
    h1, h2 = TraceHasher(), TraceHasher()
    x = h1.hashes([0, 1, 2])
    assert h2.hashes([0, 1]) == x[:2] and h2.hashes([0, 1, 2]) == x
    assert len(set(x)) == 3 and all(len(h) == 16 for h in x)
    assert h1.hashes([0, 5])[0] == x[0] and h1.hashes([0, 5])[1] not in x


def test_lru_and_index_stay_in_step() -> None:
    idx = LocationIndex(2)
    lru = LruCache(2, on_leave=lambda h: idx.remove(h, 0))
    for h in (b"a" * 16, b"b" * 16, b"c" * 16):
        lru.insert(h)
        idx.add(h, 0)
    assert b"a" * 16 not in lru and not idx.holds(b"a" * 16, 0) and len(lru) == 2
    lru.touch(b"b" * 16)
    lru.insert(b"d" * 16)
    assert b"c" * 16 not in lru and b"b" * 16 in lru


@pytest.mark.slow
@pytest.mark.skipif(not TRACE.exists(), reason="shared trace not present")
def test_lru_over_the_real_trace_matches_the_published_figures() -> None:
    from kvpool.scheduler.trace import load_trace

    trace = load_trace(TRACE)
    assert oracle_hit_rate(trace)[0] == pytest.approx(0.366, abs=0.001)
    hasher = TraceHasher()
    lru = LruCache(20_000)
    hits = total = 0
    for r in trace:
        hs = hasher.hashes(r.block_ids)
        k = 0
        for h in hs:
            if h not in lru:
                break
            k += 1
        hits += k
        total += len(hs)
        for h in hs:
            lru.insert(h)
    assert hits / total == pytest.approx(0.288, abs=0.002)  # data/README.md: C=20,000 -> 28.8%


def test_cost_model_shapes() -> None:
    m = COST
    assert m.kv_bytes_per_token == 80 * 2 * 8 * 128 * 2
    assert m.prefill_ms(0, 100) == 0.0
    assert m.prefill_ms(8192, 0) > 2 * m.prefill_ms(4096, 0)  # attention is superlinear
    assert m.prefill_ms(512, 8192) < m.prefill_ms(8704, 0)  # a cached prefix saves time
    assert m.decode_step_ms(32, 400_000) > m.decode_step_ms(32, 40_000) > m.decode_step_ms(1, 1000)
    assert transfer_ms(0, 1e9) == 0.0 and transfer_ms(1e9, 1e9, 1.0) == pytest.approx(1001.0)
    assert get_preset("llama3-70b-h800x8").prefill_ms(8192) < m.prefill_ms(8192)
    with pytest.raises(InvalidArgument):
        get_preset("nope")
    assert set(PRESETS) >= {"llama3-70b-a800x8", "llama3-70b-h800x8"}


def test_fit_recovers_known_coefficients(tmp_path: pathlib.Path) -> None:
    m = COST
    rows = []
    for new in (128, 512, 2048, 4096):
        for cached in (0, 1024, 8192):
            rows.append(
                {"kind": "prefill", "new_tokens": new, "cached_tokens": cached, "ms": float(m.prefill_ms(new, cached))}
            )
    for b in (1, 8, 32):
        for ctx in (1000, 50_000, 300_000):
            rows.append({"kind": "decode", "batch": b, "context_tokens": ctx, "ms": float(m.decode_step_ms(b, ctx))})
    f = fit(rows, name="fitted", source="test", kv_bytes_per_token=m.kv_bytes_per_token)
    for new, cached in ((1000, 3000), (6000, 0)):
        assert f.prefill_ms(new, cached) == pytest.approx(m.prefill_ms(new, cached), rel=1e-6)
    assert f.decode_step_ms(16, 100_000) == pytest.approx(m.decode_step_ms(16, 100_000), rel=1e-6)
    path = tmp_path / "cm.json"
    path.write_text(json.dumps(f.to_dict()))
    assert load_cost_model(str(path)) == f
    with pytest.raises(InvalidArgument, match="need >= 3"):
        fit(rows[:2], name="x", source="x", kv_bytes_per_token=1)
    with pytest.raises(InvalidArgument, match="lacks field"):
        fit([{"kind": "prefill", "ms": 1.0}], name="x", source="x", kv_bytes_per_token=1)


def test_goodput_search_finds_the_knee() -> None:
    best, probes = goodput_search(lambda s: 1.0 if s <= 3.0 else 0.5, lo=0.5, hi=16.0, steps=8)
    assert best == pytest.approx(3.0, rel=0.02) and probes
    assert goodput_search(lambda s: 0.0, lo=0.5)[0] == 0.0
