"""Benchmark of the same-host data path against plain copies of the same bytes on the same
kind of memory, measured in the same run (issue 13, items 1, 2, 3, 5).

    python tools/bench_pool.py [--total-mib 256] [--repeats 7] [--clients 4] [--huge-pages auto]

For each block size, one round = (copy out of a 4 KiB-page shared mapping at its best copy
size, kvpool get_into, private huge-page copy, kvpool put, copy into the shared mapping),
repeated ``--repeats`` times (ABAB: a burst of load hits both sides), then ``--repeats``
rounds of (copy into the shared mapping, kvpool put of new keys into a full pool: each
evicts about as many blocks as it stores, "put, full pool"); every figure is the
median with its [min-max] range. Baselines: ``tools/bench_copy.py``. The daemon runs in its
own process, the client in this one; get_into verifies every block's xxh3-64, put includes
PutStart, its write window, the source checksum and the daemon's verification at commit.

The arena is measured on 4 KiB pages and, with ``--huge-pages auto`` as root, on reserved
huge pages (``--arena-huge-pages on``; this tool raises ``/proc/sys/vm/nr_hugepages`` for it
and restores it), and with ``--thp auto`` on transparent huge pages of shared memory
(``--arena-huge-pages thp``; as root this tool sets ``shmem_enabled`` to ``advise`` while
that daemon starts, which is when it takes its pages, and restores it). ``--clients N``: N
client processes read at once, beside N processes copying the same bytes out of a shared
mapping at once, alternated ``--client-rounds`` times.

Targets (docs/benchmarks.md): get_into 4 MiB >= 0.9x the shared-mapping copy and >= 0.6x the
private huge-page copy; 256 KiB >= 0.7x the shared-mapping copy; put >= 0.7x the copy into
the shared mapping; N clients >= 0.8x of N copying processes. Hashing a 128K-token prompt
<= 2 ms; a 512-block prefix lookup < 1 ms median.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_copy import Baselines, CopyWorkers, KiB, MiB, Spread, aggregate_rounds, anon_huge_bytes, timed

from kvpool import KVSpec, PoolClient
from kvpool.client.blocks import read_rows
from kvpool.core.checksum import checksum64
from kvpool.core.hashing import chain_hashes
from kvpool.daemon.cluster_local import free_port
from kvpool.proto import pool_pb2
from kvpool.storage.arena import HugePageRoom
from kvpool.storage.thp import SYSFS_THP_DIR, ShmemThp, shmem_setting

SIZES = (16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB, 4 * MiB)
NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


def start_daemon(capacity_bytes: int, *extra: str, slab_bytes: str = "64MiB") -> tuple[subprocess.Popen[bytes], str]:
    """A daemon on a free loopback port with ``extra`` flags; ``slab_bytes`` "" = the daemon's default."""
    address = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "kvpool.cli.main", "serve", "--listen", address]
    argv += ["--capacity-bytes", str(capacity_bytes), "--log-level", "WARNING", *extra]
    argv += ["--slab-bytes", slab_bytes] if slab_bytes else []
    proc = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1])), timeout=0.2):
                return proc, address
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"daemon did not start: {' '.join(argv)}")


@contextmanager
def daemon(capacity_bytes: int, *extra: str, slab_bytes: str = "64MiB") -> Iterator[str]:
    proc, address = start_daemon(capacity_bytes, *extra, slab_bytes=slab_bytes)
    try:
        yield address
    finally:
        proc.terminate()
        proc.wait(30)


@contextmanager
def reserved_huge_pages(capacity_bytes: int) -> Iterator[bool]:
    """Raise nr_hugepages by what an arena of ``capacity_bytes`` needs (root), restore after."""
    if capacity_bytes <= 0:
        yield False
        return
    try:
        with open(NR_HUGEPAGES) as fh:
            before = int(fh.read())
        room = HugePageRoom.measure()
        with open(NR_HUGEPAGES, "w") as fh:
            fh.write(str(before + room.pages_for(capacity_bytes) + 4))
    except (OSError, ValueError) as exc:
        print(f"# huge pages: cannot reserve ({exc}); the huge-page arena is not measured")
        yield False
        return
    try:
        yield HugePageRoom.measure().free_pages >= room.pages_for(capacity_bytes)
    finally:
        with open(NR_HUGEPAGES, "w") as fh:
            fh.write(str(before))


