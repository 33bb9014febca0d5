"""Benchmark: one tenant's lookup latency while another floods the daemon with the largest
requests it accepts (issue 10 target: the victim's p99 within 2x of its idle p99).

    python tools/bench_tenancy.py [--seconds 5] [--flooders 2] [--json out.json]

Tenant A looks up a 64-block prefix it holds, one call at a time, first alone (baseline,
same run, same daemon), then while tenant B's threads send Lookup calls of
``max_batch_blocks`` hashes (its own misses) and Release calls of
``MAX_RELEASE_IDS_PER_CALL`` unknown ids, back to back. Reports p50/p99 of both phases
and their ratio. The machine is shared: compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import grpc
import numpy as np

from kvpool import KVSpec, PoolClient
from kvpool.daemon.cluster_local import free_port
from kvpool.daemon.service import MAX_RELEASE_IDS_PER_CALL
from kvpool.proto import pool_pb2, pool_pb2_grpc

SPEC = KVSpec(model="bench", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
PREFIX_BLOCKS = 64


def start_daemon() -> tuple[subprocess.Popen[bytes], str]:
    address = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "kvpool.cli.main", "serve", "--listen", address, "--capacity-bytes", "256MiB"]
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


def lookups(client: PoolClient, hashes: list[bytes], seconds: float) -> list[float]:
    """Latencies (ms) of back-to-back lookups for ``seconds``."""
    out: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        assert client.lookup(hashes) == len(hashes)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def flood(address: str, namespace: bytes, max_blocks: int, stop: threading.Event, sent: list[int]) -> None:
    rng = np.random.default_rng(os.getpid() ^ threading.get_ident())
    big = pool_pb2.HashesRequest(namespace=namespace, hashes=rng.bytes(16 * max_blocks))
    ids = pool_pb2.ReleaseRequest(lease_ids=[int(x) for x in rng.integers(1, 2**62, MAX_RELEASE_IDS_PER_CALL)])
    with grpc.insecure_channel(address) as channel:
        stub = pool_pb2_grpc.PoolStub(channel)
        while not stop.is_set():
            stub.Lookup(big, timeout=30)
            stub.Release(ids, timeout=30)
            sent[0] += 2


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--flooders", type=int, default=2)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    proc, address = start_daemon()
    try:
        with (
            PoolClient.connect(address, SPEC, salt=b"victim") as victim,
            PoolClient.connect(address, SPEC, salt=b"flooder") as flooder,
        ):
            hashes = victim.hashes(np.arange(16 * PREFIX_BLOCKS))
            victim.put(hashes, np.zeros((PREFIX_BLOCKS, *SPEC.block_shape), np.float16))
            lookups(victim, hashes, 0.5)  # warm up
            idle = lookups(victim, hashes, args.seconds)
            stop = threading.Event()
            sent = [0]
            threads = [
                threading.Thread(
                    target=flood,
                    args=(address, flooder.namespace.digest(), flooder.max_batch_blocks, stop, sent),
                    daemon=True,
                )
                for _ in range(args.flooders)
            ]
            for t in threads:
                t.start()
            time.sleep(0.5)
            loaded = lookups(victim, hashes, args.seconds)
            stop.set()
            for t in threads:
                t.join(60)
    finally:
        proc.terminate()
        proc.wait(30)
    result = {
        "idle_p50_ms": statistics.median(idle),
        "idle_p99_ms": pct(idle, 99),
        "flood_p50_ms": statistics.median(loaded),
        "flood_p99_ms": pct(loaded, 99),
        "p99_ratio": pct(loaded, 99) / pct(idle, 99),
        "flood_calls": sent[0],
        "victim_calls": [len(idle), len(loaded)],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
