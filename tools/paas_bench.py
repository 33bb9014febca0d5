"""Prefill-as-a-Service on heterogeneous hardware (part ``paas`` of tools/bench_sched.py).

Clusters (LLaMA3-70B everywhere, so KV moves between any two instances):

* ``hetero``: a local PD cluster of 4 prefill nodes (8x H800, compute-dense) + 4 decode
  nodes (8x H20, bandwidth-rich), plus a remote prefill cluster of 4x (8x H800) behind a
  cross-cluster link (default 100 Gbit/s, 10 ms); policy ``paas`` uses both;
* ``hetero, no remote``: the same local cluster alone (what the remote cluster adds);
* ``homogeneous, equal GPUs``: 8 prefill + 4 decode nodes of 8x H800 (12 nodes, 96 GPUs);
* ``homogeneous, equal cost``: 7 prefill + 3 decode nodes of 8x H800, under the *assumption*
  that an H20 node costs half an H800 node (``H20_PRICE_RATIO``; no price list is published
  by the vendor -- change it and rerun);

plus a link sweep of ``hetero``. Homogeneous clusters use kv-centric without rejection
(the best local policy in part ``regime``).
"""

from __future__ import annotations

import multiprocessing
import sys
from typing import Any

from kvpool.scheduler.cluster import ClusterSpec, Slo
from kvpool.scheduler.hardware import cluster_from_preset, get_node_preset
from kvpool.scheduler.metrics import Summary, format_table
from kvpool.scheduler.runner import Workload, run_policy

H800 = get_node_preset("llama3-70b-h800x8")
H20 = get_node_preset("llama3-70b-h20x8")
H20_PRICE_RATIO = 0.5  # assumption: one H20 node costs half an H800 node
SLO = Slo(10_000.0, 100.0)
_WORK: list[Workload] = []


def hetero_spec(num_remote: int = 4, link_gbps: float = 100.0, latency_ms: float = 10.0) -> ClusterSpec:
    return cluster_from_preset(
        H800,
        num_prefill=4,
        num_decode=4,
        num_remote_prefill=num_remote,
        peer_fetch=True,
        decode_kv_capacity_tokens=H20.kv_capacity_tokens(),
        remote_link_bandwidth_bytes_per_s=link_gbps * 1e9 / 8,
        remote_link_latency_ms=latency_ms,
    )


def homo_spec(num_prefill: int, num_decode: int) -> ClusterSpec:
    return cluster_from_preset(H800, num_prefill=num_prefill, num_decode=num_decode, peer_fetch=True)


def _run(job: tuple[str, ClusterSpec, str, float, bool]) -> Summary:
    label, spec, policy, speedup, hetero = job
    roles = {"prefill": H800.cost_model(), "remote": H800.cost_model(), "decode": H20.cost_model()} if hetero else None
    s, out = run_policy(_WORK[0], spec, H800.cost_model(), policy, SLO, speedup=speedup, role_costs=roles)
    remote_share = float((out.prefill_kind == 2).sum()) / max(1, int((~out.rejected).sum()))
    print(f"{label} x{speedup:g}: remote share {remote_share:.1%}", file=sys.stderr, flush=True)
    return s.__class__(**{**s.to_dict(), "policy": f"{label} [{remote_share:.0%} remote]"})


def part_paas(work: Workload, n_jobs: int = 2, speedups: tuple[float, ...] = (2.0, 4.0)) -> dict[str, Any]:
    _WORK[:] = [work]
    jobs: list[tuple[str, ClusterSpec, str, float, bool]] = []
    for s in speedups:
        jobs += [
            ("hetero paas", hetero_spec(), "paas", s, True),
            ("hetero, no remote", hetero_spec(num_remote=0), "paas", s, True),
            ("homogeneous 8P+4D (equal GPUs)", homo_spec(8, 4), "kv-centric-noreject", s, False),
            ("homogeneous 7P+3D (equal cost)", homo_spec(7, 3), "kv-centric-noreject", s, False),
        ]
    for gbps in (25.0,):
        jobs.append((f"hetero paas, link {gbps:g} Gbps", hetero_spec(link_gbps=gbps), "paas", 4.0, True))
    with multiprocessing.get_context("fork").Pool(max(1, n_jobs)) as pool:
        rows = pool.map(_run, jobs, chunksize=1)
    res: dict[str, Any] = {}
    for s in speedups:
        sub = [r for r, j in zip(rows, jobs) if j[3] == s and "link" not in j[0]]
        print(f"\n== PaaS x{s:g} (conversation trace) ==")
        print(format_table(sub))
        res[f"x{s:g}"] = [r.to_dict() for r in sub]
    sweep = [r for r, j in zip(rows, jobs) if "link" in j[0]]
    print("\n== PaaS link sweep x4 ==")
    print(format_table(sweep))
    res["link_sweep_x4"] = [r.to_dict() for r in sweep]
    return res