@contextmanager
def shmem_thp_on(wanted: bool) -> Iterator[bool]:
    """Transparent huge pages for shared memory (``storage/thp.py``): as they are where the
    host gives them; else set ``shmem_enabled`` to ``advise`` (root) and restore it after."""
    thp, before = ShmemThp.measure(), shmem_setting()
    if not wanted or thp.usable or not thp.page_bytes or not before:
        yield wanted and thp.usable
        return
    path = os.path.join(SYSFS_THP_DIR, "shmem_enabled")
    try:
        with open(path, "w") as fh:
            fh.write("advise")
    except OSError as exc:
        print(f"# transparent huge pages: cannot turn them on for shared memory ({exc}); that arena is not measured")
        yield False
        return
    try:
        yield ShmemThp.measure().usable
    finally:
        with open(path, "w") as fh:
            fh.write(before)


BENCH_TOKEN = "kvp_bench-tenant-token"


def write_bench_credentials(sizes: Sequence[int]) -> str:
    """A credentials file with one tenant that may use the namespaces ``bench_size`` uses."""
    import hashlib
    import tempfile

    from kvpool.core.spec import Namespace

    namespaces = [Namespace(spec_for(size), b"bench").digest().hex() for size in sizes]
    digest = hashlib.sha256(BENCH_TOKEN.encode()).hexdigest()
    tenant = {"name": "bench", "token_sha256": digest, "namespaces": namespaces}
    fd, path = tempfile.mkstemp(prefix="kvpool-bench-", suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump({"tenants": [tenant]}, fh)
    return path


def spec_for(block_bytes: int) -> KVSpec:
    # 8 layers x K,V x 8 heads x head_dim 64 x fp16 = 16 KiB per token
    tokens = block_bytes // (8 * 2 * 8 * 64 * 2)
    return KVSpec(model="bench", num_layers=8, num_kv_heads=8, head_dim=64, dtype="float16", block_tokens=tokens)


def key_hashes(tag: int, block_bytes: int, n: int) -> list[bytes]:
    return [tag.to_bytes(4, "little") + block_bytes.to_bytes(4, "little") + i.to_bytes(8, "little") for i in range(n)]


def read_all(client: PoolClient, hashes: list[bytes], dst: np.ndarray) -> None:
    """One get_into of every block (a shorter read would time as a faster one)."""
    got = client.get_into(hashes, dst)
    assert got == len(hashes), f"{got} of {len(hashes)} blocks read"


def timed_put(client: PoolClient, hashes: list[bytes], src: np.ndarray, remove_first: bool = True) -> float:
    """Seconds of one put of ``src`` under ``hashes`` (removed first, or new keys: every
    block is stored)."""
    if remove_first:
        client.remove(hashes)
    t0 = time.perf_counter()
    stored = client.put(hashes, src).stored
    seconds = time.perf_counter() - t0
    assert stored == len(hashes)
    return seconds


def bench_size(
    address: str, base: Baselines, block_bytes: int, repeats: int, token: str = "", put_ab: bool = False
) -> dict[str, Any]:
    """``put_ab``: also time, interleaved, puts whose write window switches page protection
    per put in pieces while the copy runs (``ArenaMapping.keyed_puts`` False, the fallback
    without protection keys), as ``put_pipelined``, and all at once around the copy (also
    ``pipelined_puts`` False, as before pipelining), as ``put_mprotect``."""
    spec = spec_for(block_bytes)
    n = base.nbytes // block_bytes
    total = n * block_bytes
    src = base.private_src[:total].view(np.float16).reshape(n, *spec.block_shape)
    dst = base.private_dst[:total].view(np.float16).reshape(n, *spec.block_shape)
    names: tuple[str, ...] = ("shm_read", "get_into", "huge_copy", "put", "shm_write", "put_full", "shm_write_full")
    names += ("put_pipelined", "put_mprotect") if put_ab else ()
    times: dict[str, list[float]] = {k: [] for k in names}
    with (
        PoolClient.connect(address, spec, salt=b"bench", token=token) as client,
        PoolClient.connect(address, spec, salt=b"bench", token=token) as pipelined,
        PoolClient.connect(address, spec, salt=b"bench", token=token) as plain,
    ):
        hashes = key_hashes(0, block_bytes, n)
        client.remove(hashes)
        assert client.put(hashes, src).stored == n
        assert client.get_into(hashes, dst) == n and np.array_equal(dst.view(np.uint16), src.view(np.uint16))
        if put_ab:
            pipelined._mapping().keyed_puts = False
            plain._mapping().keyed_puts = plain._mapping().pipelined_puts = False
            timed_put(pipelined, hashes, src)  # a first put populates the client's mapping's pages
            timed_put(plain, hashes, src)
        for _ in range(repeats):
            times["shm_read"].append(timed(base.shm_read))
            times["get_into"].append(timed(lambda: read_all(client, hashes, dst)))
            times["huge_copy"].append(timed(base.huge_copy))
            times["put"].append(timed_put(client, hashes, src))
            times["shm_write"].append(timed(base.shm_write))
            if put_ab:
                times["put_pipelined"].append(timed_put(pipelined, hashes, src))
                times["put_mprotect"].append(timed_put(plain, hashes, src))
        # put_full, after the rounds above (its evictions must not reach the blocks they read):
        # a batch of new keys each time into a pool full from the third batch on (capacity
        # 2 x total + 128 MiB), so each evicts about as many blocks as it stores; interleaved
        # with more copies into the shared mapping
        fresh = [key_hashes(1 + k, block_bytes, n) for k in range(repeats + 2)]
        for batch in fresh[:2]:
            assert client.put(batch, src).stored == n
        for batch in fresh[2:]:
            times["shm_write_full"].append(timed(base.shm_write))
            times["put_full"].append(timed_put(client, batch, src, remove_first=False))
        client.remove(hashes)
        for batch in fresh:
            client.remove(batch)
    row: dict[str, Any] = {"block_bytes": block_bytes, "blocks": n}
    for name, seconds in times.items():
        row[name] = Spread.of(total, seconds)
    med = {name: statistics.median(seconds) for name, seconds in times.items()}
    row["get_into_x_shm"] = med["shm_read"] / med["get_into"]
    row["get_into_x_huge"] = med["huge_copy"] / med["get_into"]
    row["put_x_shm"] = med["shm_write"] / med["put"]
    # a huge-page arena's put beside a copy on huge pages too (the same bytes between private buffers)
    row["put_x_huge"] = med["huge_copy"] / med["put"]
    row["put_full_x_shm"] = med["shm_write_full"] / med["put_full"]  # the copies timed beside them
    if put_ab:
        row["put_pipelined_x_shm"] = med["shm_write"] / med["put_pipelined"]
        row["put_mprotect_x_shm"] = med["shm_write"] / med["put_mprotect"]
    # what a block costs above its bytes at the shared-mapping copy's speed (same run)
    row["get_into_fixed_us"] = (med["get_into"] - med["shm_read"]) / n * 1e6
    row["put_fixed_us"] = (med["put"] - med["shm_write"]) / n * 1e6
    return row


def _client_worker(
    address: str, block_bytes: int, per_worker_bytes: int, tag: int, rounds: int, barrier: Any, out: Any
) -> None:  # pragma: no cover - runs in a child process
    spec = spec_for(block_bytes)
    n = per_worker_bytes // block_bytes
    data = np.random.default_rng(tag).integers(0, 1 << 16, (n, *spec.block_shape), dtype=np.uint16)
    src = data.view(np.float16)
    dst = np.empty_like(src)
    dst.fill(0)
    with PoolClient.connect(address, spec, salt=b"bench-clients") as client:
        hashes = key_hashes(tag, block_bytes, n)
        client.put(hashes, src)
        assert client.get_into(hashes, dst) == n
        for k in range(rounds):
            barrier.wait()
            t0 = time.perf_counter()
            got = client.get_into(hashes, dst)
            out.put((k, t0, time.perf_counter()))
            assert got == n
        client.remove(hashes)


def client_workers(address: str, workers: int, block_bytes: int, per_worker_bytes: int, rounds: int) -> list[float]:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(workers), ctx.Queue()
    procs = [
        ctx.Process(target=_client_worker, args=(address, block_bytes, per_worker_bytes, i + 1, rounds, barrier, out))
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    try:
        return aggregate_rounds(out, workers, rounds, per_worker_bytes)
    finally:
        for p in procs:
            p.join(120)


def bench_clients(
    address: str, workers: int, block_bytes: int, per_worker_bytes: int, piece_bytes: int, rounds: int, ab: int
) -> dict[str, Any]:
    """``ab`` alternations of (N copying processes, N kvpool clients), ``rounds`` each."""
    copies: list[float] = []
    reads: list[float] = []
    for _ in range(ab):
        copies += CopyWorkers(workers, per_worker_bytes, piece_bytes, rounds).run()
        reads += client_workers(address, workers, block_bytes, per_worker_bytes, rounds)
    copy, read = statistics.median(copies), statistics.median(reads)
    return {
        "workers": workers,
        "block_bytes": block_bytes,
        "copy": Spread(copy, min(copies), max(copies)),
        "get_into": Spread(read, min(reads), max(reads)),
        "x_copy": read / copy,
    }


def two_pass_read(arena: np.ndarray, dst: np.ndarray, offsets: Sequence[int], checksums: Sequence[int]) -> int:
    """The read path before issue 13: copy each whole block, then checksum it (a second
    pass over bytes that are out of cache by then). Kept here as the A/B reference."""
    block_bytes = dst.shape[1]
    for i, (offset, expected) in enumerate(zip(offsets, checksums, strict=True)):
        np.copyto(dst[i], arena[offset : offset + block_bytes])
        if checksum64(dst[i]) != expected:
            return i
    return len(offsets)


def bench_one_pass(base: Baselines, sizes: Sequence[int], repeats: int) -> list[dict[str, Any]]:
    """In this process, out of the 4 KiB-page shared mapping: the two-pass read against
    ``read_rows`` (one pass, adjacent blocks together), interleaved, per block size."""
    rows = []
    for block_bytes in sizes:
        n = base.nbytes // block_bytes
        arena = base.shared.view[: n * block_bytes]
        dst = base.private_dst[: n * block_bytes].reshape(n, block_bytes)
        offsets = [i * block_bytes for i in range(n)]
        sums = [checksum64(arena[o : o + block_bytes]) for o in offsets]
        old: list[float] = []
        new: list[float] = []
        for _ in range(repeats):
            old.append(timed(functools.partial(two_pass_read, arena, dst, offsets, sums)))
            new.append(timed(functools.partial(read_rows, arena, dst, offsets, sums, "bench")))
        rows.append(
            {
                "block_bytes": block_bytes,
                "two_pass": Spread.of(n * block_bytes, old),
                "one_pass": Spread.of(n * block_bytes, new),
                "x": statistics.median(old) / statistics.median(new),
            }
        )
    return rows


def bench_hashing(repeats: int) -> list[dict[str, float]]:
    tokens = np.random.default_rng(0).integers(0, 150_000, 131_072, dtype=np.int64)
    seed = bytes(16)
    rows = []
    for block_tokens in (16, 64, 256):
        run = functools.partial(chain_hashes, seed, tokens, block_tokens)
        seconds = min(timed(run) for _ in range(max(repeats, 20)))
        rows.append({"block_tokens": block_tokens, "tokens": tokens.size, "ms": seconds * 1e3})
    return rows


#: a prompt lookup every this many ms in the paced measurement: one tenant at 50 prompts/s,
#: within its default share of the daemon (--tenant-rate-units-per-s 1000: a 512-block lookup
#: costs ~4.6 units, docs/security.md), so the figure is a lookup's latency, not the rate limit
LOOKUP_PACE_MS = 20


def release_nothing(client: PoolClient) -> None:
    """A Release of no lease: through the daemon's call path (local socket or gRPC), its
    auth and its fairness gate, and nothing else."""
    client._rpc("Release", pool_pb2.ReleaseRequest())


#: the two control paths of a same-host client, timed side by side
LOOKUP_PATHS = ("local", "grpc")


def bench_lookup(address: str, samples: int) -> dict[str, Any]:
    """A 512-block lookup's latency over the daemon's local-call socket and over gRPC (a
    client with ``local_calls=False``), paced (``LOOKUP_PACE_MS``; the two paths and their
    floors alternated), and back to back (where the tenant's call rate holds it: the
    daemon's fairness, not the lookup, sets that figure)."""
    spec = KVSpec(model="bench-lookup", num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16)
    tokens = np.arange(512 * 16)
    with (
        PoolClient.connect(address, spec, salt=b"bench") as local,
        PoolClient.connect(address, spec, salt=b"bench", local_calls=False) as remote,
    ):
        if local._local is None:
            raise SystemExit("the daemon offered no local-call socket (--local-calls off?)")
        clients = {"local": local, "grpc": remote}
        hashes = local.hashes(tokens)
        local.put(hashes, np.zeros((len(hashes), *spec.block_shape), dtype=np.float16))
        assert remote.lookup(hashes) == len(hashes)
        report: dict[str, Any] = {"blocks": 512}
        paced: dict[str, list[float]] = {path: [] for path in LOOKUP_PATHS}
        bare: dict[str, list[float]] = {path: [] for path in LOOKUP_PATHS}  # a call the daemon does nothing for
        for path in LOOKUP_PATHS:
            client = clients[path]
            report[path] = {
                "back_to_back": median_p99_ms([timed(lambda c=client: c.lookup(hashes)) for _ in range(samples)])
            }
        for _ in range(samples // 2):  # alternated, paced alike
            for path in LOOKUP_PATHS:
                client = clients[path]
                for out, call in (
                    (paced[path], lambda c=client: c.lookup(hashes)),
                    (bare[path], lambda c=client: release_nothing(c)),
                ):
                    time.sleep(LOOKUP_PACE_MS / 1e3)
                    out.append(timed(call))
    for path in LOOKUP_PATHS:
        median_ms, p99_ms = median_p99_ms(paced[path])
        back = report[path].pop("back_to_back")
        report[path] |= {
            "median_ms": median_ms,
            "p99_ms": p99_ms,
            "bare_call_median_ms": median_p99_ms(bare[path])[0],
            "back_to_back_median_ms": back[0],
            "back_to_back_p99_ms": back[1],
        }
    return report


def median_p99_ms(seconds: Sequence[float]) -> tuple[float, float]:
    ordered = sorted(seconds)
    return statistics.median(ordered) * 1e3, ordered[int(0.99 * len(ordered))] * 1e3


def print_sizes(title: str, rows: Sequence[dict[str, Any]]) -> None:
    print(f"\n## {title}: GB/s median [min-max]; x = ratio of medians to the baseline beside it")
    print(
        f"{'block':>7} | {'shm read':>20} {'get_into':>20} {'x shm':>6} {'x huge':>6} {'fixed us':>8} | "
        f"{'huge copy':>20} | {'shm write':>20} {'put':>20} {'x shm':>6} {'x huge':>6} {'fixed us':>8} | "
        f"{'put, full pool':>20} {'x shm':>6}"
    )
    for r in rows:
        print(
            f"{r['block_bytes'] // KiB:>5}Ki | {r['shm_read'].text():>20} {r['get_into'].text():>20} "
            f"{r['get_into_x_shm']:>6.2f} {r['get_into_x_huge']:>6.2f} {r['get_into_fixed_us']:>8.1f} | "
            f"{r['huge_copy'].text():>20} | {r['shm_write'].text():>20} {r['put'].text():>20} "
            f"{r['put_x_shm']:>6.2f} {r['put_x_huge']:>6.2f} {r['put_fixed_us']:>8.1f} | "
            f"{r['put_full'].text():>20} {r['put_full_x_shm']:>6.2f}"
            + (
                f" | put, pipelined mprotect {r['put_pipelined'].text()} x shm {r['put_pipelined_x_shm']:.2f}"
                f" | put, whole-window mprotect {r['put_mprotect'].text()} x shm {r['put_mprotect_x_shm']:.2f}"
                if "put_mprotect" in r
                else ""
            )
        )


def fixed_cost_us(rows: Sequence[dict[str, Any]], name: str, most_bytes: int = 2 * MiB) -> float:
    """The per-block fixed cost of ``name``: the intercept of a least-squares line of median
    time per block against block bytes, over the sizes up to ``most_bytes`` (the slope is
    the per-byte cost: copy and checksum)."""
    fit = [r for r in rows if r["block_bytes"] <= most_bytes]
    if len(fit) < 2:
        return float("nan")
    x = [r["block_bytes"] for r in fit]
    y = [r["block_bytes"] / (r[name].median_GBps * 1e9) for r in fit]
    _, intercept = np.polyfit(x, y, 1)
    return float(intercept) * 1e6


def verdicts(rows: Sequence[dict[str, Any]], clients: dict[str, Any] | None) -> list[str]:
    by = {r["block_bytes"]: r for r in rows}
    out = []

    def check(what: str, value: float, target: float) -> None:
        out.append(f"{what}: {value:.2f}x (target >= {target}x) -> {'MET' if value >= target else 'MISSED'}")

    if 4 * MiB in by:
        check("get_into 4 MiB vs shared-mapping copy", by[4 * MiB]["get_into_x_shm"], 0.9)
        check("get_into 4 MiB vs private huge-page copy", by[4 * MiB]["get_into_x_huge"], 0.6)
        check("put 4 MiB vs copy into shared mapping", by[4 * MiB]["put_x_shm"], 0.7)
    if 256 * KiB in by:
        check("get_into 256 KiB vs shared-mapping copy", by[256 * KiB]["get_into_x_shm"], 0.7)
    if clients:
        check(f"{clients['workers']} clients vs {clients['workers']} copying processes", clients["x_copy"], 0.8)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-mib", type=int, default=256, help="bytes moved per measurement")
    parser.add_argument("--repeats", type=int, default=7, help="ABAB rounds per block size (medians)")
    parser.add_argument("--sizes", default=",".join(str(s // KiB) for s in SIZES), help="block sizes in KiB")
    parser.add_argument("--clients", type=int, default=4, help="client processes reading at once (0: skip)")
    parser.add_argument("--client-rounds", type=int, default=3, help="alternations of copies / clients")
    parser.add_argument("--huge-pages", choices=("auto", "off"), default="auto", help="also measure a huge-page arena")
    parser.add_argument(
        "--thp",
        choices=("auto", "off"),
        default="auto",
        help="also measure an arena on transparent huge pages (--arena-huge-pages thp; as root this tool sets "
        "shmem_enabled to advise while that daemon starts and restores it)",
    )
    parser.add_argument(
        "--put-ab",
        action="store_true",
        help="also time puts through mprotect-switched windows (no protection key), interleaved with the "
        "default ones: switched in pieces while the copy runs ('put, pipelined mprotect', the fallback "
        "without keys) and all at once around the copy ('put, whole-window mprotect', before pipelining)",
    )
    parser.add_argument("--json", default="", help="also write the figures to this file")
    parser.add_argument(
        "--tenant-arena",
        action="store_true",
        help="also measure a per-tenant arena (--credentials: segments, docs/security.md) beside a one-piece "
        "memfd arena (--arena-handoff fd), get_into and put only",
    )
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C: the daemon is stopped and the huge-page reservation restored
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    total = args.total_mib * MiB
    sizes = [int(s) * KiB for s in args.sizes.split(",") if s]
    capacity = 2 * total + 128 * MiB
    base = Baselines.make(total)
    found = base.pick_pieces(max(3, args.repeats // 2))
    print(f"# kvpool bench_pool: {os.cpu_count()} CPUs, load average {os.getloadavg()}, {args.total_mib} MiB")
    for kind in ("read", "write"):
        pieces = ", ".join(f"{p // KiB} KiB {v:.2f}" for p, v in found[kind].items())
        print(f"# shared-mapping {kind} GB/s by copy size: {pieces}")
    print(f"# private huge-page buffers: AnonHugePages {anon_huge_bytes() // MiB} MiB")
    results: dict[str, Any] = {"load_average": os.getloadavg(), "pieces": found}
    one_pass = bench_one_pass(base, sizes, args.repeats)
    print("\n## verified read out of the 4 KiB-page shared mapping, in-process: two passes vs one (GB/s)")
    for r in one_pass:
        print(
            f"{r['block_bytes'] // KiB:>5}Ki  copy-then-checksum {r['two_pass'].text()}  "
            f"read_rows {r['one_pass'].text()}  = {r['x']:.2f}x"
        )
    results["one_pass"] = one_pass
    arenas: list[tuple[str, tuple[str, ...]]] = [("4 KiB-page arena", ())]
    if args.tenant_arena:
        creds = write_bench_credentials(sizes)
        arenas.append(("one-piece memfd arena", ("--arena-handoff", "fd")))
        arenas.append(("per-tenant arena", ("--arena-handoff", "fd", "--credentials", creds)))
    with reserved_huge_pages(capacity if args.huge_pages == "auto" else 0) as huge_ok:
        if huge_ok and args.huge_pages == "auto":
            arenas.append(("huge-page arena", ("--arena-huge-pages", "on", "--arena-handoff", "fd")))
        if args.thp == "auto":
            arenas.append(("transparent-huge-page arena", ("--arena-huge-pages", "thp", "--arena-handoff", "fd")))
        for title, extra in arenas:
            token = BENCH_TOKEN if "--credentials" in extra else ""
            with contextlib.ExitStack() as run:
                # the daemon takes its transparent huge pages before it listens and keeps them:
                # shmem_enabled is advise only while the thp arena's daemon starts
                with shmem_thp_on("thp" in extra) as thp_ok:
                    if "thp" in extra and not thp_ok:
                        continue
                    address = run.enter_context(daemon(capacity, *extra))
                rows = [bench_size(address, base, size, args.repeats, token, args.put_ab) for size in sizes]
                clients = None
                if args.clients and not token:
                    block = 4 * MiB if 4 * MiB in sizes else sizes[-1]
                    per = max(block, total // args.clients // block * block)
                    clients = bench_clients(
                        address, args.clients, block, per, base.read_piece_bytes, 5, args.client_rounds
                    )
                lookup = bench_lookup(address, 300) if not extra else None
            print_sizes(title, rows)
            fixed = {name: fixed_cost_us(rows, name) for name in ("get_into", "put", "shm_read")}
            if any(us == us for us in fixed.values()):  # nan: fewer than two sizes up to 2 MiB
                print(
                    "per-block fixed cost, 16 KiB-2 MiB (line fit): "
                    + ", ".join(f"{name} {us:.1f} us" for name, us in fixed.items())
                )
            if clients:
                print(
                    f"{clients['workers']} clients x {clients['block_bytes'] // MiB} MiB blocks: aggregate get_into "
                    f"{clients['get_into'].text()} GB/s vs {clients['workers']} copying processes "
                    f"{clients['copy'].text()} GB/s = {clients['x_copy']:.2f}x"
                )
            for line in verdicts(rows, clients):
                print(f"target ({title}) {line}")
            results[title] = {"sizes": rows, "clients": clients, "fixed_us": fixed}
            if lookup:
                results["lookup"] = lookup
    hashing = bench_hashing(args.repeats)
    for h in hashing:
        print(f"hash 128K tokens, {int(h['block_tokens'])} tokens/block: {h['ms']:.2f} ms")
    worst = max(h["ms"] for h in hashing)
    print(f"target hashing <= 2 ms: worst {worst:.2f} ms -> {'MET' if worst <= 2.0 else 'MISSED'}")
    lk = results["lookup"]
    for path in LOOKUP_PATHS:
        row = lk[path]
        how = "local socket" if path == "local" else "gRPC"
        verdict = (
            f" -> {'MET' if row['median_ms'] < 1.0 else 'MISSED'} (target < 1 ms median)" if path == "local" else ""
        )
        print(
            f"lookup 512 blocks via daemon, {how}, one every {LOOKUP_PACE_MS} ms: median {row['median_ms']:.3f} ms, "
            f"p99 {row['p99_ms']:.3f} ms{verdict}; back to back (the tenant's call rate): median "
            f"{row['back_to_back_median_ms']:.3f} ms, p99 {row['back_to_back_p99_ms']:.3f} ms"
        )
        print(
            f"  beside it, paced alike: a call the daemon does nothing for ({how}'s floor here) "
            f"{row['bare_call_median_ms']:.3f} ms median: the lookup's own cost "
            f"{row['median_ms'] - row['bare_call_median_ms']:.3f} ms"
        )
    print(f"  local socket / gRPC, paced lookup: {lk['local']['median_ms'] / lk['grpc']['median_ms']:.2f}x the time")
    print(f"# load average at the end {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results | {"hashing": hashing}, fh, indent=2, default=lambda o: o.__dict__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
