"""The simulator's physics, one mechanism per test: when a decode-local prefill stalls the
decodes, how much KV reaches the decode node, when a block becomes visible in the pool,
chunked vs stalling local prefill, and that the vectorised prediction equals the scalar
plan the simulator executes."""

from __future__ import annotations

import numpy as np

from kvpool.scheduler.cluster import ClusterSpec, ClusterState, Decision, RouteRequest, Slo
from kvpool.scheduler.cost_model import get_preset, transfer_ms
from kvpool.scheduler.policy_base import Policy
from kvpool.scheduler.runner import Workload
from kvpool.scheduler.simulator import Simulator
from kvpool.scheduler.trace import TraceRequest

COST = get_preset("llama3-70b-a800x8")
SLO = Slo(1e9, 1e9)


class Scripted(Policy):
    """Places request i where ``script[i]`` says: (kind, prefill member, decode member)."""

    name = "scripted"

    def __init__(self, script: list[tuple[str, int, int]]) -> None:
        self.script = script

    def decide(self, req: RouteRequest, state: ClusterState) -> Decision:
        kind, p, d = self.script[req.request_id]
        return Decision(kind, p, d)  # type: ignore[arg-type]


def replay(spec: ClusterSpec, trace: list[TraceRequest], script: list[tuple[str, int, int]]) -> Simulator:
    sim = Simulator(spec, COST, Scripted(script), SLO, hasher=Workload.of(trace).hasher, check_every=1)
    sim.run(trace)
    return sim


def req(i: int, t_ms: float, ids: tuple[int, ...], out: int = 100) -> TraceRequest:
    return TraceRequest(i, t_ms, len(ids) * 512, out, ids)


def test_a_decode_admitted_during_a_local_prefill_starts_after_it() -> None:
    spec = ClusterSpec(num_prefill=1, num_decode=1, hbm_blocks=0, dram_blocks=0, pool_blocks=0, peer_fetch=False)
    x = req(0, 0.0, tuple(range(4)), out=50)  # prefilled on the prefill instance, joins the decode node at tx
    tx_ms = COST.prefill_ms(2048, 0) + float(transfer_ms(2048 * COST.kv_bytes_per_token, 100e9, 0.05))
    y = req(1, tx_ms - 100.0, tuple(range(100, 120)), out=5)  # a long local prefill covering tx
    sim = replay(spec, [x, y], [("instance", 0, 1), ("decode_local", 1, 1)])
    out = sim.out
    y_end_ms = y.arrival_ms + COST.prefill_ms(y.input_tokens, 0)
    assert abs(out.ttft_ms[0] - tx_ms) < 1e-6  # its first token came from the prefill instance
    tpot = COST.decode_step_ms(1, x.input_tokens + 25)
    assert abs(out.finish_ms[0] - (y_end_ms + 49 * tpot)) < 1e-6  # generation resumes when y's prefill ends
    assert out.max_pause_ms[0] == 0.0  # it was admitted into the pause, not interrupted by it


def test_running_decodes_are_stalled_when_the_local_prefill_starts() -> None:
    spec = ClusterSpec(num_prefill=0, num_decode=1, hbm_blocks=0, dram_blocks=0, pool_blocks=0, peer_fetch=False)
    a = req(0, 0.0, (1, 2), out=400)
    a_join = COST.prefill_ms(1024, 0)
    b = req(1, a_join + 10.0, (5, 6, 7, 8, 9, 10), out=2)
    sim = replay(spec, [a, b], [("decode_local", 0, 0), ("decode_local", 0, 0)])
    tpot = COST.decode_step_ms(1, 1024 + 200)
    stall = COST.prefill_ms(b.input_tokens, 0)
    assert abs(sim.out.finish_ms[0] - (a_join + 399 * tpot + stall)) < 1e-6
    assert abs(sim.out.max_pause_ms[0] - stall) < 1e-6


def test_chunked_local_prefill_costs_running_decodes_less_and_itself_more() -> None:
    r = RouteRequest([bytes([i]) * 16 for i in range(24)], 24 * 512, 100, SLO)
    plans = {}
    for mode in ("stall", "chunked"):
        spec = ClusterSpec(num_prefill=0, num_decode=1, decode_prefill_mode=mode, chunk_tokens=2048)  # type: ignore[arg-type]
        st = ClusterState(spec, COST)
        st.decode_active[0], st.decode_context_tokens[0] = 32, 200_000
        plans[mode] = st.plan_prefill(r, 0, st.prefix_lengths(r.hashes), 0)
    assert plans["chunked"].stall_ms < plans["stall"].stall_ms
    assert plans["chunked"].prefill_ms > plans["stall"].prefill_ms
    assert plans["stall"].stall_ms == plans["stall"].prefill_ms


def test_the_decode_node_receives_the_whole_prefix_minus_what_it_holds() -> None:
    spec = ClusterSpec(num_prefill=0, num_decode=2, num_remote_prefill=1, pool_blocks=0)
    st = ClusterState(spec, COST)
    hashes = [bytes([i]) * 16 for i in range(10)]
    st.index.add_many(hashes[:6], 2)  # the remote instance holds 6 blocks, decode 0 none, decode 1 three
    st.index.add_many(hashes[:3], 1)
    r = RouteRequest(hashes, 10 * 512, 10, SLO)
    lens = st.prefix_lengths(hashes)
    p0 = st.plan_prefill(r, 2, lens, 0)
    assert p0.new_tokens == 4 * 512 and p0.to_decode_bytes == 10 * 512 * COST.kv_bytes_per_token
    p1 = st.plan_prefill(r, 2, lens, 1)
    assert p1.to_decode_bytes == 7 * 512 * COST.kv_bytes_per_token


