"""Benchmark: one tenant's lookup latency while another floods the daemon with the largest
requests it accepts (issue 10 target: the victim's p99 within 2x of its idle p99).

    python tools/bench_tenancy.py [--seconds 5] [--rounds 3] [--flooders 2] [--mode miss|hit]
                                  [--gate both|on|off] [--json out.json]

Tenant A (this process) looks up a 64-block prefix it holds, one call at a time, first
alone, then while tenant B floods from ``--flooders`` separate processes (each its own
gRPC channel, back to back, never backing off): ``miss`` sends Lookup calls of
``max_batch_blocks`` hashes (misses: the lookup stops at the first) and Release calls of
``MAX_RELEASE_IDS_PER_CALL`` unknown ids; ``hit`` first stores 8,192 blocks and then looks
all of them up (each lookup walks 8,192 keys under the store lock) and releases as above;
``small`` stores 1,023 blocks and looks all of them up, nothing else (one cost unit per
call: before every call paid into the rate, such calls were never rate-limited); ``tiny``
sends 1-hash lookups that miss, nothing else (the per-call cost alone; ``percall1k`` runs the
victim's daemon with ``--tenant-call-cost-items 1024``, one unit per call).
Each round alternates ``--windows`` idle and flood windows on the same daemon (the
flooders pause between), so every ratio has its own baseline, taken under the same
background load.
``--gate all`` (the default) runs the whole thing five times: against a daemon with
per-tenant fairness (its defaults, ``on``), with fairness billing calls by request size
only (``--tenant-walk-cost-items 0``, ``size``: the walked blocks of a hit lookup not
billed), with no per-call cost (``--tenant-call-cost-items 0``, ``percall0``: calls under
1,024 hashes never rate-limited, the rule before), one without (``--tenant-budget-units 0``,
``off``), and with the flood sent to
a second daemon (``elsewhere``: the victim's daemon does nothing for the flooder, so what
remains is the machine's own contention, the floor no daemon-side policy can go below).
The machine is shared: compare ratios within a run, and run it a few times.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import grpc
import numpy as np

from kvpool import KVSpec, PoolClient
from kvpool.core.hashing import pack_hashes
from kvpool.daemon.cluster_local import free_port
from kvpool.daemon.service import MAX_RELEASE_IDS_PER_CALL
from kvpool.proto import pool_pb2, pool_pb2_grpc

SPEC = KVSpec(model="bench", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
PREFIX_BLOCKS = 64
HIT_BLOCKS = 8192
#: the "small" flood: lookups of this many hashes, all hits (one cost unit each, the most
#: blocks a one-unit call can walk)
SMALL_BLOCKS = 1023


def start_daemon(gate: str) -> tuple[subprocess.Popen[bytes], str]:
    """``gate``: "on" (fairness at its defaults), "size" (on, but calls billed by their request
    size only: ``--tenant-walk-cost-items 0``, the rule before walks were billed) or "off"."""
    address = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "kvpool.cli.main", "serve", "--listen", address, "--capacity-bytes", "256MiB"]
    if gate == "off":
        argv += ["--tenant-budget-units", "0"]
    elif gate == "size":
        argv += ["--tenant-walk-cost-items", "0"]
    elif gate == "percall0":
        argv += ["--tenant-call-cost-items", "0"]
    elif gate == "percall1k":
        argv += ["--tenant-call-cost-items", "1024"]
    proc = subprocess.Popen([*argv, "--log-level", "WARNING"], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(address) as channel:
                pool_pb2_grpc.PoolStub(channel).Stats(pool_pb2.StatsRequest(), timeout=1)
            return proc, address
        except grpc.RpcError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"daemon on {address} did not start")


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used: what the flood costs the daemon."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lookups(client: PoolClient, hashes: list[bytes], seconds: float) -> list[float]:
    """Latencies (ms) of back-to-back lookups for ``seconds``."""
    out: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        assert client.lookup(hashes) == len(hashes)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def flood(address: str, mode: str, go: Any, stop: Any, results: Any) -> None:
    """One flooding process (tenant B): the largest requests, back to back, whenever ``go``
    is set, until ``stop``; puts (sent, refused TENANT_BUSY) on ``results``."""
    rng = np.random.default_rng(os.getpid())
    with PoolClient.connect(address, SPEC, salt=b"flooder") as b:
        if mode in ("hit", "small"):
            stored = HIT_BLOCKS if mode == "hit" else SMALL_BLOCKS
            hashes = b.hashes(np.arange(16 * stored))
            for i in range(0, stored, 1024):
                b.put(hashes[i : i + 1024], np.zeros((len(hashes[i : i + 1024]), *SPEC.block_shape), np.float16))
            big = pool_pb2.HashesRequest(namespace=b.namespace.digest(), hashes=pack_hashes(hashes))
        elif mode == "tiny":
            big = pool_pb2.HashesRequest(namespace=b.namespace.digest(), hashes=rng.bytes(16))
        else:
            big = pool_pb2.HashesRequest(namespace=b.namespace.digest(), hashes=rng.bytes(16 * b.max_batch_blocks))
    ids = pool_pb2.ReleaseRequest(lease_ids=[int(x) for x in rng.integers(1, 2**62, MAX_RELEASE_IDS_PER_CALL)])
    sent = refused = 0
    results.put(None)  # ready
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = pool_pb2_grpc.PoolStub(channel)
        while not stop.is_set():
            if not go.wait(0.1):
                continue
            calls = ((stub.Lookup, big),) if mode in ("small", "tiny") else ((stub.Lookup, big), (stub.Release, ids))
            for method, request in calls:
                try:
                    method(request, timeout=30)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    refused += 1
                sent += 1
    results.put((sent, refused))


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run(gate: str, args: argparse.Namespace) -> dict[str, Any]:
    """One daemon, ``args.rounds`` rounds of idle then flood. ``gate``: "on" (per-tenant
    fairness at its defaults), "off" (``--tenant-budget-units 0``), or "elsewhere": the
    flood goes to a second daemon, so the victim's daemon does no work for it and what is
    left of the slowdown is the machine itself (CPU time the flooding processes take)."""
    proc, address = start_daemon("on" if gate == "elsewhere" else gate)
    other: subprocess.Popen[bytes] | None = None
    flood_address = address
    if gate == "elsewhere":
        other, flood_address = start_daemon("on")
    ctx = mp.get_context("spawn")
    rounds: list[dict[str, Any]] = []
    go, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=flood, args=(flood_address, args.mode, go, stop, results)) for _ in range(args.flooders)
    ]
    try:
        for p in procs:
            p.start()
        for _ in procs:
            results.get(timeout=300)  # connected (and, in "hit" mode, stored its blocks)
        with PoolClient.connect(address, SPEC, salt=b"victim") as victim:
            hashes = victim.hashes(np.arange(16 * PREFIX_BLOCKS))
            victim.put(hashes, np.zeros((PREFIX_BLOCKS, *SPEC.block_shape), np.float16))
            lookups(victim, hashes, 0.5)  # warm up
            for _ in range(args.rounds):
                idle: list[float] = []
                loaded: list[float] = []
                cpu = {"idle": 0.0, "flood": 0.0}  # the victim's daemon's CPU seconds in each phase
                for _ in range(args.windows):  # idle and flood windows alternate: slow drifts in
                    go.clear()  # the machine's background load hit both phases alike
                    time.sleep(0.2)  # the flood's calls in flight drain
                    before = cpu_s(proc.pid)
                    idle += lookups(victim, hashes, args.seconds / args.windows)
                    cpu["idle"] += cpu_s(proc.pid) - before
                    go.set()
                    time.sleep(0.2)
                    before = cpu_s(proc.pid)
                    loaded += lookups(victim, hashes, args.seconds / args.windows)
                    cpu["flood"] += cpu_s(proc.pid) - before
                go.clear()
                rounds.append(
                    {
                        "idle_p50_ms": round(statistics.median(idle), 3),
                        "idle_p99_ms": round(pct(idle, 99), 3),
                        "flood_p50_ms": round(statistics.median(loaded), 3),
                        "flood_p99_ms": round(pct(loaded, 99), 3),
                        "p99_ratio": round(pct(loaded, 99) / pct(idle, 99), 2),
                        "victim_calls": [len(idle), len(loaded)],
                        # daemon CPU per second of each phase (the victim's own calls included)
                        "daemon_cpu_ms_per_s": [round(1e3 * cpu[k] / args.seconds) for k in ("idle", "flood")],
                    }
                )
                print(f"gate {gate} " + json.dumps(rounds[-1]), flush=True)
        stop.set()
        counts = [results.get(timeout=120) for _ in procs]
        for r in rounds:
            r["flood_calls_all_rounds"] = sum(c[0] for c in counts)
            r["flood_refused_all_rounds"] = sum(c[1] for c in counts)
    finally:
        stop.set()
        for p in procs:
            p.join(60)
        for d in (proc, other):
            if d is not None:
                d.terminate()
                d.wait(30)
    ratios = [r["p99_ratio"] for r in rounds]
    return {
        "gate": gate,
        "mode": args.mode,
        "rounds": rounds,
        "p99_ratio_min": min(ratios),
        "p99_ratio_max": max(ratios),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--windows", type=int, default=10, help="idle/flood window pairs per round")
    parser.add_argument("--flooders", type=int, default=2)
    parser.add_argument("--mode", choices=["miss", "hit", "small", "tiny"], default="miss")
    parser.add_argument(
        "--gate", choices=["all", "both", "on", "size", "percall0", "percall1k", "off", "elsewhere"], default="all"
    )
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    gates = {"all": ["on", "size", "percall0", "off", "elsewhere"], "both": ["on", "off"]}.get(args.gate, [args.gate])
    result = [run(gate, args) for gate in gates]
    for r in result:
        print(f"gate {r['gate']} ({r['mode']}): p99 ratio {r['p99_ratio_min']}-{r['p99_ratio_max']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
