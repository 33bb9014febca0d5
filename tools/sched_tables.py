"""Markdown tables for docs/scheduler.md from tools/bench_sched.py's JSON (so the page's figures
are regenerated, not retyped).

    .venv/bin/python tools/sched_tables.py [out/bench_sched.json] > /tmp/tables.md

Prints one section per measured part (regime, workloads, paas, goodput, capacity, decision);
the prose around them in docs/scheduler.md is written by hand.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

HEADER = (
    "| policy | hit | /oracle | rej (req) | rej (input tok) | TTFT mean | p50 | p90 | p99 | TPOT p90 | SLO ok |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def _row(r: dict[str, Any]) -> str:
    return (
        f"| {r['policy']} | {r['hit_rate']:.1%} | {r['oracle_fraction']:.1%} | {r['rejected']} "
        f"| {r['rejected_token_share']:.1%} | {r['ttft_mean_ms']:,.0f} | {r['ttft_p50_ms']:,.0f} "
        f"| {r['ttft_p90_ms']:,.0f} | {r['ttft_p99_ms']:,.0f} | {r['tpot_p90_ms']:.1f} | {r['slo_attainment']:.1%} |"
    )


def table(rows: list[dict[str, Any]]) -> str:
    return "\n".join([HEADER, *(_row(r) for r in rows)])


def verdict(t: dict[str, Any]) -> str:
    """The target sentence above a regime table (positive = kv-centric-noreject is faster)."""
    return (
        f"kv-centric-noreject mean TTFT **{t['vs_least_loaded']:.1%} below least-loaded**, "
        f"**{t['vs_best_other']:.1%} below the best other policy ({t['best_other']})**; SLO attainment "
        f"{t['kv_slo_attainment']:.1%} vs {t['least_loaded_slo_attainment']:.1%} (least-loaded) and "
        f"{t['best_other_slo_attainment']:.1%} ({t['best_other']})."
    )


def regime(res: dict[str, Any], title: str = "") -> str:
    parts = []
    for key, v in res.items():
        parts.append(f"#### {title}{key}\n\n{verdict(v['targets'])}\n\n{table(v['rows'])}\n")
    return "\n".join(parts)


def goodput(res: dict[str, Any], target: str) -> str:
    lines = [f"| policy | goodput @{target} req/s | probes (req/s: attainment) |", "|---|---|---|"]
    for p, v in res.items():
        probes = ", ".join(f"{s:.2f}: {a:.1%}" for s, a in v["probes"])
        lines.append(f"| {p} | {v['goodput_rps']:.2f} | {probes} |")
    return "\n".join(lines)


def capacity(res: dict[str, Any]) -> str:
    pols = list(res["ttft_mean_ms"])
    lines = ["| global pool | " + " | ".join(pols) + " |", "|---" * (len(pols) + 1) + "|"]
    for i, c in enumerate(res["capacities_tokens"]):
        label = {0: "0 (nodes' DRAM only)", None: "unbounded"}.get(c, f"{(c or 0) / 1e6:g}M tokens")
        cells = [f"{res['ttft_mean_ms'][p][i]:,.0f} ms ({res['hit_rate'][p][i]:.1%} hit)" for p in pols]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decision(res: dict[str, Any]) -> str:
    """Wall and CPU-time percentiles per pass (medians over passes), and the p99 of each request's
    fastest pass (``min_cpu_p99_us``; absent in runs before it was measured)."""
    lines = [
        "| policy | wall p50 us | wall p99 us | CPU p50 us | CPU p99 us | CPU p99, each request's best pass |",
        "|---|---|---|---|---|---|",
    ]
    for p, v in res.items():
        if p in ("index", "machine"):
            continue
        cells = [v["p50_us"], v["p99_us"], v.get("cpu_p50_us"), v["cpu_p99_us"], v.get("min_cpu_p99_us")]
        lines.append(f"| {p} | " + " | ".join("-" if c is None else f"{c:.0f}" for c in cells) + " |")
    if "machine" in res:
        m = res["machine"]
        lines.append(
            f"\n({m['utc']} UTC, {m['cpus']:.0f} CPUs, load average {m['load_before'][0]:.1f} before, "
            f"{m['load_after'][0]:.1f} after)"
        )
    return "\n".join(lines)


def main() -> int:
    path = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "out/bench_sched.json")
    rep = json.loads(path.read_text())
    for key in ("regime_local", "regime_peers"):
        if key in rep:
            print(f"### {key}\n\n{regime(rep[key])}")
    for key in ("workloads_regime", "workloads_local"):
        for kind, res in rep.get(key, {}).items():
            print(f"### workload {kind}\n\n{regime(res, f'{kind}, ')}")
    paas = rep.get("paas", {})
    for model in ("dense", "hybrid"):  # tools/paas_bench.py: {model: {"<workload>_x<speed-up>": rows}}
        for key, rows in paas.get(model, {}).items():  # each row's policy names its remote share
            print(f"#### PaaS {model}, {key}\n\n{table(rows)}\n")
    if paas.get("hybrid_goodput"):
        print(f"#### PaaS hybrid goodput\n\n{goodput(paas['hybrid_goodput'], '90%')}\n")
    if "goodput" in rep:
        print(f"### goodput\n\n{goodput(rep['goodput'], '90%')}\n")
    if "goodput_local" in rep:
        print(f"### goodput local-only\n\n{goodput(rep['goodput_local'], '90%')}\n")
    if "goodput_agent_local" in rep:
        print(f"### goodput agent local-only\n\n{goodput(rep['goodput_agent_local'], '90%')}\n")
    if "goodput_80" in rep:
        print(f"### goodput 80\n\n{goodput(rep['goodput_80'], '80%')}\n")
    if "capacity" in rep:
        print(f"### capacity\n\n{capacity(rep['capacity'])}\n")
    if "capacity_local" in rep:
        print(f"### capacity local-only\n\n{capacity(rep['capacity_local'])}\n")
    if "decision" in rep:
        print(f"### decision\n\n{decision(rep['decision'])}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
