"""kv-centric's compiled decision path picks exactly what the numpy reference path picks.

``KvCentricPolicy.decide`` runs ``scheduler/kv_centric_kernel.py`` (numba) with the prefix lengths
written into a reused buffer; ``decide_reference`` is the numpy path (``predicted_tpot_ms``,
``plan_ttft_vector``'s sparse and dense forms, the occupancy term). On random clusters, cost
models, loads, NIC queues, index contents and requests, both return the same ``Decision``
(instances, hit, predicted TTFT / TPOT bit for bit, rejection, hot blocks). Loads are drawn from a
few values so that ties (first minimum wins) are common.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.scheduler import kv_centric_kernel
from kvpool.scheduler.cluster import ClusterSpec, ClusterState, RouteRequest, Slo
from kvpool.scheduler.cost_model import get_preset
from kvpool.scheduler.index import LocationIndex
from kvpool.scheduler.policy_kv_centric import KvCentricPolicy

H = [bytes([i, j]) * 8 for i in range(4) for j in range(30)]  # 4 chains of 30 blocks
TIMES = st.sampled_from([0.0, 10.0, 250.0, 1000.0, 4000.0, 1e5])


@st.composite
def cases(draw: st.DrawFn) -> tuple[ClusterState, RouteRequest, dict[str, float | bool]]:
    spec = ClusterSpec(
        num_prefill=draw(st.integers(1, 14)),  # > 8 holders possible
        num_decode=draw(st.integers(1, 5)),
        num_remote_prefill=draw(st.integers(0, 2)),
        pool_blocks=draw(st.sampled_from([0, None, 1000])),
        peer_fetch=draw(st.booleans()),
        nic_contention=draw(st.booleans()),
        pool_bandwidth_bytes_per_s=draw(st.sampled_from([1e9, 100e9])),
        block_tokens=draw(st.sampled_from([16, 512])),
    )
    hetero = draw(st.booleans())
    roles = {"prefill": get_preset("llama3-70b-h800x8")} if hetero else None
    state = ClusterState(spec, get_preset("llama3-70b-a800x8"), role_costs=roles)
    n = spec.num_instances
    state.now_ms = draw(TIMES)
    state.busy_until_ms[:] = draw(st.lists(TIMES, min_size=n, max_size=n))
    state.nic_in_busy_until_ms[:] = draw(st.lists(TIMES, min_size=n + 1, max_size=n + 1))
    state.nic_out_busy_until_ms[:] = draw(st.lists(TIMES, min_size=n + 1, max_size=n + 1))
    state.decode_active[:] = draw(st.lists(st.sampled_from([0, 1, 8]), min_size=n, max_size=n))
    state.decode_context_tokens[:] = draw(st.lists(st.sampled_from([0, 1000, 50_000]), min_size=n, max_size=n))
    chain = draw(st.integers(0, 3))  # the request's
    for _ in range(draw(st.integers(0, 30))):  # (chain, member, prefix length)
        chain, member, length = draw(st.integers(0, 3)), draw(st.integers(0, n)), draw(st.integers(1, 30))
        state.index.add_many(H[chain * 30 : chain * 30 + length], member)
    if draw(st.booleans()):  # a prefix on most prefill instances: the dense branch (> 8 holders)
        for m in range(spec.num_prefill):
            state.index.add_many(H[chain * 30 : chain * 30 + draw(st.integers(1, 30))], m)
    hashes = H[chain * 30 : chain * 30 + draw(st.integers(0, 30))] + [b"x" * 16] * draw(st.integers(0, 2))
    input_tokens = max(1, len(hashes) * spec.block_tokens - draw(st.integers(0, spec.block_tokens - 1)))
    slo = Slo(draw(st.sampled_from([10.0, 1e4, 1e9])), draw(st.sampled_from([20.0, 1e9])))
    req = RouteRequest(hashes, input_tokens, draw(st.integers(1, 2000)), slo)
    knobs = {"weight": draw(st.sampled_from([0.0, 1.0, 3.0])), "reject": draw(st.booleans())}
    return state, req, knobs


def _pair(knobs: dict[str, float | bool]) -> tuple[KvCentricPolicy, KvCentricPolicy]:
    w, reject = float(knobs["weight"]), bool(knobs["reject"])
    kw = {"occupancy_weight": w, "reject": reject, "hot_threshold": 1}
    return KvCentricPolicy(**kw), KvCentricPolicy(**kw)  # type: ignore[arg-type]


def _use_python_kernel(policy: KvCentricPolicy, state: ClusterState) -> None:
    """Make ``policy.decide`` run the kernel's function uncompiled on ``state``."""
    policy._kernel, policy._kernel_state = kv_centric_kernel.python_kernel(), state
    policy._prm = kv_centric_kernel.static_params(state)
    policy._lens = np.zeros(state.index.num_members, dtype=np.int64)


