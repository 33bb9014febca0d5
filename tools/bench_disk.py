"""Disk tier throughput beside raw O_DIRECT I/O of the same bytes in the same run, and the
time a restart with many blocks on disk takes to serve its first hit.

Throughput (sequential, ``--block-bytes`` blocks, default 4 MiB):
- raw write: ``os.pwritev`` of aligned buffers into a preallocated O_DIRECT file from a
  thread pool of ``--io-threads``, ``fdatasync`` after every ``--batch`` blocks (the same
  durability the tier gives);
- tier write: ``DiskTier.enqueue`` of the same blocks (copy into the write-behind queue,
  header, O_DIRECT write, fdatasync, LMDB commit), timed until ``flush`` returns;
- raw read / tier read: ``os.preadv`` of the same extents vs ``DiskTier.read_many``
  (O_DIRECT read, header + xxh3 checksum verified, copied out), ``--batch`` blocks a call.

Restart: ``--restart-blocks`` small blocks are written, the tier is closed, and the time
from constructing a ``TieredStore`` on the same directory to its first served lease is
measured (index recovery included; process start and imports are not).

    .venv/bin/python tools/bench_disk.py [--dir /work/tmp-bench] [--total-bytes 1GiB] ...
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvpool.core.checksum import checksum64
from kvpool.core.clock import MonotonicClock
from kvpool.core.config import StoreConfig, TierConfig
from kvpool.core.keys import block_key
from kvpool.core.spec import KVSpec, Namespace
from kvpool.storage.disk_tier import DiskTier, aligned_buffer, file_layout, probe_direct_io, slot_bytes_for
from kvpool.storage.tiered_store import TieredStore

MiB = 1 << 20


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def restart_spec(block_bytes: int) -> KVSpec:
    """The spec the restart check's daemon client uses; its blocks are ``block_bytes`` long."""
    if block_bytes % 128:
        raise SystemExit("--restart-block-bytes must be a multiple of 128 for the daemon check")
    return KVSpec(model="bench-disk", num_layers=1, num_kv_heads=1, head_dim=block_bytes // 128,
                  dtype="float32", block_tokens=16)  # fmt: skip


def stored_key(block_bytes: int, i: int) -> bytes:
    """The store key of block ``i`` as the daemon builds it: the namespace digest of the
    client's spec (no salt) || the 16-byte hash."""
    return block_key(Namespace(restart_spec(block_bytes)).digest(), key(i))


def raw_io(path: pathlib.Path, blocks: list[np.ndarray], threads: int, batch: int, direct: bool) -> tuple[float, float]:
    """(write seconds, read seconds) of raw pwritev/preadv of ``blocks`` to one file."""
    block_bytes = int(blocks[0].size)
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    bufs = [aligned_buffer(block_bytes) for _ in range(min(len(blocks), threads * 2))]
    try:
        os.posix_fallocate(fd, 0, block_bytes * len(blocks))
        pool = ThreadPoolExecutor(threads)

        def write_one(i: int) -> None:
            buf = bufs[i % len(bufs)]
            np.frombuffer(buf, dtype=np.uint8)[:] = blocks[i]  # the same one copy the tier makes
            os.pwritev(fd, [buf], i * block_bytes)

        started = time.perf_counter()
        for first in range(0, len(blocks), batch):
            list(pool.map(write_one, range(first, min(first + batch, len(blocks)))))
            os.fdatasync(fd)
        write_s = time.perf_counter() - started

        def read_one(i: int) -> None:
            buf = bufs[i % len(bufs)]
            os.preadv(fd, [buf], i * block_bytes)
            np.frombuffer(buf, dtype=np.uint8).copy()  # the tier hands back a private copy

        started = time.perf_counter()
        for first in range(0, len(blocks), batch):
            list(pool.map(read_one, range(first, min(first + batch, len(blocks)))))
        read_s = time.perf_counter() - started
        pool.shutdown()
        return write_s, read_s
    finally:
        os.close(fd)


