"""kvpool inside real vLLM (vllm-cpu) against vLLM's own options, one run, one workload.

    .venv/bin/python tools/bench_vllm.py                 # all rows, ~10 minutes on 2 cores
    .venv/bin/python tools/bench_vllm.py --rows vllm-1,kvpool-2rr --json out.json

Every engine is a real vLLM ``LLM`` in its own process (``kvpool.connectors.vllm_testing``)
on a random-weight Llama sized so that a cold 2K-token prefill takes >= 200 ms on this CPU
(printed), fp32, vLLM's CPU attention backend (block size 128), prefix caching on.

Workload (the same requests for every row): conversations that share system prompts —
``--systems`` system prompts of 768 tokens, ``--convs`` conversations, ``--turns`` turns of
192 user + 64 assistant tokens each (turn k's prompt is turn k-1's prompt plus its reply and
the next user message). Each request is timed alone with ``max_tokens=1`` (its TTFT).

Rows:
* ``vllm-1``: vLLM alone, one instance (its own prefix cache sees every turn);
* ``vllm-2rr``: vLLM alone, two instances, turn k on instance k % 2 (a router without
  affinity): each instance misses what the other computed;
* ``kvpool-2rr``: the same two instances with the kvpool connector and one pool;
* ``example-2rr``: vLLM's ``ExampleConnector`` (safetensors files in a shared folder), the
  only connector vLLM ships that shares KV between instances and runs on CPU;
* ``offload-1``: vLLM's ``OffloadingConnector`` (CPU offload) on one instance, if it runs here;
* Mooncake's ``MooncakeStoreConnector`` is reported as not run when its master is missing;
* ``zero-hit``: the 0-hit cost, ABBA: two engines, vLLM alone and vLLM with kvpool, run the
  same ``--zero-prompts`` cold 2,560-token prompts one after the other, never at once, the
  first of each pair swapped every prompt, each after ``--settle-s`` of idle (the
  connector's commit and the daemon's work of the request before are done by then); then
  again on ``--zero-pairs`` fresh pairs of engines, with new prompts. Two engines of the same
  kind differ by several percent (0.95-1.14 per pair seen here), so one pair cannot show a
  3 % cost: the figure is the
  median over every prompt of every pair, with each pair's median (and its connector's own
  time per prompt, from the connector's counters) printed, and
  ``--zero-control`` pairs of two vLLM-alone engines on the same schedule print that floor
  in the same run (their "with / alone" is engine 2 / engine 1). Each kvpool engine then
  runs twice ``--zero-prompts`` more, in pairs with the pool and skipping it
  (``kv_transfer_params`` ``{"kvpool": "skip"}``), ABBA: the cost inside one engine process,
  free of the spread between engines (its vLLM-alone partner idles until then, so its
  shutdown does not run beside them).

Every engine computes on the same cores: vLLM's CPU backend binds its OpenMP threads to the
cores it does not reserve, and reserves one more when any KV connector is configured. On a
2-core host it cannot reserve two, so a connector row computed on both cores and a row
without one on one; the rows were not comparable. ``--reserved-cpus`` (1) is set for every
engine (``VLLM_CPU_NUM_OF_RESERVED_CPU``).

Targets (issue 9), against baselines of the same run:
* 0 hits (``zero-hit``): TTFT with kvpool <= 1.03x vLLM alone (median of the per-prompt
  ratios), and the connector's own time (lookup, load, gather, on that engine, all of whose
  prompts miss) at most 3 % of its time in generate calls;
* 90 % of the prompt in the pool (``kvpool-2rr``, loaded by the other instance): TTFT <= 0.3x
  cold;
* that pool hit costs <= 1.5x vLLM's own local prefix hit of the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_reuse import start_daemon  # tools/ is on sys.path when a tool runs as a script

from kvpool.connectors.vllm_testing import CONNECTOR_TIMES, connector_counters, make_tiny_model
from kvpool.daemon.cluster_local import free_port

REPO = Path(__file__).resolve().parents[1]
BLOCK = 128
#: The bench model: 4 layers, hidden 256, 4 heads of 64, 2 KV heads.
BENCH_MODEL = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4}
ROWS = ("zero-hit", "vllm-1", "vllm-2rr", "kvpool-2rr", "example-2rr", "offload-1", "mooncake-2rr")
ZERO_HIT = "zero-hit"
SKIP = {"kvpool": "skip"}  # kvpool.connectors.vllm_engine.SKIP_PARAMS (that module needs vLLM to import)
ENGINE_TIMEOUT_S = 900.0


# -- workload -------------------------------------------------------------------------------
def workload(seed: int, systems: int, convs: int, turns: int) -> list[list[list[int]]]:
    """turns[t] = the prompts of turn t, one per conversation."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(4, 2000) for _ in range(n)]

    sys_prompts = [ids(768) for _ in range(systems)]
    history = [list(sys_prompts[c % systems]) for c in range(convs)]
    out: list[list[list[int]]] = []
    for t in range(turns):
        this_turn = []
        for c in range(convs):
            if t:
                history[c] += ids(64)  # the previous reply
            history[c] += ids(192)  # the next user message
            this_turn.append(list(history[c]))
        out.append(this_turn)
    return out


