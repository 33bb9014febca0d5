"""Puts into a full host tier: the watermark drain (``storage/watermarks.py``: once a put
crosses the high watermark, each put evicts its room and as much again until the low
watermark) against the burst it replaced (the crossing put evicts all the way down to low),
in one process, alternated (ABAB).

    python tools/bench_evict_drain.py [--blocks 1048576] [--per-put 4096] [--rounds 2]

Each round builds a ``HostStore`` with room for ``--blocks`` 4 KiB blocks (plus 512 MiB, at
the default watermarks 0.95 / 0.85), fills it, then puts as many blocks again (each put
evicting), and times every put of that second phase (``put_start`` + ``put_commit``, the
store lock held for their work). The burst is the same code with ``EVICT_AHEAD`` set past any
put's size. Printed: median, p99, max, how many puts took over ``--slow-ms``, and the total.
Expected: the burst's slow puts (one every (high - low) of the tier) gone, the total the same;
the slow puts left with the drain are the LRU's ``OrderedDict`` and the index's dict
rebuilding their tables (docs/benchmarks.md), which neither rule changes.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np

from kvpool.core.checksum import checksum64
from kvpool.core.clock import MonotonicClock
from kvpool.core.config import StoreConfig
from kvpool.storage import watermarks
from kvpool.storage.host_store import HostStore

BLOCK = 4096
MARGIN_BYTES = 512 << 20
NAMESPACE = b"n" * 16
BURST = 1 << 50  # EVICT_AHEAD past any put: the crossing put evicts down to low


def churn(evict_ahead: int, blocks: int, per_put: int) -> list[float]:
    """Seconds of each put after the store is full."""
    watermarks.EVICT_AHEAD = evict_ahead
    capacity = blocks * BLOCK + MARGIN_BYTES
    store = HostStore(
        np.zeros(capacity, dtype=np.uint8), StoreConfig(capacity_bytes=capacity, slab_bytes=64 << 20), MonotonicClock()
    )
    zero = checksum64(np.zeros(BLOCK, np.uint8))  # the arena is zeros: every block checks
    seconds: list[float] = []
    fill_puts = blocks // per_put
    for i in range(2 * fill_puts):
        keys = [NAMESPACE + i.to_bytes(8, "little") + j.to_bytes(16, "little") for j in range(per_put)]
        t0 = time.perf_counter()
        grant = store.put_start(NAMESPACE, keys, BLOCK)
        store.put_commit(grant.put_id, [zero] * per_put, verify_one_in=16)
        if i >= fill_puts:
            seconds.append(time.perf_counter() - t0)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1 << 20, help="4 KiB blocks the tier holds")
    parser.add_argument("--per-put", type=int, default=4096, help="blocks per put")
    parser.add_argument("--rounds", type=int, default=2, help="ABAB rounds (burst, drain)")
    parser.add_argument("--slow-ms", type=float, default=100.0, help="a put over this is counted as slow")
    args = parser.parse_args()
    default_ahead = watermarks.EVICT_AHEAD
    results: dict[str, list[list[float]]] = {"burst": [], "drain": []}
    gc.freeze()  # as kvpool serve does (--gc-freeze): the collector is not what is measured
    try:
        for _ in range(args.rounds):
            for name, ahead in (("burst", BURST), ("drain", default_ahead)):
                results[name].append(churn(ahead, args.blocks, args.per_put))
                gc.collect()
                gc.freeze()
    finally:
        watermarks.EVICT_AHEAD = default_ahead
    print(f"# {args.blocks} blocks of 4 KiB, then as many again in puts of {args.per_put}; ms per put")
    print(f"{'rule':8s}{'median':>10s}{'p99':>10s}{'max':>10s}{'slow':>8s}{'total s':>10s}")
    for name, runs in results.items():
        for seconds in runs:
            ms = np.array(seconds) * 1e3
            slow = int((ms > args.slow_ms).sum())
            print(
                f"{name:8s}{statistics.median(ms):10.1f}{np.percentile(ms, 99):10.1f}{ms.max():10.1f}"
                f"{slow:8d}{ms.sum() / 1e3:10.2f}"
            )
    for key, fn in (("p99", lambda s: np.percentile(s, 99)), ("total", np.sum)):
        ratios = [fn(d) / fn(b) for d, b in zip(results["drain"], results["burst"], strict=True)]
        print(f"# drain / burst {key}: " + ", ".join(f"{r:.2f}x" for r in ratios))


if __name__ == "__main__":
    main()
