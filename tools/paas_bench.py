"""Prefill-as-a-Service on heterogeneous hardware (part ``paas`` of tools/bench_sched.py).

Two models, because whether a remote prefill pays depends on how many KV bytes each prefill FLOP
leaves behind (what crosses the link):

* **LLaMA3-70B** (dense attention, 320 KiB KV/token): ``hetero`` = a local PD cluster of 4 prefill
  nodes of 8x H800 (compute-dense) + 4 decode nodes of 8x H20 (bandwidth-rich) + a remote prefill
  cluster of 4x (8x H800) behind the cross-cluster link; policy ``paas`` uses both;
* **Qwen3-Next-80B-A3B** (hybrid attention, 24 KiB KV/token + 37.7 MiB linear state per request):
  ``hetero`` = the shape of Qin et al. 2026 (arXiv 2604.15039): a local PD cluster of 8x H20 nodes
  (4 prefill + 4 decode, 64 GPUs) + a remote prefill cluster of 4x (8x H200, 32 GPUs);

each against the same local cluster alone (``no remote``: what the remote cluster adds) and against
homogeneous PD clusters built from the decode-class part (all H20) and from the compute-dense part
(all H800 / H200), at equal GPU count (12 nodes) and at equal cost under the *assumptions* that an
H20 node costs half an H800 node (``H20_PRICE_RATIO``) and an H200 node as much as an H800 node
(``H200_PRICE_RATIO``); no vendor price list is published -- change them and rerun. Homogeneous
clusters use kv-centric without rejection (the best local policy in part ``regime``); P:D of a
homogeneous cluster is 7:3 (``split_pd``: 30% decode nodes rounded up; not tuned per cluster).

Loads: the conversation trace at two speed-ups per model (its own rate is 3.40 req/s), the
docqa workload (long uncached documents, ``scheduler/workloads.py`` defaults) for the hybrid model,
links of 100 and 25 Gbit/s (10 ms); ``[N% remote]`` = share of served requests prefilled remotely.
Goodput (highest rate with >= 90% of all requests inside both SLOs, ``metrics.goodput_search``) for
the hybrid model's clusters on the conversation trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import Any

from kvpool.scheduler.cluster import ClusterSpec, ClusterState, Decision, RouteRequest, Slo
from kvpool.scheduler.cost_model import CostModel
from kvpool.scheduler.hardware import NodePreset, cluster_from_preset, get_node_preset
from kvpool.scheduler.metrics import Summary, format_table, goodput_search
from kvpool.scheduler.policy_paas import PaasPolicy
from kvpool.scheduler.runner import Workload, run_policy
from kvpool.scheduler.workloads import generate, workload_spec

H800 = get_node_preset("llama3-70b-h800x8")
H20 = get_node_preset("llama3-70b-h20x8")
Q_H20 = get_node_preset("qwen3-next-80b-h20x8")
Q_H200 = get_node_preset("qwen3-next-80b-h200x8")
H20_PRICE_RATIO = 0.5  # assumption: one H20 node costs half an H800 node
H200_PRICE_RATIO = 1.0  # assumption: one H200 node costs as much as an H800 node
SLO = Slo(10_000.0, 100.0)
LINK_LATENCY_MS = 10.0
_HOMO = "kv-centric-noreject"
_PAAS_BEFORE = "paas, link as before"  # the ablation of the link-backlog fix (issue #14 item 4)
_WORK: dict[str, Workload] = {}  # filled before the worker pool forks


class PaasLinkAsBefore(PaasPolicy):
    """``paas`` pricing the remote link as before the fix: only the transfer on the link, not the ones
    placed behind remote prefills that are still queued or running (for the before / after rows)."""

    def decide(self, req: RouteRequest, state: ClusterState) -> Decision:
        pending, state.link_pending = state.link_pending, []
        try:
            return super().decide(req, state)
        finally:
            state.link_pending = pending


@dataclass(frozen=True)
class Job:
    """One replay: a cluster, the node preset of each role, a policy, a load."""

    label: str
    workload: str
    spec: ClusterSpec
    prefill: NodePreset
    decode: NodePreset
    remote: NodePreset
    policy: str
    speedup: float
    link_gbps: float = 100.0

    def roles(self) -> dict[str, CostModel]:
        return {
            "prefill": self.prefill.cost_model(),
            "decode": self.decode.cost_model(),
            "remote": self.remote.cost_model(),
        }


def hetero(
    local_p: NodePreset,
    decode: NodePreset,
    remote: NodePreset,
    num_remote: int = 4,
    link_gbps: float = 100.0,
    num_prefill: int = 4,
    num_decode: int = 4,
) -> ClusterSpec:
    """Local PD (capacities of the prefill part; the decode nodes' KV budget from theirs) + remote prefill."""
    return cluster_from_preset(
        local_p,
        num_prefill=num_prefill,
        num_decode=num_decode,
        num_remote_prefill=num_remote,
        peer_fetch=True,
        decode_kv_capacity_tokens=decode.kv_capacity_tokens(),
        remote_link_bandwidth_bytes_per_s=link_gbps * 1e9 / 8,
        remote_link_latency_ms=LINK_LATENCY_MS,
    )


def homo(node: NodePreset, num_prefill: int, num_decode: int) -> ClusterSpec:
    return cluster_from_preset(node, num_prefill=num_prefill, num_decode=num_decode, peer_fetch=True)


def split_pd(nodes: int) -> tuple[int, int]:
    """(prefill, decode) nodes of a homogeneous cluster: 30% decode, rounded up (12 -> 8P+4D)."""
    decode = math.ceil(0.3 * nodes)
    return nodes - decode, decode


def homo_row(name: str, node: NodePreset, nodes: int, what: str) -> tuple[str, ClusterSpec]:
    p, d = split_pd(nodes)
    return f"{name} {p}P+{d}D ({what})", homo(node, p, d)


def dense_jobs(speedups: tuple[float, ...]) -> list[Job]:
    """LLaMA3-70B: hetero = 8 H800 + 4 H20 nodes; its cost in H800 nodes sets the equal-cost clusters."""
    budget = 8 + 4 * H20_PRICE_RATIO
    homos = [
        (*homo_row("H800", H800, 12, "equal GPUs"), H800),
        (*homo_row("H800", H800, round(budget), "equal cost"), H800),
        (*homo_row("H20", H20, 12, "equal GPUs"), H20),
        (*homo_row("H20", H20, round(budget / H20_PRICE_RATIO), "equal cost"), H20),
    ]
    jobs: list[Job] = []
    for s in speedups:
        jobs += [
            Job("hetero paas", "conversation", hetero(H800, H20, H800), H800, H20, H800, "paas", s),
            Job("hetero, no remote", "conversation", hetero(H800, H20, H800, 0), H800, H20, H800, "paas", s),
        ]
        jobs += [Job(label, "conversation", spec, n, n, n, _HOMO, s) for label, spec, n in homos]
    slow = hetero(H800, H20, H800, link_gbps=25.0)
    for pol in ("paas", _PAAS_BEFORE):
        jobs.append(Job(f"hetero {pol}, 25 Gbps", "conversation", slow, H800, H20, H800, pol, 4.0, 25.0))
    return jobs


def hybrid_clusters(link_gbps: float = 100.0) -> list[tuple[str, ClusterSpec, NodePreset, NodePreset, NodePreset, str]]:
    """Qwen3-Next: hetero = 8 H20 + 4 H200 nodes (8 H800 at the default price ratios = 16 H20 = 8 H200)."""
    budget = 8 * H20_PRICE_RATIO + 4 * H200_PRICE_RATIO  # in H800 nodes
    rows: list[tuple[str, ClusterSpec, NodePreset, NodePreset, NodePreset, str]] = [
        ("hetero paas", hetero(Q_H20, Q_H20, Q_H200, link_gbps=link_gbps), Q_H20, Q_H20, Q_H200, "paas"),
        ("hetero, no remote", hetero(Q_H20, Q_H20, Q_H200, 0), Q_H20, Q_H20, Q_H200, "paas"),
    ]
    for name, node, ratio in (("H20", Q_H20, H20_PRICE_RATIO), ("H200", Q_H200, H200_PRICE_RATIO)):
        for nodes, what in ((12, "equal GPUs"), (round(budget / ratio), "equal cost")):
            label, spec = homo_row(name, node, nodes, what)
            rows.append((label, spec, node, node, node, _HOMO))
    return rows


def hybrid_jobs(workload: str, speedups: tuple[float, ...], slow_link_gbps: float = 25.0) -> list[Job]:
    """Every hybrid cluster at each load, and hetero behind the slow link, with the fix and without."""
    jobs: list[Job] = []
    slow = hetero(Q_H20, Q_H20, Q_H200, link_gbps=slow_link_gbps)
    for s in speedups:
        for label, spec, p, d, r, pol in hybrid_clusters():
            jobs.append(Job(label, workload, spec, p, d, r, pol, s))
        for pol in ("paas", _PAAS_BEFORE):
            label = f"hetero {pol}, {slow_link_gbps:g} Gbps"
            jobs.append(Job(label, workload, slow, Q_H20, Q_H20, Q_H200, pol, s, slow_link_gbps))
    return jobs


def _run(job: Job) -> tuple[Summary, float]:
    policy = PaasLinkAsBefore() if job.policy == _PAAS_BEFORE else job.policy
    s, out = run_policy(
        _WORK[job.workload],
        job.spec,
        job.prefill.cost_model(),
        policy,
        SLO,
        speedup=job.speedup,
        role_costs=job.roles(),
    )
    remote_share = float((out.prefill_kind == 2).sum()) / max(1, int((~out.rejected).sum()))
    print(f"{job.workload} {job.label} x{job.speedup:g}: remote share {remote_share:.1%}", file=sys.stderr, flush=True)
    return dataclasses.replace(s, policy=f"{job.label} [{remote_share:.0%} remote]"), remote_share


def _goodput(job: Job, lo: float, steps: int) -> tuple[float, list[tuple[float, float]]]:
    """Goodput in req/s and the probes (req/s, attainment), by the bench's own search."""

    def attainment(speedup: float) -> float:
        return _run(dataclasses.replace(job, speedup=speedup))[0].slo_attainment

    best, probes = goodput_search(attainment, lo=lo, hi=64.0, steps=steps)
    r = _WORK[job.workload].base_rate_rps
    return best * r, [(p * r, a) for p, a in probes]


def _goodput_star(args: tuple[Job, float, int]) -> tuple[float, list[tuple[float, float]]]:
    return _goodput(*args)


def _prepare(works: dict[str, Workload]) -> None:
    _WORK.update(works)
    for w in works.values():
        w.prehash()


def _tables(title: str, jobs: list[Job], rows: list[tuple[Summary, float]]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for key in sorted({(j.workload, j.speedup) for j in jobs}, key=lambda k: (k[0], k[1])):
        sub = [r for r, j in zip(rows, jobs) if (j.workload, j.speedup) == key]
        rate = _WORK[key[0]].base_rate_rps * key[1]
        print(f"\n== {title}, {key[0]} x{key[1]:g} ({rate:.2f} req/s) ==")
        print(format_table([s for s, _ in sub]))
        res[f"{key[0]}_x{key[1]:g}"] = [{**s.to_dict(), "remote_share": share} for s, share in sub]
    return res


def part_paas(
    work: Workload,
    n_jobs: int = 2,
    dense_speedups: tuple[float, ...] = (2.0, 4.0),
    hybrid_speedups: tuple[float, ...] = (15.0, 20.0),
    docqa_speedups: tuple[float, ...] = (32.0, 64.0),
    goodput_lo: float = 5.0,
    goodput_steps: int = 3,
) -> dict[str, Any]:
    """Every table of docs/scheduler.md's PaaS section (and their timings)."""
    _prepare({"conversation": work, "docqa": Workload.of(generate(workload_spec("docqa")))})
    res: dict[str, Any] = {"started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    t0 = time.monotonic()
    dense = dense_jobs(dense_speedups)
    hyb = hybrid_jobs("conversation", hybrid_speedups) + hybrid_jobs("docqa", docqa_speedups)
    gp_jobs = [Job(label, "conversation", spec, p, d, r, pol, 1.0) for label, spec, p, d, r, pol in hybrid_clusters()]
    slow = hetero(Q_H20, Q_H20, Q_H200, link_gbps=25.0)
    for pol in ("paas", _PAAS_BEFORE):
        gp_jobs.append(Job(f"hetero {pol}, 25 Gbps", "conversation", slow, Q_H20, Q_H20, Q_H200, pol, 1.0, 25.0))
    with multiprocessing.get_context("fork").Pool(max(1, n_jobs)) as pool:
        rows = pool.map(_run, dense + hyb, chunksize=1)
        res["replays_s"] = time.monotonic() - t0
        gps = pool.map(_goodput_star, [(j, goodput_lo, goodput_steps) for j in gp_jobs], chunksize=1)
    res["total_s"] = time.monotonic() - t0
    res["dense"] = _tables("PaaS, LLaMA3-70B", dense, rows[: len(dense)])
    res["hybrid"] = _tables("PaaS, Qwen3-Next-80B-A3B", hyb, rows[len(dense) :])
    print("\n== PaaS goodput @90%, Qwen3-Next-80B-A3B, conversation ==")
    res["hybrid_goodput"] = {}
    for j, (g, probes) in zip(gp_jobs, gps):
        shown = ", ".join(f"{rps:.1f}: {a:.1%}" for rps, a in probes)
        print(f"| {j.label} | {g:.1f} | {shown} |")
        res["hybrid_goodput"][j.label] = {"goodput_rps": g, "probes": probes}
    print(f"\npaas part: replays {res['replays_s']:.0f} s, total {res['total_s']:.0f} s", file=sys.stderr)
    return res


def plot(res: dict[str, Any], directory: pathlib.Path) -> pathlib.Path:
    """SLO attainment against request rate for each hybrid cluster (the goodput searches' probes)."""
    from kvpool.scheduler.plots import goodput_vs_rate

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "sched_paas_hybrid_goodput.png"
    goodput_vs_rate(path, {k: [tuple(p) for p in v["probes"]] for k, v in res["hybrid_goodput"].items()})
    return path


def main() -> int:
    """Run the part alone (the same as ``tools/bench_sched.py --parts paas``, without the other workloads)."""
    from kvpool.scheduler.trace import load_trace

    root = pathlib.Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(root.parent / "shared" / "data" / "conversation_trace.jsonl"))
    ap.add_argument("--out", default=str(root / "out" / "paas_bench.json"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--plots", default="", help="directory for the goodput PNG (e.g. docs/img)")
    ap.add_argument("--replot", default="", help="only draw the PNG from a saved --out JSON (no replays)")
    args = ap.parse_args()
    if args.replot:
        res = json.loads(pathlib.Path(args.replot).read_text())["paas"]
    else:
        res = part_paas(Workload.of(load_trace(args.trace)), args.jobs)
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"paas": res}, indent=1, default=str))
    if args.plots:
        print(f"wrote {plot(res, pathlib.Path(args.plots))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