def probes(seed: int, count: int, zero: int = 0, length: int = 2560, shared: int = 2304) -> dict[str, list[list[int]]]:
    """Target prompts: cold unique ones (``count``, and ``zero`` for the 0-hit pair), bases Q,
    Q90 (90 % of Q then new), Q90' (same 90 %, other tail)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(4, 2000) for _ in range(n)]

    bases = [ids(length) for _ in range(count)]
    return {
        "cold": [ids(length) for _ in range(count)],
        "zero": [ids(length) for _ in range(zero)],
        "base": bases,
        "q90": [b[:shared] + ids(length - shared) for b in bases],
        "q90_local": [b[:shared] + ids(length - shared) for b in bases],
    }


# -- engines --------------------------------------------------------------------------------
class Engine:
    def __init__(
        self, work: Path, name: str, model: Path, phases: list[dict[str, Any]], kv: dict | None, env: dict | None = None
    ) -> None:
        self.name, self.out, self.log = name, work / f"{name}.json", work / f"{name}.log"
        script = work / f"{name}.script.json"
        script.write_text(json.dumps({"phases": phases}))
        argv = [sys.executable, "-m", "kvpool.connectors.vllm_testing", "run", "--model", str(model)]
        argv += ["--script", str(script), "--out", str(self.out), "--max-model-len", "4096"]
        if kv is not None:
            argv += ["--kv-transfer-config", json.dumps(kv)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        self._fh = open(self.log, "wb")  # noqa: SIM115 (closed in result)
        self.proc = subprocess.Popen(argv, stdout=self._fh, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def done_marker(self, i: int) -> str:
        return f"{self.out}.phase{i}.done"

    def result(self) -> dict[str, Any] | str:
        try:
            code = self.proc.wait(ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = -9
        self._fh.close()
        if code != 0:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
            return f"exit {code}: " + " | ".join(line[-200:] for line in tail)
        return json.loads(self.out.read_text())  # type: ignore[no-any-return]


def phase(name: str, prompts: list[list[int]], wait_for: str = "") -> dict[str, Any]:
    return {"name": name, "prompts": prompts, "sequential": True, "max_tokens": 1, "wait_for": wait_for}


#: The first requests of a fresh engine are slow (one-time allocations, thread pools): every
#: engine serves these unrelated prompts first, outside every figure.
WARMUP = phase("warmup", [[5 + (i * 7919 + j) % 1990 for j in range(300 + 100 * i)] for i in range(4)])


def two_instance_phases(
    work: Path, row: str, turns: list[list[list[int]]], extra_a: list[dict[str, Any]], extra_b: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Turn t on instance t % 2; each phase waits for the other instance's previous one."""
    a: list[dict[str, Any]] = [WARMUP]
    b: list[dict[str, Any]] = [WARMUP]
    names = {"a": work / f"{row}-a.json", "b": work / f"{row}-b.json"}
    last = ""
    for t, prompts in enumerate(turns):
        mine, who = (a, "a") if t % 2 == 0 else (b, "b")
        mine.append(phase(f"turn{t}", prompts, last))
        last = f"{names[who]}.phase{len(mine) - 1}.done"
    # then the target probes: A stores the bases, B reads the 90 % prefixes, A its local 90 %
    a += extra_a
    b += [{**p, "wait_for": p["wait_for"] or f"{names['a']}.phase{len(a) - 1}.done"} for p in extra_b]
    return a, b