@settings(max_examples=400, deadline=None)
@given(cases())
def test_compiled_path_decides_like_the_reference(case: tuple[ClusterState, RouteRequest, dict]) -> None:
    if kv_centric_kernel.load() is None:
        pytest.skip("numba is not installed: decide() is the reference path")
    state, req, knobs = case
    fast, ref = _pair(knobs)
    assert fast.decide(req, state) == ref.decide_reference(req, state)
    assert fast.decide(req, state) == ref.decide_reference(req, state)  # buffers reset between calls
    assert not fast._lens.any()


@settings(max_examples=150, deadline=None)
@given(cases())
def test_uncompiled_kernel_decides_like_the_reference(case: tuple[ClusterState, RouteRequest, dict]) -> None:
    """The same function run by the interpreter (what numba compiles; also the fallback's twin)."""
    state, req, knobs = case
    fast, ref = _pair(knobs)
    _use_python_kernel(fast, state)
    assert fast.decide(req, state) == ref.decide_reference(req, state)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 69), st.integers(1, 30)), max_size=40),
    st.integers(0, 3),
    st.integers(0, 32),
)
def test_prefix_lengths_into_matches_prefix_lengths(adds: list[tuple[int, int, int]], chain: int, n: int) -> None:
    idx = LocationIndex(70)
    for c, m, length in adds:
        idx.add_many(H[c * 30 : c * 30 + length], m)
    hashes = H[chain * 30 : chain * 30 + min(n, 30)] + [b"y" * 16] * max(0, n - 30)
    out = np.zeros(70, dtype=np.int64)
    written = idx.prefix_lengths_into(hashes, out)
    assert (out == idx.prefix_lengths(hashes)[0]).all()
    idx.reset_lengths(out, written)
    assert not out.any()


@pytest.mark.parametrize("weight", [0.0, 3.0])
@pytest.mark.parametrize("kernel", ["compiled", "python"])
def test_dense_branch_fetch_matches_the_reference(weight: float, kernel: str) -> None:
    """> 8 holders, the idle one holds least: it fetches the rest from the longest peer (the dense form)."""
    if kernel == "compiled" and kv_centric_kernel.load() is None:
        pytest.skip("numba is not installed")
    spec = ClusterSpec(num_prefill=12, num_decode=2, pool_blocks=0, peer_fetch=True)
    state = ClusterState(spec, get_preset("llama3-70b-a800x8"))
    for m in range(12):
        state.index.add_many(H[: 1 + (m % 3)], m)
    state.index.add_many(H[:28], 0)
    state.busy_until_ms[:12] = 60_000.0
    state.busy_until_ms[5] = 0.0
    req = RouteRequest(H[:30], 30 * 512, 100)
    fast, ref = KvCentricPolicy(occupancy_weight=weight), KvCentricPolicy(occupancy_weight=weight)
    if kernel == "python":
        _use_python_kernel(fast, state)
    want = ref.decide_reference(req, state)
    assert want.prefill_member == 5 and want.expected_hit_blocks == 28  # the fetch won
    assert fast.decide(req, state) == want


@settings(max_examples=200, deadline=None)
@given(st.integers(-5, 200_000), st.integers(0, 200_000), st.sampled_from(["llama3-70b-a800x8", "llama3-8b-a100x1"]))
def test_scalar_prefill_ms_equals_the_array_form(new: int, cached: int, preset: str) -> None:
    """``CostModel.prefill_ms``'s int fast path (the router charges every placement with it) is the
    numpy form's value exactly."""
    cost = get_preset(preset)
    assert cost.prefill_ms(new, cached) == float(cost.prefill_ms(np.array([new]), np.array([cached]))[0])
