"""How long a pool stalls its callers while it fills and while it evicts: the daemon's full
garbage collections with ``--gc-freeze off`` (CPython's default) against ``on``, measured in
the same run (ABAB).

    python tools/bench_fill_pauses.py [--blocks 1048576] [--block-kib 4] [--churn 0] [--rounds 2]

Each round starts a daemon with room for ``--blocks`` blocks and fills it with puts of
``--per-put`` blocks from one client ("fill"), then puts ``--churn`` times as many more into
the full pool, each evicting about as much as it stores ("churn": a pool in service), while
a second client sends a 64-block lookup every ``--probe-ms``. A full collection walks every
index entry with the interpreter lock held, so every call waits it out: it shows as the
slowest puts and lookups. Printed per phase and setting: the puts' and lookups' median, p99
and max (ms), the phase's put time, and the daemon's own longest full collection of the run
(``Stats`` ``gc_full_pause_seconds_max``, in ms here; with ``off`` the daemon does not time
them). The rest of the slowest fill calls are the index's dict growing (each doubling copies
it), which neither setting changes. Target (docs/benchmarks.md): with ``on`` the p99 put is
at most 0.5x of ``off``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pool import daemon, key_hashes

from kvpool import KVSpec, PoolClient
from kvpool.client.admin import PoolAdmin

MARGIN_BYTES = 512 << 20


def probe(address: str, spec: KVSpec, every_s: float, stop: threading.Event, out: dict[str, list[float]],
          phase: list[str]) -> None:  # fmt: skip
    """A second client's paced lookups for the whole run (what a serving engine's scheduler
    sends), each filed under the phase (``phase[0]``) it ran in."""
    with PoolClient.connect(address, spec, salt=b"fill") as client:
        hashes = key_hashes(0, spec.block_bytes, 64)
        while not stop.wait(every_s):
            t0 = time.perf_counter()
            client.lookup(hashes)
            out.setdefault(phase[0], []).append(time.perf_counter() - t0)


def run(args: argparse.Namespace, gc_freeze: str) -> dict[str, dict[str, float]]:
    """Fill a daemon, then keep putting into the full pool (``--churn``): per phase, the
    figures ``figures`` names."""
    block_bytes = args.block_kib * 1024
    # K and V of 16 tokens of one fp16 head: 64 bytes per head_dim
    head_dim = block_bytes // 64
    spec = KVSpec(model="fill", num_layers=1, num_kv_heads=1, head_dim=head_dim, dtype="float16", block_tokens=16)
    assert spec.block_bytes == block_bytes, spec.block_bytes
    rng = np.random.default_rng(0)
    src = rng.integers(0, 255, args.per_put * block_bytes, dtype=np.uint8).view(np.float16)
    src = src.reshape(args.per_put, *spec.block_shape)
    fill_puts = args.blocks // args.per_put
    phases = {"fill": range(fill_puts), "churn": range(fill_puts, fill_puts + int(fill_puts * args.churn))}
    puts: dict[str, list[float]] = {}
    lookups: dict[str, list[float]] = {}
    phase = ["fill"]
    # the daemon's default slab size: a pool as `kvpool serve` makes it
    with daemon(args.blocks * block_bytes + MARGIN_BYTES, "--gc-freeze", gc_freeze, slab_bytes="") as address:
        stop = threading.Event()
        prober = threading.Thread(target=probe, args=(address, spec, args.probe_ms / 1000, stop, lookups, phase))
        with PoolClient.connect(address, spec, salt=b"fill") as client:
            prober.start()
            try:
                for name, numbers in phases.items():
                    phase[0] = name
                    for i in numbers:
                        hashes = key_hashes(1 + i, block_bytes, args.per_put)
                        t0 = time.perf_counter()
                        stored = client.put(hashes, src).stored
                        puts.setdefault(name, []).append(time.perf_counter() - t0)
                        assert stored == args.per_put, stored
            finally:
                stop.set()
                prober.join()
        with PoolAdmin(address) as admin:
            stats = admin.stats()
    gc_pause_ms = float(stats.get("gc_full_pause_seconds_max", float("nan"))) * 1e3
    return {name: figures(puts[name], lookups.get(name, [0.0]), gc_pause_ms) for name in puts}


def figures(puts: list[float], lookups: list[float], gc_pause_ms: float) -> dict[str, float]:
    return {
        "put_median": statistics.median(puts) * 1e3,
        "put_p99": float(np.percentile(puts, 99)) * 1e3,
        "put_max": max(puts) * 1e3,
        "lookup_median": statistics.median(lookups) * 1e3,
        "lookup_p99": float(np.percentile(lookups, 99)) * 1e3,
        "lookup_max": max(lookups) * 1e3,
        "puts_s": sum(puts),
        "gc_pause_max": gc_pause_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1 << 20, help="blocks the pool is filled with")
    parser.add_argument("--block-kib", type=int, default=4, help="block size in KiB")
    parser.add_argument("--per-put", type=int, default=4096, help="blocks per put")
    parser.add_argument("--churn", type=float, default=0.0, help="then put this many times --blocks more (evicting)")
    parser.add_argument("--probe-ms", type=float, default=5.0, help="pace of the second client's lookups")
    parser.add_argument("--rounds", type=int, default=2, help="ABAB rounds (off, on)")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, dict[str, float]]]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for setting in ("off", "on"):
            runs[setting].append(run(args, setting))
    keys = ("put_median", "put_p99", "put_max", "lookup_median", "lookup_p99", "lookup_max", "puts_s", "gc_pause_max")
    print(f"# {args.blocks} blocks of {args.block_kib} KiB, {args.per_put} per put, then {args.churn}x that into the")
    print("# full pool; figures in ms (puts_s: the phase's puts in s; gc_pause_max: the whole run's)")
    for name in ("fill", "churn"):
        if not all(name in r for results in runs.values() for r in results):
            continue
        print(f"## {name}")
        print(f"{'--gc-freeze':12s}" + "".join(f"{k:>14s}" for k in keys))
        for setting, results in runs.items():
            for r in results:
                print(f"{setting:12s}" + "".join(f"{r[name][k]:14.1f}" for k in keys))
        for key in ("put_p99", "put_max", "lookup_p99", "lookup_max", "puts_s"):
            ratios = [on[name][key] / off[name][key] for on, off in zip(runs["on"], runs["off"], strict=True)]
            print(f"# {name} {key} on / off: " + ", ".join(f"{r:.2f}x" for r in ratios))


if __name__ == "__main__":
    main()