def zero_hit_phases(
    plain_out: Path, pool_out: Path, prompts: list[list[int]], own: list[list[int]], settle_s: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The 0-hit pair's scripts: prompt k runs on both engines (vLLM alone writing
    ``plain_out``, with kvpool ``pool_out``), one after the other, vLLM alone first for even k
    and second for odd k (ABBA: neither always runs right after the other's work). Each phase
    waits for the one before it in that order, then idles ``settle_s``; the first waits for
    both engines' warmup and a short untimed prompt after it, whose step brings the
    connector's counters up to date (they are written at most once a second).

    Then the kvpool engine alone runs ``own`` in pairs, ABBA again: ``own[2j]`` with the pool,
    ``own[2j + 1]`` with ``kv_transfer_params`` {"kvpool": "skip"} (the connector passes it
    through: no lookup, no save), the cost of the pool measured inside one engine process.
    The vLLM-alone engine idles until those are done (a last phase with no prompt): its
    shutdown, seconds of freeing memory, would run beside them."""
    sync = {**phase("sync", [list(range(5, 69))]), "settle_s": settle_s}  # 64 tokens: no whole block
    plain: list[dict[str, Any]] = [WARMUP, sync]
    pool: list[dict[str, Any]] = [WARMUP, sync]
    last = f"{pool_out}.phase1.done"  # the plain engine's own warmup and sync are its phases 0, 1
    for k, prompt in enumerate(prompts):
        pair = [(plain, plain_out), (pool, pool_out)]
        for phases, out in pair if k % 2 == 0 else pair[::-1]:
            phases.append({**phase(f"zero{k}", [prompt], last), "settle_s": settle_s})
            last = f"{out}.phase{len(phases) - 1}.done"
    for j in range(len(own) // 2):
        use = {**phase(f"use{j}", [own[2 * j]], last), "settle_s": settle_s}
        skip = {**phase(f"skip{j}", [own[2 * j + 1]], last), "settle_s": settle_s, "kv_transfer_params": SKIP}
        pool += [use, skip] if j % 2 == 0 else [skip, use]
        last = ""  # the rest follows in this engine's own order
    if len(pool) > len(plain):
        hold = phase("hold", [], f"{pool_out}.phase{len(pool) - 1}.done")
        plain.append({**hold, "wait_timeout_s": ENGINE_TIMEOUT_S})  # as long as the other engine may run
    return plain, pool


def connector_config(row: str, pool: str, shared_dir: Path, stats: Path) -> dict[str, Any] | None:
    if row.startswith("vllm"):
        return None
    if row.startswith("kvpool"):
        return {
            "kv_connector": "KvpoolConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "kvpool.connectors.vllm",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"pool_address": pool, "salt": "bench", "stats_path": str(stats)},
        }
    if row.startswith("example"):
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(shared_dir)},
        }
    if row.startswith("offload"):
        extra = {"cpu_bytes_to_use": 1 << 30}
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    return {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {},
    }


def start_mooncake(work: Path) -> tuple[subprocess.Popen[bytes] | None, dict[str, str]]:
    """Mooncake's master with its HTTP metadata server on loopback, and the MOONCAKE_CONFIG_PATH
    file vLLM's MooncakeStoreConnector reads (tcp transport: no RDMA here)."""
    binary = Path(sys.executable).parent / "mooncake_master"
    if not binary.exists():
        return None, {}
    rpc_port, http_port = free_port(), free_port()
    argv = [str(binary), "--rpc_address=127.0.0.1", f"--rpc_port={rpc_port}", "--enable_http_metadata_server=true"]
    argv += ["--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http_port}"]
    log = open(work / "mooncake-master.log", "wb")  # noqa: SIM115 (the process owns it)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    time.sleep(1.5)
    config = {
        "metadata_server": f"http://127.0.0.1:{http_port}/metadata",
        "master_server_address": f"127.0.0.1:{rpc_port}",
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": 1 << 30,
        "local_buffer_size": 256 << 20,
    }
    path = work / "mooncake.json"
    path.write_text(json.dumps(config))
    # VLLM_HOST_IP: the transfer engine advertises loopback, never this host's other addresses
    return proc, {"MOONCAKE_CONFIG_PATH": str(path), "VLLM_HOST_IP": "127.0.0.1"}


def ttfts(result: dict[str, Any], prefix: str) -> list[tuple[float, int, int]]:
    """(seconds, cached tokens, prompt index) of every request in phases named ``prefix*``."""
    return [
        (o["seconds"], o["cached"], i)
        for p in result["phases"]
        if p["name"].startswith(prefix)
        for i, o in enumerate(p["outputs"])
    ]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--systems", type=int, default=2)
    parser.add_argument("--convs", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--probes", type=int, default=3, help="prompts per target measurement")
    parser.add_argument("--zero-prompts", type=int, default=8, help="cold prompts per zero-hit pair of engines")
    parser.add_argument("--zero-pairs", type=int, default=3, help="zero-hit pairs of engines, one after another")
    parser.add_argument(
        "--zero-control", type=int, default=1, help="zero-hit pairs of two vLLM-alone engines (the noise floor)"
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=1.2,
        help="idle before each zero-hit prompt (over 1 s: the connector writes its counters at most once a second)",
    )
    parser.add_argument(
        "--reserved-cpus", type=int, default=1, help="cores each engine leaves to other processes (every row)"
    )
    parser.add_argument(
        "--arena-huge-pages",
        default="off",
        help="the pool daemon's option (thp: set shmem_enabled to advise first, docs/tiers.md)",
    )
    parser.add_argument("--json", default="", help="write every figure here")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, scripts)")
    args = parser.parse_args(argv)
    if ZERO_HIT in args.rows.split(",") and min(args.zero_prompts, args.zero_pairs) < 1:
        parser.error("the zero-hit row needs --zero-prompts and --zero-pairs of at least 1")
    if min(args.zero_control, args.reserved_cpus, args.probes) < 0 or args.settle_s < 0:
        parser.error("--zero-control, --reserved-cpus, --probes and --settle-s cannot be negative")
    work = Path(tempfile.mkdtemp(prefix="kvpool-bench-vllm-"))
    model = make_tiny_model(work / "bench-llama", **BENCH_MODEL)
    turns = workload(1, args.systems, args.convs, args.turns)
    # per pair: both engines' prompts, then the kvpool engine's use/skip pairs (a control
    # pair runs the prompts of the pair of its number)
    pr = probes(2, args.probes, 3 * args.zero_prompts * max(args.zero_pairs, args.zero_control))
    report: dict[str, Any] = {"rows": {}, "workload": {"requests": sum(len(t) for t in turns)}}
    report["reserved_cpus"] = args.reserved_cpus
    pool_proc, pool_addr, arena = start_daemon(1 << 30, "--arena-huge-pages", args.arena_huge_pages)
    report["arena_huge_pages"] = args.arena_huge_pages
    print(
        f"workload: {report['workload']['requests']} requests, prompts {len(turns[0][0])}..{len(turns[-1][0])} tokens; "
        f"every engine leaves {args.reserved_cpus} of {os.cpu_count()} cores to other processes; "
        f"the pool's arena: --arena-huge-pages {args.arena_huge_pages}"
    )
    try:
        for row in [r for r in args.rows.split(",") if r]:
            shared = work / f"{row}-shared"
            shared.mkdir()
            mooncake, env = start_mooncake(work) if row.startswith("mooncake") else (None, {})
            if row.startswith("mooncake") and mooncake is None:
                report["rows"][row] = {"error": "mooncake_master not installed (pip install 'kvpool[bench]')"}
                print(f"{row:>12}: not run: mooncake-transfer-engine-non-cuda is not installed")
                continue
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cpus)
            if row == ZERO_HIT:
                results = run_zero_hit(work, model, pool_addr, pr["zero"], env, args.zero_pairs, args)
                control = run_zero_hit(work, model, "", pr["zero"], env, args.zero_control, args)
            else:
                results = [e.result() for e in row_engines(row, work, model, pool_addr, turns, pr, env)]
            if mooncake is not None:
                mooncake.kill()
                mooncake.wait()
            failed = [r for r in results if isinstance(r, str)]
            if failed:
                report["rows"][row] = {"error": failed[0]}
                print(f"{row:>12}: not run: {failed[0][:300]}")
                continue
            if row == ZERO_HIT:
                report["rows"][row] = summarize_zero_hit(results)  # type: ignore[arg-type]
                print_zero_hit(report["rows"][row])
                if control and not any(isinstance(r, str) for r in control):
                    report["rows"][row]["control"] = summarize_zero_hit(control)  # type: ignore[arg-type]
                    print_zero_hit(report["rows"][row]["control"], "control")
                continue
            report["rows"][row] = summarize(row, results, work)  # type: ignore[arg-type]
            print_row(row, report["rows"][row])
    finally:
        pool_proc.terminate()
        pool_proc.wait(30)
        shutil.rmtree(arena, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work folder kept: {work}")
    print_targets(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def row_engines(
    row: str,
    work: Path,
    model: Path,
    pool_addr: str,
    turns: list[list[list[int]]],
    pr: dict[str, list[list[int]]],
    env: dict[str, str],
) -> list[Engine]:
    """Start the engines of ``row``, each with its script of phases (they run at once)."""
    shared = work / f"{row}-shared"
    kv = connector_config(row, pool_addr, shared, work / f"{row}-a-stats")
    kv_b = connector_config(row, pool_addr, shared, work / f"{row}-b-stats")
    cold = [phase("cold", pr["cold"])]
    if row.endswith("-1"):
        phases = [WARMUP] + [phase(f"turn{t}", p) for t, p in enumerate(turns)] + cold
        return [Engine(work, f"{row}-a", model, phases, kv, env)]
    extra_a = [*cold, phase("base", pr["base"]), phase("q90_local", pr["q90_local"])]
    extra_b = [phase("q90", pr["q90"])]
    pa, pb = two_instance_phases(work, row, turns, extra_a, extra_b)
    # B's q90 must follow A's "base" phase, not A's last one
    pb[-1]["wait_for"] = f"{work / f'{row}-a.json'}.phase{len(pa) - 2}.done"
    # and A's own-cache hit only after it, so the two timed phases never overlap
    pa[-1]["wait_for"] = f"{work / f'{row}-b.json'}.phase{len(pb) - 1}.done"
    return [Engine(work, f"{row}-a", model, pa, kv, env), Engine(work, f"{row}-b", model, pb, kv_b, env)]


def summarize(row: str, results: list[dict[str, Any]], work: Path) -> dict[str, Any]:
    turn = [t for r in results for t in ttfts(r, "turn")]
    seconds = [t[0] for t in turn]
    cold = [t[0] for r in results for t in ttfts(r, "cold")]
    out: dict[str, Any] = {
        "ttft_p50_ms": 1e3 * statistics.median(seconds),
        "ttft_p90_ms": 1e3 * pct(seconds, 0.9),
        "requests_per_s": len(seconds) / sum(seconds),
        "hit_tokens": sum(t[1] for t in turn),
        "cold_ttft_ms": 1e3 * statistics.median(cold),
        "engine_start_s": [r["start_s"] for r in results],
    }
    if len(results) == 2:
        q90 = ttfts(results[1], "q90")
        local = ttfts(results[0], "q90_local")
        out["q90_ttft_ms"] = 1e3 * statistics.median(t[0] for t in q90)
        out["q90_cached"] = [t[1] for t in q90]
        out["q90_local_ttft_ms"] = 1e3 * statistics.median(t[0] for t in local)
        out["q90_local_cached"] = [t[1] for t in local]
    for who, res in zip("ab", results):
        connector_time(out, work / f"{row}-{who}-stats", who, res)
    return out


def connector_time(out: dict[str, Any], stats: Path, who: str, result: dict[str, Any]) -> None:
    """Add one engine's connector counters (``stats``.<role>.json) to ``out``, and its own time
    (scheduler lookups + worker loads and gathers) against that engine's time in generate calls
    to ``out``'s sums. Both include the warmup: the counters cover every request."""
    spent_s = 0.0
    for role, counters in connector_counters(str(stats)).items():
        out[f"connector_{who}_{role}"] = counters
        spent_s += sum(counters[kind] for kind in CONNECTOR_TIMES)
    if spent_s:
        add_connector_share(out, spent_s, sum(p["seconds"] for p in result["phases"]))


def add_connector_share(out: dict[str, Any], connector_s: float, engine_s: float) -> None:
    """Add to ``out``'s sums of the connector's own time and the engine's time in generate
    calls, and their ratio (``connector_share``)."""
    out["connector_s"] = out.get("connector_s", 0.0) + connector_s
    out["engine_s"] = out.get("engine_s", 0.0) + engine_s
    out["connector_share"] = out["connector_s"] / out["engine_s"]


def run_zero_hit(
    work: Path,
    model: Path,
    pool_addr: str,
    prompts: list[list[int]],
    env: dict[str, str],
    pairs: int,
    args: argparse.Namespace,
) -> list[dict[str, Any] | str]:
    """Run ``pairs`` pairs of engines (vLLM alone, vLLM with the kvpool at ``pool_addr``) one
    pair after another, each on ``--zero-prompts`` of ``prompts`` of its own (and twice as many
    more for its kvpool engine's with / skipping pairs); returns [plain, kvpool] results
    of every pair in order, stopping at the first pair that failed. Without ``pool_addr`` both
    engines of a pair run vLLM alone (the control: what two engines of one kind differ by)."""
    results: list[dict[str, Any] | str] = []
    per, settle_s = args.zero_prompts, args.settle_s
    for i in range(pairs):
        name = f"{ZERO_HIT}-{i}" if pool_addr else f"{ZERO_HIT}-control-{i}"
        kv = connector_config("kvpool", pool_addr, work, work / f"{name}-kvpool-stats") if pool_addr else None
        if kv is not None:  # a salt of its own: no pair hits what an earlier one stored (its warmup);
            # strict: a connector that cannot start fails the row instead of measuring vLLM alone
            kv["kv_connector_extra_config"].update(salt=name, strict=True)
        mine, own = prompts[3 * i * per : (3 * i + 1) * per], prompts[(3 * i + 1) * per : (3 * i + 3) * per]
        own = own if pool_addr else []  # the control's second engine has no pool to skip
        plain, pool = zero_hit_phases(work / f"{name}-plain.json", work / f"{name}-kvpool.json", mine, own, settle_s)
        engines = [
            Engine(work, f"{name}-plain", model, plain, None, env),
            Engine(work, f"{name}-kvpool", model, pool, kv, env),
        ]
        results += [e.result() for e in engines]
        if any(isinstance(r, str) for r in results):
            break
    return results


def summarize_zero_hit(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The 0-hit pairs: per prompt, TTFT with kvpool / TTFT alone (the same prompt, seconds
    apart, on the same cores); the figure is the median over every prompt of every pair.
    Every kvpool request must have missed (``kvpool_cached_tokens`` 0). ``own_ratio``: inside
    each kvpool engine, TTFT of a prompt with the pool / of the one next to it skipping it."""
    out: dict[str, Any] = {"pairs": [], "kvpool_cached_tokens": 0}
    ratios: list[float] = []
    own_ratios: list[float] = []
    for i in range(0, len(results), 2):
        plain, pool = (
            {p["name"]: p["outputs"][0] for p in r["phases"] if p["name"].startswith("zero")}
            for r in results[i : i + 2]
        )
        names = sorted(plain, key=lambda name: int(name[4:]))
        mine = [pool[n]["seconds"] / plain[n]["seconds"] for n in names]
        ratios += mine
        out["pairs"].append(
            {
                "plain_ttft_ms": [1e3 * plain[n]["seconds"] for n in names],
                "kvpool_ttft_ms": [1e3 * pool[n]["seconds"] for n in names],
                "ratio": statistics.median(mine),
            }
        )
        out["kvpool_cached_tokens"] += sum(pool[n]["cached"] for n in names)
        # inside the kvpool engine: with the pool / skipping it, adjacent prompts
        own = {p["name"]: p for p in results[i + 1]["phases"] if p["name"].startswith(("use", "skip"))}
        pairs = [(own[f"use{j}"], own[f"skip{j}"]) for j in range(len(own) // 2)]
        if pairs:
            inside = [use["outputs"][0]["seconds"] / skip["outputs"][0]["seconds"] for use, skip in pairs]
            own_ratios += inside
            out["pairs"][-1]["own_ratio"] = statistics.median(inside)
            # 0 unless a step of a "use" prompt was counted in the "skip" phase after it
            # (vllm_testing.connector_times): then the per-phase figures are not exact
            out["pairs"][-1]["skip_connector_s"] = sum(skip.get("connector_s", 0.0) for _, skip in pairs)
        # the connector's own time in the timed prompts against their time in generate calls
        # (the warmup's slow first requests are in neither)
        phases = [p for p in results[i + 1]["phases"] if p["name"].startswith("zero") and "connector_s" in p]
        if phases:
            mine_s = [p["connector_s"] for p in phases]
            out["pairs"][-1]["connector_ms"] = [1e3 * s for s in mine_s]
            # per kind (load_s, save_s, scheduler_s): the median ms per prompt
            by_kind = {k: statistics.median(1e3 * p["connector"][k] for p in phases) for k in CONNECTOR_TIMES}
            out["pairs"][-1]["connector_median_ms"] = by_kind
            add_connector_share(out, sum(mine_s), sum(p["seconds"] for p in phases))
    out.update(ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
    if own_ratios:
        out.update(own_ratio=statistics.median(own_ratios), own_min=min(own_ratios), own_max=max(own_ratios))
    return out


def print_zero_hit(r: dict[str, Any], control: str = "") -> None:
    """``control``: ``r`` is of pairs of two vLLM-alone engines."""
    second, label = ("engine 2", f"{control} ") if control else ("with kvpool", "")
    for i, pair in enumerate(r["pairs"]):
        plain, pool = statistics.median(pair["plain_ttft_ms"]), statistics.median(pair["kvpool_ttft_ms"])
        line = f"{ZERO_HIT:>12}: {label}pair {i}: cold 2.5K TTFT alone {plain:6.1f} ms, {second} {pool:6.1f} ms "
        line += f"(medians); per prompt {second} / alone, median {pair['ratio']:.3f}"
        if "own_ratio" in pair:
            line += f"; inside the kvpool engine, with the pool / skipping it {pair['own_ratio']:.3f}"
        if pair.get("skip_connector_s"):
            line += f"; NOT exact: {1e3 * pair['skip_connector_s']:.1f} ms counted in skipped prompts"
        if pair.get("connector_ms"):
            ms = pair["connector_ms"]
            line += f"; connector's own time per prompt {statistics.median(ms):.1f} ms ({min(ms):.1f}-{max(ms):.1f})"
            kinds = pair["connector_median_ms"].items()
            line += " [medians: " + ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in kinds) + "]"
        print(line)
    spread = f"({r['ratio_min']:.3f}-{r['ratio_max']:.3f})"
    line = f"{ZERO_HIT:>12}: {label}every prompt of every pair: {second} / alone {r['ratio']:.3f} {spread}"
    if r["kvpool_cached_tokens"]:
        line += f"  NOT 0 hits: {r['kvpool_cached_tokens']} tokens cached"
    if not control and not r.get("connector_s"):
        line += "  NOT measured: the connector recorded no time (disabled? see the engine's log with --keep)"
    print(line)


def print_row(row: str, r: dict[str, Any]) -> None:
    line = f"{row:>12}: TTFT p50 {r['ttft_p50_ms']:7.1f} ms  p90 {r['ttft_p90_ms']:7.1f} ms  "
    line += f"{r['requests_per_s']:5.2f} req/s  hit tokens {r['hit_tokens']:6d}  cold 2.5K {r['cold_ttft_ms']:6.1f} ms"
    if "q90_ttft_ms" in r:
        line += f"  | 90% other-instance hit {r['q90_ttft_ms']:6.1f} ms (cached {r['q90_cached']})"
        line += f", own-cache hit {r['q90_local_ttft_ms']:6.1f} ms"
    print(line)


def print_targets(report: dict[str, Any]) -> None:
    rows = report["rows"]
    kv, alone, zero = rows.get("kvpool-2rr", {}), rows.get("vllm-2rr", {}), rows.get(ZERO_HIT, {})
    if "ratio" not in zero and "ttft_p50_ms" not in kv:
        return
    print("\ntargets (baselines from this run):")
    if "ratio" in zero:
        report["cold_ratio_vs_vllm"] = zero["ratio"]
        pairs = ", ".join(f"{p['ratio']:.3f}" for p in zero["pairs"])
        print(
            f"  0 hits ({ZERO_HIT}, ABBA, {len(zero['pairs'])} pairs of engines): TTFT with kvpool / vLLM alone = "
            f"{zero['ratio']:.3f}, pairs {pairs} (target <= 1.03)"
        )
    if "own_ratio" in zero:
        own = ", ".join(f"{p['own_ratio']:.3f}" for p in zero["pairs"])
        print(
            f"  0 hits inside one engine: TTFT with the pool / the same engine skipping it = {zero['own_ratio']:.3f}, "
            f"per engine {own}, per prompt {zero['own_min']:.3f}-{zero['own_max']:.3f} (target <= 1.03)"
        )
    if "control" in zero:
        floor = ", ".join(f"{p['ratio']:.3f}" for p in zero["control"]["pairs"])
        print(f"    the floor: two vLLM-alone engines on the same schedule, engine 2 / engine 1 = {floor}")
    if "connector_share" in zero:
        print(
            f"  0 hits: connector's own time {zero['connector_s']:.3f} s of {zero['engine_s']:.1f} s in generate "
            f"calls = {100 * zero['connector_share']:.1f}% (target <= 3%)"
        )
    if "ttft_p50_ms" not in kv:
        return
    if "connector_share" in kv:
        print(
            f"  kvpool-2rr: connector's own time {kv['connector_s']:.3f} s of {kv['engine_s']:.1f} s in generate "
            f"calls = {100 * kv['connector_share']:.1f}% (hits and misses: loads included)"
        )
    if "ttft_p50_ms" in alone:
        ratio = kv["cold_ttft_ms"] / alone["cold_ttft_ms"]
        report["cold_ratio_rows"] = ratio
        print(f"  cold TTFT kvpool-2rr / vllm-2rr (rows minutes apart, not the target's figure) = {ratio:.3f}")
    r90 = kv["q90_ttft_ms"] / kv["cold_ttft_ms"]
    rloc = kv["q90_ttft_ms"] / kv["q90_local_ttft_ms"]
    report["q90_vs_cold"], report["pool_vs_local"] = r90, rloc
    print(f"  90% from the pool (other instance): TTFT {r90:.3f}x cold (target <= 0.3)")
    print(f"  pool hit vs vLLM's own prefix hit of the same tokens: {rloc:.3f}x (target <= 1.5)")


if __name__ == "__main__":
    sys.exit(main())
