"""What reserving the arena up front costs at daemon start (docs/tiers.md, "Capacity").

For each size: ``SharedArena.create`` (capacity check + ``posix_fallocate`` of every page)
against the baseline of the same file left sparse (``ftruncate`` only, what the daemon did
before), both on the same directory in the same run, interleaved, median of ``--rounds``.

    .venv/bin/python tools/bench_arena_reserve.py --sizes 256MiB,1GiB,2GiB --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

from kvpool.daemon.config_loader import parse_bytes
from kvpool.storage.arena import SharedArena


def sparse_ms(directory: str, size_bytes: int) -> float:
    path = os.path.join(directory, f"bench-sparse-{uuid.uuid4().hex[:8]}.arena")
    started = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size_bytes)
    elapsed = (time.perf_counter() - started) * 1000
    os.close(fd)
    os.unlink(path)
    return elapsed


def reserved_ms(directory: str, size_bytes: int) -> float:
    started = time.perf_counter()
    arena = SharedArena.create(directory, size_bytes, name_hint="bench")
    elapsed = (time.perf_counter() - started) * 1000
    arena.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--sizes", default="256MiB,1GiB,2GiB")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print("| size | sparse (ftruncate), median ms | reserved (check + posix_fallocate), median ms | GiB/s reserved |")
    print("|---|---:|---:|---:|")
    for text in args.sizes.split(","):
        size_bytes = parse_bytes(text)
        sparse, reserved = [], []
        for _ in range(args.rounds):
            sparse.append(sparse_ms(args.dir, size_bytes))
            reserved.append(reserved_ms(args.dir, size_bytes))
        med = statistics.median(reserved)
        rate = size_bytes / (1 << 30) / (med / 1000)
        print(f"| {text} | {statistics.median(sparse):.2f} | {med:.0f} | {rate:.1f} |")


if __name__ == "__main__":
    main()