def capacity_for(n_blocks: int, block_bytes: int, slab_file_bytes: int) -> int:
    """Disk capacity holding ``n_blocks`` blocks, plus one spare slab file."""
    per_file = file_layout(slab_file_bytes, slot_bytes_for(block_bytes))[0]
    return (-(-n_blocks // per_file) + 1) * slab_file_bytes


def open_tier(directory: pathlib.Path, block_bytes: int, n_blocks: int, threads: int, batch: int) -> DiskTier:
    """One long-lived tier sized for about ``n_blocks``: from the round that fills it on, it
    runs as a daemon's disk tier does in steady state (full, evicting by LRU into slab files
    that already exist, buffer pool warm); the first rounds also pay file preallocation."""
    slab = (4 << 20) + 64 * slot_bytes_for(block_bytes)  # 64 blocks + header page/table, aligned
    capacity = capacity_for(n_blocks, block_bytes, slab)
    return DiskTier(str(directory), capacity, slab, io_threads=threads, queue_blocks=batch * 2)


def tier_io(tier: DiskTier, blocks: list[np.ndarray], first_key: int, batch: int) -> tuple[float, float, int]:
    sums = [checksum64(b) for b in blocks]
    drops_before = tier.stats.queue_full_drops
    keys = [key(first_key + i) for i in range(len(blocks))]
    started = time.perf_counter()
    for i, block in enumerate(blocks):
        while not tier.enqueue(keys[i], b"bench", block, sums[i]):
            time.sleep(0.0002)  # queue full: wait for the writer (the benchmark wants every block)
    tier.flush(600)
    write_s = time.perf_counter() - started
    assert all(tier.contains(k) for k in keys), "not every block landed (the tier evicts only older rounds)"
    started = time.perf_counter()
    for first in range(0, len(blocks), batch):
        got = tier.read_many(keys[first : first + batch])
        assert all(g is not None for g in got)
    read_s = time.perf_counter() - started
    return write_s, read_s, tier.stats.queue_full_drops - drops_before


def restart_first_hit(directory: pathlib.Path, n_blocks: int, block_bytes: int) -> tuple[float, float, float, int]:
    """(seconds to write, seconds from restart to the first served lease, seconds until the
    whole index is loaded, recovered blocks)."""
    slab = 64 * MiB
    capacity = capacity_for(n_blocks, block_bytes, slab)
    rng = np.random.default_rng(7)
    payload = rng.integers(0, 256, block_bytes, dtype=np.uint8)
    tier = DiskTier(str(directory), capacity, slab, io_threads=4)
    started = time.perf_counter()
    step = 2048
    for first in range(0, n_blocks, step):
        chunk = []
        for i in range(first, min(first + step, n_blocks)):
            block = payload.copy()
            block[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
            chunk.append((stored_key(block_bytes, i), bytes(16), block, checksum64(block)))
        tier.write_now(chunk)
    write_s = time.perf_counter() - started
    tier.close()
    store_cfg = StoreConfig(capacity_bytes=64 * MiB, slab_bytes=4 * MiB)
    tiers = TierConfig(disk_dir=str(directory), disk_capacity_bytes=capacity, disk_slab_file_bytes=slab)
    buffer = np.zeros(store_cfg.capacity_bytes, dtype=np.uint8)
    started = time.perf_counter()
    store = TieredStore(buffer, store_cfg, tiers, MonotonicClock())
    probe = stored_key(block_bytes, n_blocks // 2)
    grant = store.lease([probe])
    first_hit_s = time.perf_counter() - started
    assert len(grant.locations) == 1, "the restarted store did not serve the block"
    loc = grant.locations[0]
    got = buffer[loc.offset : loc.offset + loc.size]
    assert int.from_bytes(got[:8].tobytes(), "little") == n_blocks // 2
    store.release(grant.lease_id)
    assert store.disk is not None and store.disk.wait_recovered(120)
    full_s = time.perf_counter() - started
    recovered = int(store.summary()["tiers"]["disk"]["recovered_blocks"])
    store.close()
    return write_s, first_hit_s, full_s, recovered


def daemon_first_hit(directory: pathlib.Path, n_blocks: int, block_bytes: int) -> float:
    """Seconds from starting ``kvpool serve`` on the disk directory (process start, imports,
    index recovery, gRPC up) to the first block a ``PoolClient`` reads back, verified."""
    import contextlib
    import signal
    import socket
    import subprocess

    from kvpool.client.pool_client import PoolClient
    from kvpool.core.errors import KVPoolError

    spec = restart_spec(block_bytes)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    slab = 64 * MiB
    capacity = capacity_for(n_blocks, block_bytes, slab)
    arena_dir = tempfile.mkdtemp(prefix="bench-disk-arena-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    argv = [sys.executable, "-m", "kvpool.cli.main", "serve", "--listen", f"127.0.0.1:{port}",
            "--capacity-bytes", str(64 * MiB), "--slab-bytes", str(4 * MiB), "--arena-dir", arena_dir,
            "--disk-dir", str(directory), "--disk-capacity-bytes", str(capacity),
            "--disk-slab-file-bytes", str(slab), "--log-level", "WARNING"]  # fmt: skip
    probe = n_blocks // 2
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {proc.returncode}")
            try:
                with PoolClient.connect(f"127.0.0.1:{port}", spec, timeout_s=2.0) as client:
                    rows = client.get([key(probe)])
                    break
            except KVPoolError:
                time.sleep(0.01)
        elapsed = time.perf_counter() - started
        assert rows.shape[0] == 1, "the restarted daemon did not serve the block"
        assert int.from_bytes(rows.reshape(-1).view(np.uint8)[:8].tobytes(), "little") == probe
        return elapsed
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(arena_dir, ignore_errors=True)


def parse_bytes(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    lower = text.lower()
    for suffix, mult in units.items():
        if lower.endswith(suffix):
            return int(float(lower[: -len(suffix)]) * mult)
    return int(lower)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="", help="scratch directory on the disk to measure (default: the temp dir)")
    parser.add_argument("--block-bytes", default="4MiB")
    parser.add_argument("--total-bytes", default="1GiB")
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="alternating raw/tier rounds; the best of each is kept")
    parser.add_argument("--restart-blocks", type=int, default=100_000)
    parser.add_argument("--restart-block-bytes", type=int, default=2048)
    args = parser.parse_args(argv)
    block_bytes = parse_bytes(args.block_bytes)
    n = max(1, parse_bytes(args.total_bytes) // block_bytes)
    base = pathlib.Path(args.dir or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="bench-disk-", dir=base))
    try:
        direct = probe_direct_io(str(scratch))
        print(f"dir {scratch} (O_DIRECT {'yes' if direct else 'NO: buffered fallback'}); "
              f"{n} blocks of {block_bytes} bytes, {args.io_threads} I/O threads, batch {args.batch}")  # fmt: skip
        rng = np.random.default_rng(0)
        blocks = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(n)]
        total = n * block_bytes
        best = {"raw_w": 1e9, "raw_r": 1e9, "tier_w": 1e9, "tier_r": 1e9}
        ratios_w: list[float] = []
        ratios_r: list[float] = []
        tier = open_tier(scratch / "tier", block_bytes, 2 * n, args.io_threads, args.batch)
        for r in range(args.rounds):
            raw_path = scratch / f"raw-{r}.bin"
            rw, rr = raw_io(raw_path, blocks, args.io_threads, args.batch, direct)
            raw_path.unlink()
            tw, tr, drops = tier_io(tier, blocks, r * n, args.batch)
            best = {k: min(v, x) for (k, v), x in zip(best.items(), (rw, rr, tw, tr))}
            ratios_w.append(rw / tw)
            ratios_r.append(rr / tr)
            print(f"round {r}: raw write {total / rw / 1e9:.2f} GB/s read {total / rr / 1e9:.2f} GB/s | "
                  f"tier write {total / tw / 1e9:.2f} GB/s read {total / tr / 1e9:.2f} GB/s "
                  f"(enqueue retries on a full queue: {drops})")  # fmt: skip
        for what, t_key, r_key, ratios in (
            ("write", "tier_w", "raw_w", ratios_w),
            ("read", "tier_r", "raw_r", ratios_r),
        ):
            steady = ratios[3:] or ratios  # from round 3 the tier is full, evicting, files exist
            print(f"{what:>5}: best tier {total / best[t_key] / 1e9:.2f} GB/s vs best raw "
                  f"{total / best[r_key] / 1e9:.2f} GB/s = {best[r_key] / best[t_key]:.2f}x; "
                  f"median of per-round ratios {statistics.median(ratios):.2f}x, of the steady-state "
                  f"rounds 3+ {statistics.median(steady):.2f}x (target >= 0.8x)")  # fmt: skip
        tier.close()
        del blocks
        if args.restart_blocks:
            write_s, first_hit_s, full_s, recovered = restart_first_hit(
                scratch / "restart", args.restart_blocks, args.restart_block_bytes
            )
            daemon_s = daemon_first_hit(scratch / "restart", args.restart_blocks, args.restart_block_bytes)
            print(f"restart: wrote {args.restart_blocks} blocks of {args.restart_block_bytes} bytes "
                  f"in {write_s:.1f} s; reopen -> first hit {first_hit_s * 1000:.0f} ms (target < 2000 ms), "
                  f"whole index of {recovered} blocks loaded at {full_s * 1000:.0f} ms; whole daemon "
                  f"(process start, imports, recovery, gRPC) -> first client hit {daemon_s * 1000:.0f} ms")  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
