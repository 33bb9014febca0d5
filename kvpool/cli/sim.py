"""Replay a request trace through scheduler policies (discrete-event simulation).

Synthesises tokens per trace block id so the real hashing and index code run, then
simulates a P prefill + D decode cluster (optionally a remote prefill cluster behind
a bandwidth-limited link) whose capacities and bandwidths come from a node preset
(--node-preset: HBM left for KV after weights and activations, host DRAM, NIC, PCIe).
Time comes from the cost model, never the wall clock: a fixed seed gives identical
results. Prints a table per policy (hit rate local / pool / peer and its fraction of
the infinite-cache oracle, rejected requests and input tokens, TTFT mean and
percentiles, TPOT, SLO attainment, KV bytes moved, decision time); --json for machines;
--plots DIR for PNGs; --goodput to search the highest rate meeting the SLOs;
--capacity-curve FILE.png to sweep the global pool's capacity (--capacity-tokens) and draw
each policy's mean TTFT against it (instead of the one table).

The trace is JSON lines, one request per line (docs/scheduler.md, "Trace format"):
  {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [block ids]}
or a generated workload: --workload agent|docqa|chat [--workload-opt KNOB=VALUE ...].
Without --trace or --workload it replays the first 2000 requests of Mooncake's conversation
trace, which ship with kvpool (scheduler/data/); pass --trace for a whole trace.

examples:
  kvpool sim --limit 2000 --policy kv-centric-noreject,least-loaded,dynamo
  kvpool sim --trace ../shared/data/conversation_trace.jsonl --policy kv-centric-noreject,dynamo --speedup 1.5
  kvpool sim --workload docqa --workload-opt requests=3000 --write-trace docqa.jsonl --no-peer-fetch
  kvpool sim --limit 2000 --speedup 1.5 --policy least-loaded,kv-centric-noreject --capacity-curve curve.png
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


def _workload_opts(items: list[str]) -> dict[str, object]:
    """``knob=value`` strings -> WorkloadSpec fields: ints, floats, or ``lo:hi`` ranges."""
    from kvpool.core.errors import InvalidArgument

    out: dict[str, object] = {}
    for item in items:
        for part in filter(None, item.split(",")):
            key, sep, text = part.partition("=")
            if not sep:
                raise InvalidArgument(f"--workload-opt {part!r} is not KNOB=VALUE")
            try:
                if ":" in text:
                    lo, hi = text.split(":", 1)
                    out[key.strip()] = (int(lo), int(hi))
                else:
                    out[key.strip()] = int(text) if text.strip().lstrip("-").isdigit() else float(text)
            except ValueError:
                raise InvalidArgument(f"--workload-opt {part!r}: {text!r} is not a number or lo:hi") from None
    return out


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
    parser.add_argument(
        "--workload",
        choices=("agent", "docqa", "chat"),
        help="replay a generated workload instead of --trace (knobs: --workload-opt, docs/scheduler.md)",
    )
    parser.add_argument(
        "--workload-opt",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="a WorkloadSpec field, e.g. requests=3000, rate_rps=2, zipf_a=1.3, turn_tokens=200:800 (repeatable)",
    )
    parser.add_argument("--write-trace", metavar="PATH", help="also write the (generated) trace as JSONL to PATH")
    parser.add_argument("--prefill", type=int, default=8, help="prefill instances (default: %(default)s)")
    parser.add_argument("--decode", type=int, default=4, help="decode instances (default: %(default)s)")
    parser.add_argument("--remote-prefill", type=int, default=0, help="remote prefill instances (default: 0)")
    parser.add_argument(
        "--node-preset",
        default="llama3-70b-a800x8",
        help="hardware of every instance: its cost model, HBM left for KV, host DRAM, NIC and PCIe "
        "(kvpool.scheduler.hardware; default: %(default)s)",
    )
    parser.add_argument("--hbm-blocks", type=int, help="per-instance HBM cache, 512-token blocks (default: preset)")
    parser.add_argument("--dram-blocks", type=int, help="per-instance DRAM cache, 512-token blocks (default: preset)")
    parser.add_argument(
        "--pool-tokens",
        type=_pool_tokens,
        default=0,
        help="global pool capacity in tokens, or 'inf' (default: 0, the nodes' DRAM tiers are the pool)",
    )
    parser.add_argument("--no-peer-fetch", action="store_true", help="instances cannot read each other's caches")
    parser.add_argument("--no-nic-contention", action="store_true", help="a contention-free network")
    parser.add_argument("--decode-prefill-mode", choices=("stall", "chunked"), default="stall")
    parser.add_argument("--chunk-tokens", type=int, default=2048, help="chunk size of --decode-prefill-mode chunked")
    parser.add_argument(
        "--eviction", default="lru", help="eviction policy of the pool and DRAM tiers (kvpool.storage.eviction names)"
    )
    parser.add_argument("--decode-kv-tokens", type=int, help="KV tokens a decode instance holds (default: preset)")
    parser.add_argument("--pool-gbps", type=float, help="per-instance RDMA NIC Gbit/s (default: preset)")
    parser.add_argument("--remote-link-gbps", type=float, default=100.0, help="link to remote prefill, Gbit/s")
    parser.add_argument("--cost-model", help="preset name or fitted JSON file (default: the node preset's)")
    parser.add_argument("--ttft-slo-ms", type=float, default=10_000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=100.0)
    parser.add_argument("--speedup", type=float, default=1.0, help="compress arrival times by this factor (load)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput", action="store_true", help="also search each policy's goodput (many replays)")
    parser.add_argument("--plots", metavar="DIR", help="write ttft_cdf.png (and goodput_vs_rate.png) to DIR")
    parser.add_argument(
        "--capacity-curve",
        metavar="FILE.png",
        help="replay every policy at each --capacity-tokens global pool capacity and draw mean TTFT against it "
        "to FILE.png (prints the curve's table instead of the one table; overrides --pool-tokens)",
    )
    parser.add_argument(
        "--capacity-tokens",
        default="0,10M,50M,inf",
        help="the capacities --capacity-curve sweeps, in tokens (K/M/G suffixes, inf = unbounded; default: "
        "%(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    from kvpool.core.errors import KVPoolError
    from kvpool.scheduler.cluster import Slo
    from kvpool.scheduler.cost_model import load_cost_model
    from kvpool.scheduler.hardware import cluster_from_preset, get_node_preset
    from kvpool.scheduler.metrics import format_table
    from kvpool.scheduler.policies import PD_POLICIES, policy_names
    from kvpool.scheduler.runner import Workload, goodput, run_policy
    from kvpool.scheduler.trace import load_trace
    from kvpool.scheduler.workloads import generate, to_jsonl, workload_spec

    trace_path = args.trace or _bundled_path()
    if not args.workload and not pathlib.Path(trace_path).is_file():
        print(
            f"kvpool sim: trace {trace_path} not found; pass --trace PATH (a Mooncake-format JSONL trace, e.g. "
            "conversation_trace.jsonl from github.com/kvcache-ai/Mooncake)",
            file=sys.stderr,
        )
        return 2
    args.trace = trace_path
    from kvpool.cli import sim_capacity

    try:
        capacities = sim_capacity.parse_capacities(args.capacity_tokens) if args.capacity_curve else []
    except ValueError as exc:
        print(f"kvpool sim: --capacity-tokens: {exc}", file=sys.stderr)
        return 2
    unwritable = _unwritable_outputs(args)  # before the replays, not after minutes of them
    if unwritable:
        print(f"kvpool sim: {unwritable}", file=sys.stderr)
        return 2
    try:
        if args.policy == "all-pd":
            names = list(PD_POLICIES)
        elif args.policy == "all":
            names = policy_names()
        else:
            names = [p.strip() for p in args.policy.split(",") if p.strip()]
        node = get_node_preset(args.node_preset)
        overrides: dict[str, object] = {
            "num_prefill": args.prefill,
            "num_decode": args.decode,
            "num_remote_prefill": args.remote_prefill,
            "pool_blocks": None if args.pool_tokens is None else args.pool_tokens // 512,
            "eviction": args.eviction,
            "peer_fetch": not args.no_peer_fetch,
            "nic_contention": not args.no_nic_contention,
            "decode_prefill_mode": args.decode_prefill_mode,
            "chunk_tokens": args.chunk_tokens,
            "remote_link_bandwidth_bytes_per_s": args.remote_link_gbps * 1e9 / 8,
        }
        for field, value in (
            ("hbm_blocks", args.hbm_blocks),
            ("dram_blocks", args.dram_blocks),
            ("decode_kv_capacity_tokens", args.decode_kv_tokens),
            ("pool_bandwidth_bytes_per_s", None if args.pool_gbps is None else args.pool_gbps * 1e9 / 8),
        ):
            if value is not None:
                overrides[field] = value
        spec = cluster_from_preset(node, **overrides)
        cost = node.cost_model() if args.cost_model is None else load_cost_model(args.cost_model)
        slo = Slo(args.ttft_slo_ms, args.tpot_slo_ms)
        if args.workload:
            trace = generate(workload_spec(args.workload, **_workload_opts(args.workload_opt)))
            trace = trace[: args.limit] if args.limit else trace
        else:
            trace = load_trace(args.trace, args.limit)
        if args.write_trace:
            pathlib.Path(args.write_trace).write_text(to_jsonl(trace))
        work = Workload.of(trace)
        progress = not args.no_progress
        rows, outs, goodputs = [], {}, {}
        if capacities:  # the sweep: capacity-major, every policy at each capacity
            sweep = []
            for cap in capacities:
                spec_at = cluster_from_preset(node, **{**overrides, "pool_blocks": None if cap is None else cap // 512})
                for name in names:
                    summary, _ = run_policy(
                        work, spec_at, cost, name, slo, speedup=args.speedup, seed=args.seed, progress=progress
                    )
                    sweep.append(summary)
            curve = sim_capacity.capacity_table(capacities, names, sweep)
            names = []  # no second replay of the one table
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
    if capacities:
        return _capacity_output(args, curve, len(work.trace))
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


def _capacity_output(args: argparse.Namespace, curve: dict[str, object], requests: int) -> int:
    from kvpool.cli import sim_capacity

    sim_capacity.plot(args.capacity_curve, curve)
    if args.json:
        doc = {"trace": args.trace, "requests": requests, "speedup": args.speedup, "capacity_curve": curve}
        print(json.dumps(_finite(doc), indent=1, default=str, allow_nan=False))
    else:
        print(sim_capacity.table_text(curve))
        print(f"capacity curve: {args.capacity_curve}")
    return 0


def _unwritable_outputs(args: argparse.Namespace) -> str:
    """Why --plots DIR / --capacity-curve FILE / --write-trace FILE cannot be written, or ""."""
    if args.plots:
        try:
            pathlib.Path(args.plots).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"--plots {args.plots}: cannot create the directory ({exc.strerror})"
    from kvpool.cli.paths import unwritable_file

    for flag, path in (("--capacity-curve", args.capacity_curve), ("--write-trace", args.write_trace)):
        problem = unwritable_file(flag, path) if path else ""
        if problem:
            return problem
    return ""
