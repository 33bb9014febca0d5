"""Replay a request trace through scheduler policies (discrete-event simulation).

Synthesises tokens per trace block id so the real hashing and index code run, then
simulates a P prefill + D decode cluster (optionally a remote prefill cluster behind
a bandwidth-limited link) with per-instance HBM/DRAM caches and a global pool, all
LRU. Time comes from the cost model, never the wall clock: a fixed seed gives
identical results. Prints a table per policy (hit rate local / pool / peer and its
fraction of the infinite-cache oracle, recomputed tokens, TTFT / TPOT percentiles,
SLO attainment, KV bytes moved, rejections, decision time); --json for machines;
--plots DIR for PNGs; --goodput to search the highest rate meeting the SLOs.

Without --trace it replays the first 2000 requests of Mooncake's conversation trace, which
ship with kvpool (scheduler/data/); pass --trace for a whole trace.

example:
  kvpool sim --limit 2000 --policy kv-centric,least-loaded,dynamo
  kvpool sim --trace ../shared/data/conversation_trace.jsonl --policy kv-centric,sglang --speedup 1.5
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

#: shipped with the package: the first 2000 requests of Mooncake's conversation trace
BUNDLED_TRACE = "conversation_trace_head2000.jsonl"


def _bundled_path() -> str:
    """The trace slice that ships in the package (kvpool.scheduler's data)."""
    from importlib import resources

    return str(resources.files("kvpool.scheduler") / "data" / BUNDLED_TRACE)


def _pool_tokens(text: str) -> int | None:
    if text.lower() in ("inf", "none", "unbounded"):
        return None
    value = int(float(text))
    if value < 0:
        raise argparse.ArgumentTypeError("pool capacity must be >= 0 tokens or 'inf'")
    return value


def _finite(obj: object) -> object:
    """JSON has no inf / nan: an infinite P90 (more than 10% rejected) or an empty percentile becomes null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        default=None,
        help="Mooncake-format JSONL trace (default: the 2000-request slice of the conversation trace that ships "
        "with kvpool)",
    )
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument(
        "--policy",
        default="all-pd",
        help="comma list of policies, 'all-pd' (every P+D policy) or 'all' (default: %(default)s)",
    )
    parser.add_argument("--prefill", type=int, default=8, help="prefill instances (default: %(default)s)")
    parser.add_argument("--decode", type=int, default=4, help="decode instances (default: %(default)s)")
    parser.add_argument("--remote-prefill", type=int, default=0, help="remote prefill instances (default: 0)")
    parser.add_argument("--hbm-blocks", type=int, default=2_000, help="per-instance HBM cache, 512-token blocks")
    parser.add_argument("--dram-blocks", type=int, default=8_000, help="per-instance DRAM cache, 512-token blocks")
    parser.add_argument(
        "--pool-tokens",
        type=_pool_tokens,
        default=50_000_000,
        help="global pool capacity in tokens, or 'inf' (default: 50M)",
    )
    parser.add_argument(
        "--eviction", default="lru", help="eviction policy of the pool and DRAM tiers (kvpool.storage.eviction names)"
    )
    parser.add_argument("--decode-kv-tokens", type=int, default=1_200_000, help="KV tokens a decode instance holds")
    parser.add_argument("--pool-gbps", type=float, default=800.0, help="instance <-> pool RDMA Gbit/s (default 800)")
    parser.add_argument("--remote-link-gbps", type=float, default=100.0, help="link to remote prefill, Gbit/s")
    parser.add_argument("--cost-model", default="llama3-70b-a800x8", help="preset name or fitted JSON file")
    parser.add_argument("--ttft-slo-ms", type=float, default=10_000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=100.0)
    parser.add_argument("--speedup", type=float, default=1.0, help="compress arrival times by this factor (load)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput", action="store_true", help="also search each policy's goodput (many replays)")
    parser.add_argument("--plots", metavar="DIR", help="write ttft_cdf.png (and goodput_vs_rate.png) to DIR")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    from kvpool.core.errors import KVPoolError
    from kvpool.scheduler.cluster import ClusterSpec, Slo
    from kvpool.scheduler.cost_model import load_cost_model
    from kvpool.scheduler.metrics import format_table
    from kvpool.scheduler.policies import PD_POLICIES, policy_names
    from kvpool.scheduler.runner import Workload, goodput, run_policy
    from kvpool.scheduler.trace import load_trace

    trace = args.trace or _bundled_path()
    if not pathlib.Path(trace).is_file():
        print(
            f"kvpool sim: trace {trace} not found; pass --trace PATH (a Mooncake-format JSONL trace, e.g. "
            "conversation_trace.jsonl from github.com/kvcache-ai/Mooncake)",
            file=sys.stderr,
        )
        return 2
    args.trace = trace
    try:
        if args.policy == "all-pd":
            names = list(PD_POLICIES)
        elif args.policy == "all":
            names = policy_names()
        else:
            names = [p.strip() for p in args.policy.split(",") if p.strip()]
        spec = ClusterSpec(
            num_prefill=args.prefill,
            num_decode=args.decode,
            num_remote_prefill=args.remote_prefill,
            hbm_blocks=args.hbm_blocks,
            dram_blocks=args.dram_blocks,
            pool_blocks=None if args.pool_tokens is None else args.pool_tokens // 512,
            decode_kv_capacity_tokens=args.decode_kv_tokens,
            eviction=args.eviction,
            pool_bandwidth_bytes_per_s=args.pool_gbps * 1e9 / 8,
            remote_link_bandwidth_bytes_per_s=args.remote_link_gbps * 1e9 / 8,
        )
        cost = load_cost_model(args.cost_model)
        slo = Slo(args.ttft_slo_ms, args.tpot_slo_ms)
        work = Workload.of(load_trace(args.trace, args.limit))
        progress = not args.no_progress
        rows, outs, goodputs = [], {}, {}
        for name in names:
            summary, out = run_policy(
                work, spec, cost, name, slo, speedup=args.speedup, seed=args.seed, progress=progress
            )
            rows.append(summary)
            outs[name] = out
            if args.goodput:
                goodputs[name] = goodput(work, spec, cost, name, slo, seed=args.seed, progress=progress)
    except KVPoolError as exc:
        print(f"kvpool sim: {exc}", file=sys.stderr)
        return 2
    if args.plots:
        from kvpool.scheduler import plots

        out_dir = pathlib.Path(args.plots)
        out_dir.mkdir(parents=True, exist_ok=True)
        plots.ttft_cdf(out_dir / "ttft_cdf.png", {n: o.ttft_ms for n, o in outs.items()}, slo.ttft_ms)
        if goodputs:
            plots.goodput_vs_rate(out_dir / "goodput_vs_rate.png", {n: g[1] for n, g in goodputs.items()})
    if args.json:
        doc = {
            "trace": args.trace,
            "requests": len(work.trace),
            "cluster": spec.__dict__,
            "cost_model": cost.to_dict(),
            "slo": slo.__dict__,
            "results": [r.to_dict() for r in rows],
            "goodput_rps": {n: g[0] for n, g in goodputs.items()},
        }
        print(json.dumps(_finite(doc), indent=1, default=str, allow_nan=False))
    else:
        print(format_table(rows))
        for name, (rps, _) in goodputs.items():
            print(f"goodput {name}: {rps:.2f} req/s")
    return 0