def test_a_transfer_takes_the_decode_nic_only_once_its_prefill_is_done() -> None:
    """A long prefill's KV transfer must not hold the decode node's ingress during its prefill:
    a short request decided after it, ready first, crosses first (the NIC is FIFO in ready order)."""
    spec = ClusterSpec(num_prefill=2, num_decode=1, hbm_blocks=0, dram_blocks=0, pool_blocks=0, peer_fetch=False)
    long_req = req(0, 0.0, tuple(range(60)))  # ~30K tokens: seconds of prefill
    short = req(1, 1.0, (1000, 1001))
    sim = replay(spec, [long_req, short], [("instance", 0, 2), ("instance", 1, 2)])
    bytes_per_token = COST.kv_bytes_per_token
    short_tx = float(transfer_ms(short.input_tokens * bytes_per_token, 100e9, 0.05))
    short_done = 1.0 + COST.prefill_ms(short.input_tokens, 0)
    assert abs(sim.out.ttft_ms[1] - (short_done + short_tx - 1.0)) < 1e-6
    assert abs(sim.out.send_start_ms[1] - short_done) < 1e-6
    long_done = COST.prefill_ms(long_req.input_tokens, 0)
    long_tx = float(transfer_ms(long_req.input_tokens * bytes_per_token, 100e9, 0.05))
    assert abs(sim.out.ttft_ms[0] - (long_done + long_tx)) < 1e-6  # the short one's transfer was long over


def test_transfers_ready_together_queue_on_the_decode_nic() -> None:
    """Two prefills done at the same time on two nodes: the second transfer waits for the first."""
    spec = ClusterSpec(num_prefill=2, num_decode=1, hbm_blocks=0, dram_blocks=0, pool_blocks=0, peer_fetch=False)
    a, b = req(0, 0.0, tuple(range(8))), req(1, 0.0, tuple(range(100, 108)))
    sim = replay(spec, [a, b], [("instance", 0, 2), ("instance", 1, 2)])
    done = COST.prefill_ms(a.input_tokens, 0)
    tx = float(transfer_ms(a.input_tokens * COST.kv_bytes_per_token, 100e9, 0.05))
    assert sorted(sim.out.ttft_ms.tolist()) == [done + tx, done + 2 * tx]


def test_a_block_is_in_the_pool_only_once_its_write_has_arrived() -> None:
    spec = ClusterSpec(num_prefill=2, num_decode=1, hbm_blocks=0, dram_blocks=0, pool_blocks=1000, peer_fetch=False)
    ids = tuple(range(40))
    done_ms = COST.prefill_ms(40 * 512, 0)
    write_ms = float(transfer_ms(40 * 512 * COST.kv_bytes_per_token, 100e9, 0.05))
    trace = [req(0, 0.0, ids), req(1, done_ms + write_ms / 2, ids), req(2, done_ms + write_ms + 1.0, ids)]
    sim = replay(spec, trace, [("instance", 0, 2), ("instance", 1, 2), ("instance", 1, 2)])
    assert list(sim.out.hit_pool) == [0, 0, 40]


def test_the_vectorised_prediction_equals_the_scalar_plan() -> None:
    rng = np.random.default_rng(3)
    for trial in range(300):
        sparse = trial % 3 == 0  # few holders among many members: the per-holder scalar path
        spec = ClusterSpec(
            num_prefill=24 if sparse else 4,
            num_decode=2,
            pool_blocks=[0, 100][trial % 2],
            peer_fetch=bool(trial % 3),
            nic_contention=bool(trial % 5),
        )
        st = ClusterState(spec, COST)
        st.now_ms = 1000.0
        hashes = [rng.bytes(16) for _ in range(int(rng.integers(1, 30)))]
        for m in range(spec.num_instances + 1):
            if not sparse or rng.random() < 0.15:
                st.index.add_many(hashes[: int(rng.integers(0, len(hashes) + 1))], m)
        st.busy_until_ms[:] = rng.uniform(0, 8000, spec.num_instances)
        st.nic_in_busy_until_ms[:] = rng.uniform(0, 5000, spec.num_instances + 1)
        st.nic_out_busy_until_ms[:] = rng.uniform(0, 5000, spec.num_instances + 1)
        r = RouteRequest(hashes, len(hashes) * 512 - int(rng.integers(0, 400)), 50, SLO)
        lens = st.prefix_lengths(hashes)
        for d in st.decode_arr:
            ttft, hit = st.plan_ttft_vector(r, st.prefill_arr, lens, int(d))
            for k, m in enumerate(st.prefill_arr):
                plan = st.plan_prefill(r, int(m), lens, int(d))
                assert abs(plan.ttft_ms - ttft[k]) < 1e-6 and plan.hit_blocks == hit[k], (trial, m, d)
