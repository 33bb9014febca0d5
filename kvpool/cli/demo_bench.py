"""``kvpool demo bench``: the serving modes side by side on the same workloads, the same
engines and the same CPU cores (docs/demo.md).

Modes (reference engine, two engine processes each, one core each where there are two):

* ``colocated``: two engines that prefill and decode (continuous batching), no pool;
* ``colocated-chunked``: the same with chunked prefill: at most ``--chunk-tokens`` tokens
  per engine step, running decodes first (Sarathi / vLLM ``max_num_batched_tokens``);
* ``disagg``: one prefill + one decode instance, every prompt prefilled on the prefill
  instance and its KV moved through the pool, no reuse across requests;
* ``disagg-pool``: the same with prefix reuse and the cache-aware split of the router
  (short or well-cached prompts prefill on the decode instance).

Workloads: ``conversation``: whole conversations (requests sharing their first two
blocks) taken from ``conversation_trace.jsonl`` in trace order, one 512-token trace block
scaled to one 32-token pool block (so shared prefixes stay shared), output lengths scaled
the same way, arrivals re-spaced to ``--rate``; ``mixed``: short prompts with a few long
ones among them, Poisson arrivals. Each request is streamed through the front door; TTFT
and inter-token gaps are measured at the client.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.cli.demo_stack import REF_BLOCK_TOKENS, DemoConfig, start_stack
from kvpool.daemon.launcher import LocalCluster, free_port

MODES = ("colocated", "colocated-chunked", "disagg", "disagg-pool")
WORKLOADS = ("conversation", "mixed")
#: the whole trace where the project's data folder lies beside the checkout (../shared/data)
SHARED_TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "conversation_trace.jsonl"


def default_trace() -> str:
    """The shared folder's trace when it is there, else the first 2,000 requests of the same
    trace that ship in the package (``kvpool sim``'s), which hold the default 12 conversations."""
    if SHARED_TRACE.is_file():
        return str(SHARED_TRACE)
    from importlib import resources

    return str(resources.files("kvpool.scheduler") / "data" / "conversation_trace_head2000.jsonl")


TRACE_BLOCK_TOKENS = 512
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # reference model: 2 x layers x kv_heads x head_dim x float32
REQUEST_TIMEOUT_S = 600.0


def _positive(kind: type[int] | type[float]) -> Any:
    """An argparse type: a number above 0 (a rate or a count of 0 would divide by zero)."""

    def parse(text: str) -> int | float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("kvpool demo bench")
    g.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    g.add_argument("--workloads", default=",".join(WORKLOADS), help="conversation,mixed")
    g.add_argument(
        "--trace",
        default=default_trace(),
        help="Mooncake-format conversation trace (JSONL; default: ../shared/data/conversation_trace.jsonl "
        "beside the checkout, else the 2,000-request head that ships with kvpool)",
    )
    g.add_argument("--conversations", type=_positive(int), default=12, help="conversations taken from the trace")
    g.add_argument("--max-output-tokens", type=_positive(int), default=24, help="cap on scaled output lengths")
    g.add_argument("--requests", type=_positive(int), default=200, help="mixed workload: requests")
    g.add_argument("--long-tokens", type=_positive(int), default=768, help="mixed workload: long prompt length")
    g.add_argument("--long-every", type=_positive(int), default=3, help="mixed workload: one long prompt in this many")
    g.add_argument(
        "--mixed-rate",
        type=_positive(float),
        default=20.0,
        help="mixed workload: arrivals per second. Busy on purpose: a colocated engine stalls each of its "
        "decodes for one token gap per long prefill, so stalls reach a p99 of the token gaps only when long "
        "prompts per second per engine x the gap exceed 1 %% (docs/demo.md)",
    )
    g.add_argument("--rate", type=_positive(float), default=2.0, help="conversation workload: arrivals per second")
    g.add_argument("--chunk-tokens", type=_positive(int), default=128, help="chunk size of colocated-chunked")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", default="", help="directory for results.json and the PNG plots (default: --workdir)")


@dataclass(frozen=True)
class BenchRequest:
    arrival_s: float
    prompt: list[int]
    max_tokens: int


@dataclass
class Outcome:
    """What the client saw of one request."""

    arrival_s: float
    prompt_tokens: int
    sent_s: float = 0.0
    token_s: list[float] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    error: str = ""


# ---- workloads ---------------------------------------------------------------------------
def _block_tokens(block_id: int, n: int, salt: int) -> list[int]:
    rng = np.random.default_rng([block_id, salt])
    return [int(t) for t in rng.integers(4, 1024, size=n)]


def conversation_workload(
    path: str, conversations: int, max_output: int, rate: float, seed: int
) -> tuple[list[BenchRequest], int]:
    """The scaled slice and its oracle: prompt tokens that must be computed even if every
    block seen before (in any earlier request) were reused."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    groups: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        if len(r["hash_ids"]) > 1:
            groups[int(r["hash_ids"][1])].append(i)
    chosen = [g for g in groups.values() if len(g) >= 2][:conversations]
    picked = sorted(i for g in chosen for i in g)
    scale = REF_BLOCK_TOKENS / TRACE_BLOCK_TOKENS
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=len(picked))
    out, seen, oracle = [], set(), 0
    for k, i in enumerate(picked):
        r = rows[i]
        n = max(2, round(r["input_length"] * scale))
        ids = [int(h) for h in r["hash_ids"]]
        prompt: list[int] = []
        for h in ids:
            prompt += _block_tokens(h, REF_BLOCK_TOKENS, 0)
        prompt = prompt[:n] if len(prompt) >= n else prompt + _block_tokens(i, n - len(prompt), 1)
        full = n // REF_BLOCK_TOKENS
        reusable = 0
        while reusable < min(full, len(ids), (n - 1) // REF_BLOCK_TOKENS) and ids[reusable] in seen:
            reusable += 1
        seen.update(ids[:full])
        oracle += n - reusable * REF_BLOCK_TOKENS
        out_len = max(2, min(max_output, round(r["output_length"] * scale)))
        out.append(BenchRequest(float(gaps[: k + 1].sum()), prompt, out_len))
    return out, oracle


def mixed_workload(n: int, long_tokens: int, long_every: int, rate: float, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    for k in range(n):
        t += float(rng.exponential(1.0 / rate))
        length = long_tokens if k % long_every == long_every // 2 else int(rng.integers(32, 97))
        out.append(BenchRequest(t, [int(x) for x in rng.integers(4, 1024, size=length)], 32))
    return out


# ---- running -----------------------------------------------------------------------------
def mode_config(mode: str, listen: str, chunk_tokens: int, busy_local_prefill_tokens: int = 32) -> DemoConfig:
    base = DemoConfig(
        engine="ref", listen=listen, local_prefill_tokens=128, busy_local_prefill_tokens=busy_local_prefill_tokens
    )
    if mode.startswith("colocated"):
        return dataclasses.replace(
            base,
            num_prefill=0,
            num_decode=2,
            decode_role="both",
            route="local",
            use_pool=False,
            chunk_tokens=chunk_tokens if mode == "colocated-chunked" else 0,
            # chunked prefill bounds the whole step (decodes first, then prefill chunks), as
            # vLLM's max_num_batched_tokens does; a per-request chunk alone would not
            max_batch_tokens=chunk_tokens if mode == "colocated-chunked" else 0,
        )
    if mode == "disagg":
        return dataclasses.replace(base, route="remote", prefill_reuse=False)
    return base


def _one(port: int, req: BenchRequest, out: Outcome, t0: float) -> None:
    delay = t0 + req.arrival_s - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    out.sent_s = time.perf_counter() - t0
    body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True, "temperature": 0}
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = resp.read(2000).decode(errors="replace")
            return
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                out.error = str(event["error"])
                return
            now = time.perf_counter() - t0
            kv = event.get("kvpool") or {}
            out.token_s += [now] * len(kv.get("token_ids") or [])
            if event["choices"][0].get("finish_reason"):
                out.info = kv
    except (OSError, http.client.HTTPException) as exc:
        out.error = repr(exc)


def run_workload(port: int, requests: list[BenchRequest], label: str) -> list[Outcome]:
    outcomes = [Outcome(r.arrival_s, len(r.prompt)) for r in requests]
    t0 = time.perf_counter() + 0.2
    threads = [
        threading.Thread(target=_one, args=(port, r, o, t0), name=f"bench-{i}", daemon=True)
        for i, (r, o) in enumerate(zip(requests, outcomes, strict=True))
    ]
    for t in threads:
        t.start()
    for done, t in enumerate(threads, 1):  # a progress bar: requests finished, in order
        t.join(REQUEST_TIMEOUT_S)
        bar = "#" * (30 * done // len(threads))
        print(f"\r  {label:<34} [{bar:<30}] {done}/{len(threads)}", end="", file=sys.stderr)
    print(file=sys.stderr)
    return outcomes


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    a = np.asarray(values)
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}


def summarize(outcomes: list[Outcome], oracle_tokens: int | None) -> dict[str, Any]:
    ok = [o for o in outcomes if not o.error and o.token_s]
    ttft = [(o.token_s[0] - o.sent_s) * 1000 for o in ok]
    itl = [float(g) * 1000 for o in ok for g in np.diff(o.token_s)]
    prompt = sum(o.prompt_tokens for o in ok)
    loaded = sum(int(o.info.get("hit_tokens") or 0) for o in ok)  # by the decode instance
    # prompt tokens computed (where the prompt prefilled), and the decode instance's recompute
    # of the partial last block after a remote prefill (the handshake's overhead), apart
    remote = [o for o in ok if o.info.get("prefill") not in (None, "decode-local")]
    recomputed = sum(int(o.info.get("prefill_tokens_run") or 0) for o in ok if o not in remote)
    recomputed += sum(int(o.info.get("prefill_instance_tokens_run") or 0) for o in remote)
    tail = sum(int(o.info.get("prefill_tokens_run") or 0) for o in remote)
    # prefix hits where the prompt prefilled (the decode instance loading a remote prefill's
    # own KV back is a transfer, not a hit)
    hit = sum(int(o.info.get("hit_tokens") or 0) for o in ok if o not in remote)
    hit += sum(int(o.info.get("prefill_instance_hit_tokens") or 0) for o in remote)
    # bytes over the pool: blocks the prefill side stored + what the decode side loaded
    stored = sum(int(o.info.get("prefill_stored_blocks") or 0) for o in ok) * REF_BLOCK_TOKENS
    span = max((o.token_s[-1] for o in ok), default=0.0) - min((o.sent_s for o in ok), default=0.0)
    tokens = sum(len(o.token_s) for o in ok)
    out = {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(ok),
        "ttft_ms": _pct(ttft),
        "itl_ms": _pct(itl),
        "throughput_tokens_per_s": tokens / span if span > 0 else 0.0,
        "prompt_tokens": prompt,
        "hit_rate": hit / prompt if prompt else 0.0,
        "recomputed_tokens": recomputed,
        "recomputed_share": recomputed / prompt if prompt else 0.0,
        "decode_tail_recomputed_tokens": tail,
        "kv_bytes_moved": (stored + loaded) * KV_BYTES_PER_TOKEN,
        "local_prefills": sum(1 for o in ok if o.info.get("prefill") == "decode-local"),
        "errors": sorted({o.error for o in outcomes if o.error})[:3],
        "series": {
            "ttft_ms": ttft,
            "itl": [[float(t), float(g) * 1000] for o in ok for t, g in zip(o.token_s[1:], np.diff(o.token_s))],
        },
    }
    if oracle_tokens is not None:
        out["oracle_recomputed_tokens"] = oracle_tokens
        out["oracle_recomputed_share"] = oracle_tokens / prompt if prompt else 0.0
    return out


def run_bench(args: argparse.Namespace, cfg: DemoConfig, workdir: str) -> int:
    modes = [m for m in args.modes.split(",") if m]
    workloads = [w for w in args.workloads.split(",") if w]
    bad = [m for m in modes if m not in MODES] + [w for w in workloads if w not in WORKLOADS]
    if bad:
        print(f"kvpool demo bench: unknown mode or workload {bad}", file=sys.stderr)
        return 2
    loads: dict[str, tuple[list[BenchRequest], int | None]] = {}
    if "conversation" in workloads:
        reqs, oracle = conversation_workload(
            args.trace, args.conversations, args.max_output_tokens, args.rate, args.seed
        )
        loads["conversation"] = (reqs, oracle)
    if "mixed" in workloads:
        mixed = mixed_workload(args.requests, args.long_tokens, args.long_every, args.mixed_rate, args.seed)
        loads["mixed"] = (mixed, None)
    results: dict[str, dict[str, Any]] = {w: {} for w in loads}
    for mode in modes:
        port = free_port()
        mcfg = dataclasses.replace(
            mode_config(mode, f"127.0.0.1:{port}", args.chunk_tokens, args.busy_local_prefill_tokens), pin=cfg.pin
        )
        mode_dir = os.path.join(workdir, mode)
        os.makedirs(mode_dir, exist_ok=True)
        print(f"kvpool demo bench: {mode}: starting", file=sys.stderr, flush=True)
        with LocalCluster(mode_dir) as cluster:
            start_stack(cluster, mcfg)
            for name, (work, oracle_tokens) in loads.items():
                outcomes = run_workload(port, work, f"{mode} / {name}")
                results[name][mode] = summarize(outcomes, oracle_tokens)
    out_dir = args.out or workdir
    os.makedirs(out_dir, exist_ok=True)
    meta = {
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_1m_end": os.getloadavg()[0],  # other processes on the machine: say how busy it was
        "modes": modes,
        **{
            k: getattr(args, k)
            for k in ("rate", "mixed_rate", "seed", "conversations", "requests", "long_tokens", "long_every")
        },
        "chunk_tokens": args.chunk_tokens,
        "busy_local_prefill_tokens": args.busy_local_prefill_tokens,
    }
    (Path(out_dir) / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if args.json:
        print(json.dumps({"meta": meta, "results": strip_series(results)}))
    else:
        print(format_table(results))
    from kvpool.cli.demo_plots import plot_results

    for path in plot_results(results, out_dir):
        print(f"wrote {path}", file=sys.stderr)
    return 0 if all(r["failed"] == 0 for w in results.values() for r in w.values()) else 1


def strip_series(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {w: {m: {k: v for k, v in r.items() if k != "series"} for m, r in rs.items()} for w, rs in results.items()}


def format_table(results: dict[str, dict[str, Any]]) -> str:
    lines = []
    head = f"{'mode':<18} {'TTFT p50/p90/p99 ms':>22} {'ITL p50/p90/p99 ms':>20} {'tok/s':>7} {'hit':>5}"
    head += f" {'recomputed':>10} {'KV moved':>9} {'local':>5} {'fail':>4}"
    for workload, by_mode in results.items():
        lines += [f"\n{workload}", head]
        for mode, r in by_mode.items():
            t, i = r["ttft_ms"], r["itl_ms"]
            row = f"{mode:<18} {t['p50']:>6.0f} {t['p90']:>6.0f} {t['p99']:>7.0f} {i['p50']:>6.1f} {i['p90']:>6.1f}"
            row += f" {i['p99']:>6.1f} {r['throughput_tokens_per_s']:>7.1f} {r['hit_rate']:>5.0%}"
            row += f" {r['recomputed_tokens']:>10} {r['kv_bytes_moved'] / 2**20:>7.1f}Mi"
            row += f" {r['local_prefills']:>5} {r['failed']:>4}"
            lines.append(row)
        oracle = next((r.get("oracle_recomputed_tokens") for r in by_mode.values()), None)
        if oracle is not None:
            share = next(r.get("oracle_recomputed_share") for r in by_mode.values())
            lines.append(f"{'oracle':<18} recomputed if every reusable block were reused: {oracle} ({share:.0%})")
    return "\n".join(lines)
